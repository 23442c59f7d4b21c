"""`kvconnectors serve-pd` without an engine: plans, configs and command lines, then the whole
launcher against fake vLLM servers (the fake `api_server` module from test_serving_fake.py): start,
proxy a request, shut down on SIGTERM, and shut down when an instance dies."""

from __future__ import annotations

import argparse
import glob
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from kvconnectors.integration import launcher as L

from launcher_kit import counter, parse  # noqa: E402
from kvconnectors.serving import CPU_DEFAULT_ARGS, CPU_KV_CACHE_BYTES, TEST_SETTINGS_ARGS, free_port

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "integration" / "configs"




# --------------------------------------------------------------------------------------------
# plans and configs


def test_tiered_plan_roles_ports_and_cores():
    args = parse("--prefill", "2", "--decode", "3", "--transport", "shm")
    plans = L.plan_instances(args, cores=[0, 1], port_fn=counter())
    assert [p.name for p in plans] == ["prefill-0", "prefill-1", "decode-0", "decode-1", "decode-2"]
    assert [p.kv_role for p in plans] == ["kv_producer"] * 2 + ["kv_consumer"] * 3
    assert [p.core for p in plans] == [0, 1, 0, 1, 0]  # instance i -> core i % ncpu
    cfg = plans[0].kv_transfer_config
    assert cfg == {"kv_connector": "TieredConnector", "kv_connector_module_path": "kvconnectors.tiered",
                   "kv_role": "kv_producer",
                   "kv_connector_extra_config": {"transport": "shm", "store_port": cfg["kv_connector_extra_config"]["store_port"],
                                                 "dram_bytes": CPU_KV_CACHE_BYTES}}
    ports = [p.port for p in plans] + [p.kv_transfer_config["kv_connector_extra_config"]["store_port"] for p in plans]
    assert len(set(ports)) == len(ports), "every HTTP and store port is unique"
    for p in plans:
        assert p.kv_addr == f"127.0.0.1:{p.kv_transfer_config['kv_connector_extra_config']['store_port']}"
        assert not p.env


def test_tiered_default_transport_is_tcp_and_extra_is_deep_merged():
    extra = {"kv_load_failure_policy": "recompute", "kv_connector_extra_config": {"lease_ttl_s": 5, "store_port": 7777}}
    args = parse("--kv-transfer-config-extra", json.dumps(extra))
    p, d = L.plan_instances(args, cores=[0], port_fn=counter())
    assert p.kv_transfer_config["kv_load_failure_policy"] == "recompute"
    assert p.kv_transfer_config["kv_connector_extra_config"] == {"transport": "tcp", "store_port": 7777, "lease_ttl_s": 5,
                                                                 "dram_bytes": CPU_KV_CACHE_BYTES}
    assert d.kv_addr == "127.0.0.1:7777"  # the address follows an overridden store_port
    assert p.core == d.core == 0


def test_a_production_pool_gets_no_test_settings():
    """serve-pd forced --no-enable-prefix-caching --seed 0 (test settings) on every pool (issue 41):
    a production pool runs vLLM's defaults, prefix cache on; --test-settings (tests, benchmarks, and
    PDCluster by default) adds them."""
    def flags(*argv: str) -> list[str]:
        args = parse(*argv)
        return L.build_server(L.plan_instances(args, cores=[0], port_fn=counter())[0], args, Path("/tmp/l")).command()
    production = flags()
    assert not set(TEST_SETTINGS_ARGS) & set(production), production
    assert "--enforce-eager" in production  # the CPU engine flags stay
    assert " ".join(TEST_SETTINGS_ARGS) in " ".join(flags("--test-settings"))
    from kvconnectors.integration.cluster import PDCluster

    pd = PDCluster("/models/tiny", device="cpu", log_dir=Path("/tmp/l"))
    assert " ".join(TEST_SETTINGS_ARGS) in " ".join(pd.servers[0].command())


def test_cpu_store_is_the_size_of_the_kv_cache_unless_set():
    """On CPU the DRAM tier defaults to the CPU KV budget (faulting in the connector's 1 GiB default was
    most of each instance's store start-up); a dram_bytes the user sets wins."""
    for p in L.plan_instances(parse("--mode", "push"), cores=[0], port_fn=counter()):  # both have a store
        assert p.kv_transfer_config["kv_connector_extra_config"]["dram_bytes"] == CPU_KV_CACHE_BYTES
    assert f"--kv-cache-memory-bytes {CPU_KV_CACHE_BYTES}" in " ".join(CPU_DEFAULT_ARGS)
    own = parse("--kv-transfer-config-extra", '{"kv_connector_extra_config": {"dram_bytes": "2g"}}')
    for p in L.plan_instances(own, cores=[0], port_fn=counter()):
        assert p.kv_transfer_config["kv_connector_extra_config"]["dram_bytes"] == "2g"


def test_nixl_plan_has_cpu_buffer_and_unique_side_channel_ports():
    args = parse("--connector", "NixlConnector", "--prefill", "2", "--decode", "2")
    plans = L.plan_instances(args, cores=[0, 1], port_fn=counter())
    for p in plans:
        assert p.kv_transfer_config == {"kv_connector": "NixlConnector", "kv_role": p.kv_role,
                                        "kv_buffer_device": "cpu"}
        assert p.kv_addr is None
    side = [p.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] for p in plans]
    assert len(set(side)) == 4


def test_no_pin():
    plans = L.plan_instances(parse("--no-pin"), cores=[0, 1], port_fn=counter())
    assert all(p.core is None for p in plans)


def test_server_command_and_env():
    args = parse("--vllm-args", "--max-num-seqs 4 --max-model-len 4096", "--served-model-name", "tiny")
    plans = L.plan_instances(args, cores=[0, 1], port_fn=counter())
    srv = L.build_server(plans[1], args, Path("/tmp/logs"))
    cmd = srv.command()
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert json.loads(cmd[cmd.index("--kv-transfer-config") + 1]) == plans[1].kv_transfer_config
    assert cmd[-4:] == ["--max-num-seqs", "4", "--max-model-len", "4096"]  # after the defaults: they win
    assert cmd[cmd.index("--port") + 1] == str(plans[1].port)
    assert srv.core == 1 and srv.name == "decode-0" and srv.served_model_name == "tiny"
    env = srv.environment()
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert env["PYTHONPATH"].split(os.pathsep)[0] == L.PACKAGE_ROOT  # servers can import kvconnectors
    assert str(srv.log_path) == "/tmp/logs/decode-0.log"


def test_proxy_argv_lists_pools_and_kv_addresses():
    args = parse("--prefill", "2", "--mode", "push", "--proxy-port", "9999", "--proxy-args", "--prefill-retries 0")
    plans = L.plan_instances(args, cores=[0, 1], port_fn=counter())
    argv = L.proxy_argv(plans, args)
    ns = L.parse_proxy_argv(argv)
    assert ns.port == 9999 and ns.mode == "push" and ns.prefill_retries == 0
    assert [s.url for s in ns.prefill] == [f"http://127.0.0.1:{p.port}" for p in plans[:2]]
    assert ns.decode[0].kv_addr == plans[2].kv_addr
    # push: every instance runs in push mode (decode instances accept pushes at their store port)
    assert all(p.kv_transfer_config["kv_connector_extra_config"]["transfer_mode"] == "push" for p in plans)
    # decode instances keep full CUDA graphs (they never stage); prefill instances let push decide
    assert [p.kv_transfer_config["kv_connector_extra_config"].get("cudagraph_piecewise") for p in plans] \
        == [None, None, "off"]


@pytest.mark.parametrize("argv, needle", [
    (["--connector", "NixlConnector", "--transport", "tcp"], "--transport 'tcp'"),
    (["--connector", "NixlConnector", "--mode", "push"], "--mode push"),
    (["--proxy-args", "--prefill-timeout 0"], "--proxy-args"),
])
def test_bad_combinations_fail_before_anything_starts(argv, needle, capsys):
    assert L.run(parse(*argv)) == 2
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize("argv, needle", [
    (["--prefill", "0"], "argument --prefill: expected an integer >= 1, got '0'"),
    (["--kv-transfer-config-extra", "{bad"], "argument --kv-transfer-config-extra: invalid JSON '{bad'"),
    (["--kv-transfer-config-extra", "[1]"], "expected a JSON object"),
    (["--connector", "FooConnector"], "argument --connector: invalid choice: 'FooConnector'"),
])
def test_bad_flags_name_flag_and_value(argv, needle, capsys):
    with pytest.raises(SystemExit):
        parse(*argv)
    assert needle in capsys.readouterr().err


def test_dry_run_prints_plan_and_starts_nothing(capsys):
    assert L.run(parse("--prefill", "1", "--decode", "2", "--dry-run", "--log-dir", "/tmp/x")) == 0
    out = capsys.readouterr().out
    assert out.count("vllm.entrypoints.openai.api_server") == 3
    assert out.count("VLLM_CPU_OMP_THREADS_BIND=") == 3
    assert "-m kvconnectors.integration.proxy" in out and out.count("--decode") == 2


def test_dry_run_without_log_dir_leaves_no_folder(capsys, tmp_path, monkeypatch):
    """A dry run starts nothing, so it makes no log folder under the temp dir either (one per run
    used to be left behind, empty)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert L.run(parse("--prefill", "1", "--decode", "1", "--dry-run")) == 0
    assert "vllm.entrypoints.openai.api_server" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []


def test_help_explains_every_flag():
    out = subprocess.run([sys.executable, "-m", "kvconnectors.cli", "serve-pd", "--help"],
                         capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 0, out.stderr
    parser = argparse.ArgumentParser()
    L.add_arguments(parser)
    for action in parser._actions:
        assert action.help, f"{action.option_strings} has no help"
        for flag in action.option_strings:
            assert flag in out.stdout


# --------------------------------------------------------------------------------------------
# example config files


def test_example_configs_are_valid_kv_transfer_configs():
    files = sorted(glob.glob(str(CONFIGS / "*.json")))
    names = {Path(f).name for f in files}
    for connector in ("tiered", "tiered_push", "tiered_cuda", "tiered_push_cuda", "nixl_cpu", "nixl_cuda",
                      "mooncake", "lmcache"):
        assert {f"{connector}_producer.json", f"{connector}_consumer.json"} <= names
    vllm_config = pytest.importorskip("vllm.config")
    for f in files:
        cfg = json.loads(Path(f).read_text())
        kv = vllm_config.KVTransferConfig(**cfg)  # extra="forbid": typos in top-level keys fail here
        assert kv.kv_role == ("kv_producer" if "producer" in f else "kv_consumer"), f
    assert "VLLM_NIXL_SIDE_CHANNEL_PORT" in (CONFIGS / "README.md").read_text()


def test_example_configs_per_device():
    """NIXL's files register the device they are named for; TieredConnector's keys all pass its own
    validation, and a GPU file is its CPU twin with a bigger store (what the README says)."""
    from kvconnectors.tiered.config import TieredConfig

    def load(name: str) -> dict:
        return json.loads((CONFIGS / name).read_text())

    for role in ("producer", "consumer"):
        assert load(f"nixl_cpu_{role}.json")["kv_buffer_device"] == "cpu"
        assert load(f"nixl_cuda_{role}.json")["kv_buffer_device"] == "cuda"
        assert {k: v for k, v in load(f"nixl_cuda_{role}.json").items() if k != "kv_buffer_device"} == \
            {k: v for k, v in load(f"nixl_cpu_{role}.json").items() if k != "kv_buffer_device"}
        for mode in ("", "push_"):
            cpu, cuda = load(f"tiered_{mode}{role}.json"), load(f"tiered_{mode}cuda_{role}.json")
            for cfg in (cpu, cuda):
                TieredConfig.from_extra(cfg["kv_connector_extra_config"])  # unknown keys and bad values fail
                assert cfg["kv_connector_extra_config"].get("transfer_mode", "pull") == (mode.rstrip("_") or "pull")
            strip = lambda c: {**c, "kv_connector_extra_config": {  # noqa: E731
                k: v for k, v in c["kv_connector_extra_config"].items() if k != "dram_bytes"}}
            assert strip(cuda) == strip(cpu), (mode, role)
    for name in ("tiered_cuda_producer.json", "tiered_push_cuda_producer.json", "tiered_push_cuda_consumer.json"):
        assert load(name)["kv_connector_extra_config"]["dram_bytes"] == "16g", name


def test_configs_readme_names_every_file():
    import fnmatch
    import re

    readme = (CONFIGS / "README.md").read_text()
    # names and globs with a literal start (`*_producer.json` would match every producer)
    patterns = re.findall(r"`(\w[\w*]*\.json)`", readme)
    for f in sorted(CONFIGS.glob("*.json")):
        assert any(fnmatch.fnmatch(f.name, pat) for pat in patterns), f"{f.name} is not in configs/README.md"
    assert "## On GPUs" in readme and "kv_buffer_device: cuda" in readme


def test_generated_configs_are_valid_kv_transfer_configs():
    vllm_config = pytest.importorskip("vllm.config")
    for connector in L.CONNECTORS:
        for p in L.plan_instances(parse("--connector", connector), cores=[0], port_fn=counter()):
            vllm_config.KVTransferConfig(**p.kv_transfer_config)


# --------------------------------------------------------------------------------------------
# the launcher end to end, against fake servers


@pytest.fixture
def fake_env(tmp_path_factory):
    from test_serving_fake import write_fake_vllm  # same fake as the serving tests

    root = write_fake_vllm(tmp_path_factory.mktemp("fakevllm"))
    env = dict(os.environ, PYTHONPATH=str(root))
    return env


def _start_launcher(env, tmp_path, *extra: str) -> tuple[subprocess.Popen, int]:
    model = tmp_path / "tiny"
    model.mkdir(exist_ok=True)
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvconnectors.cli", "serve-pd", "--model", str(model), "--prefill", "1",
         "--device", "cpu",  # the same fake CPU launch on any host (a GPU host would plan GPUs)
         "--decode", "1", "--proxy-port", str(port), "--health-timeout", "30", "--log-dir",
         str(tmp_path / "logs"), *extra],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 40
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"launcher exited early:\n{proc.stdout.read().decode()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                if r.status == 200:
                    return proc, port
        except OSError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"proxy never healthy:\n{proc.stdout.read().decode()}")


def _descendants(proc: subprocess.Popen) -> list[psutil.Process]:
    return psutil.Process(proc.pid).children(recursive=True)


def _assert_all_gone(procs: list[psutil.Process], timeout: float = 10) -> None:
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"left behind: {alive}"


@pytest.mark.timeout(120)
def test_launcher_serves_and_stops_on_sigterm(fake_env, tmp_path):
    proc, port = _start_launcher(fake_env, tmp_path, "--quiet")
    try:
        children = _descendants(proc)
        assert len(children) >= 4  # 2 fake servers, each with a child
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions", method="POST",
            data=json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 3}).encode(),
            headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as r:
            body = json.loads(r.read())
        assert body["choices"][0]["token_ids"] == [0, 1, 2]
        assert body["echo"]["kv_transfer_params"]["kv_role"] == "kv_producer"  # came from the prefill leg
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=40)
        assert proc.returncode == 0, out.decode()
        assert "all instances stopped" in out.decode()
        _assert_all_gone(children)
        logs = {p.name: p.read_text() for p in (tmp_path / "logs").glob("*.log")}
        assert set(logs) == {"prefill-0.log", "decode-0.log"}
        assert '"kv_role": "kv_consumer"' in logs["decode-0.log"]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.timeout(120)
def test_launcher_stops_everything_when_an_instance_dies(fake_env, tmp_path):
    proc, port = _start_launcher(fake_env, tmp_path)  # not quiet: logs are echoed with prefixes
    try:
        children = _descendants(proc)
        servers = [c for c in children if "vllm.entrypoints.openai.api_server" in " ".join(c.cmdline())]
        assert len(servers) == 2
        servers[1].kill()
        out, _ = proc.communicate(timeout=40)
        text = out.decode()
        assert proc.returncode == 1, text
        assert "exited with code" in text and "shutting everything down" in text
        assert "[prefill-0] fake vllm ready" in text and "[decode-0] fake vllm ready" in text
        _assert_all_gone(children)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_during_startup_stops_started_servers(fake_env, tmp_path, sig):
    model = tmp_path / "tiny"
    model.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvconnectors.cli", "serve-pd", "--model", str(model), "--quiet", "--device", "cpu",
         "--proxy-port", str(free_port()), "--health-timeout", "60", "--log-dir", str(tmp_path / "logs")],
        cwd=REPO, env={**fake_env, "FAKE_VLLM_MODE": "hang"}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while len(children := _descendants(proc)) < 4:  # 2 servers that never get healthy + children
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.1)
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 130, out.decode()
        assert "interrupted during start-up" in out.decode()
        _assert_all_gone(children)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.timeout(120)
def test_proxy_as_subprocess(fake_env, tmp_path):
    proc, port = _start_launcher(fake_env, tmp_path, "--quiet", "--proxy", "subprocess")
    try:
        children = _descendants(proc)
        assert any("kvconnectors.integration.proxy" in " ".join(c.cmdline()) for c in children)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=40)
        assert proc.returncode == 0, out.decode()
        _assert_all_gone(children)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
