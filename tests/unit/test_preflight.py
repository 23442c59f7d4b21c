"""Everything checked before anything starts (issue 41, item 3): serve-pd refuses what it used to
accept without a word, naming the field and the value, before any server loads a model; `kvconnectors
check-config` runs the same checks on a hand-written --kv-transfer-config; the connector refuses a
push-mode decode whose landing port nobody can be told; the proxy refuses one server as both legs.
Each case was accepted silently before these checks (seen: every dry run below printed its plan).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvconnectors.errors import ConfigError
from kvconnectors.integration import launcher as L
from kvconnectors.integration import preflight
from kvconnectors.tiered.config import TieredConfig

from launcher_kit import parse  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def serve_pd_error(capsys, *argv: str) -> str:
    """serve-pd --dry-run's refusal (exit status 2), from stderr."""
    assert L.run(parse("--dry-run", *argv)) == 2
    captured = capsys.readouterr()
    assert not captured.out, f"a refused run printed a plan: {captured.out[:200]}"
    return captured.err


def extra(**settings) -> str:
    return json.dumps({"kv_connector_extra_config": settings})


@pytest.mark.parametrize("argv, needles", [
    # the list of silent accepts, in its order
    (["--kv-transfer-config-extra", extra(dram_byte=5)], ["kv_connector_extra_config.dram_byte=5",
                                                         "did you mean 'dram_bytes'"]),
    (["--kv-transfer-config-extra", extra(dram_bytes="8gigs")], ["dram_bytes='8gigs'", "unknown size unit 'gigs'"]),
    (["--kv-transfer-config-extra", extra(lease_ttl_s=-1)], ["lease_ttl_s=-1", "> 0"]),
    (["--kv-transfer-config-extra", '{"kv_role": "kv_both"}'], ["kv_role='kv_both'", "kv_producer"]),
    (["--kv-transfer-config-extra", '{"kv_conector": "X"}'], ["kv_conector='X'", "did you mean 'kv_connector'"]),
    (["--kv-transfer-config-extra", '{"dram_bytes": "2g"}'],
     ["dram_bytes='2g'", "did you mean kv_connector_extra_config.dram_bytes"]),
    (["--vllm-args", "--port 9000"], ["--vllm-args '--port 9000'", "--port is set by serve-pd"]),
    (["--vllm-args", "--max-num-seqs 4 --kv-transfer-config {}"], ["--kv-transfer-config is set by serve-pd",
                                                                   "--kv-transfer-config-extra"]),
    (["--kv-transfer-config-extra", extra(dram_bytes=1.5)], ["dram_bytes=1.5", "must be whole", "'1.5g'"]),
    (["--kv-transfer-config-extra", extra(nvme_dirs=["/tmp"])], ["nvme_dirs=['/tmp']", "nvme_bytes is 0"]),
    (["--kv-transfer-config-extra", extra(instance_name="a/b")], ["instance_name='a/b'", "[A-Za-z0-9_.]"]),
    (["--kv-transfer-config-extra", '{"kv_connector": "NixlConnector"}'], ["kv_connector='NixlConnector'",
                                                                          "--connector"]),
])
def test_serve_pd_refuses_before_starting_naming_field_and_value(capsys, argv, needles):
    err = serve_pd_error(capsys, *argv)
    for needle in needles:
        assert needle in err, f"{needle!r} not in {err!r}"


def test_a_missing_nvme_dir_is_found_before_start_up(capsys, tmp_path):
    """Found by the store at start-up before, i.e. after the model and KV cache were loaded."""
    missing = tmp_path / "nvme0"
    err = serve_pd_error(capsys, "--kv-transfer-config-extra", extra(nvme_dirs=[str(missing)], nvme_bytes="1g"))
    assert f"nvme_dirs={str(missing)!r}: does not exist" in err and "prefill-0" in err


def test_a_dry_run_creates_nothing_even_with_nvme_create_dirs(capsys, tmp_path):
    wanted = tmp_path / "nvme0"
    assert L.run(parse("--dry-run", "--kv-transfer-config-extra",
                       extra(nvme_dirs=[str(wanted)], nvme_bytes="1g", nvme_create_dirs=True))) == 0
    assert not wanted.exists()


def test_health_timeout_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        parse("--health-timeout", "-1")
    assert "argument --health-timeout: expected a number of seconds > 0, got '-1'" in capsys.readouterr().err


def test_a_good_config_still_plans(capsys):
    assert L.run(parse("--dry-run", "--vllm-args", "--max-num-seqs 4", "--kv-transfer-config-extra",
                       extra(dram_bytes="512MiB", lease_ttl_s=10))) == 0
    assert "--max-num-seqs 4" in capsys.readouterr().out


# ------------------------------------------------------------------------ the connector's own checks
def test_a_push_decode_needs_a_fixed_store_port():
    with pytest.raises(ConfigError, match="store_port=0: must be a fixed port on a push-mode decode"):
        TieredConfig.from_extra({"transfer_mode": "push"}).check_role("kv_consumer")
    TieredConfig.from_extra({"transfer_mode": "push", "store_port": 7000}).check_role("kv_consumer")
    TieredConfig.from_extra({"transfer_mode": "push"}).check_role("kv_producer")  # the kernel picks: it is told
    TieredConfig.from_extra({}).check_role("kv_consumer")  # a pull decode runs no store server


def test_the_connector_applies_the_role_check_at_construction():
    """connector.py calls check_role (the launcher is not the only way in)."""
    source = (REPO / "kvconnectors" / "tiered" / "connector.py").read_text()
    assert "config.check_role(ktc.kv_role)" in source


def test_check_local_finds_an_unreadable_secret_file(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("x" * 40)
    secret.chmod(0o644)  # others may read it
    with pytest.raises(ConfigError) as err:
        TieredConfig.from_extra({"secret_file": str(secret)}).check_local()
    assert err.value.key == "secret_file", err.value


# ------------------------------------------------------------------------ check-config
def check_config(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvconnectors.cli", "check-config", *argv],
                          capture_output=True, text=True, timeout=120, cwd=REPO)


def test_check_config_prints_the_effective_settings_or_the_refusal(tmp_path):
    ok = {"kv_connector": "TieredConnector", "kv_role": "kv_producer",
          "kv_connector_extra_config": {"dram_bytes": "2g", "transport": "shm"}}
    out = check_config(json.dumps(ok))
    assert out.returncode == 0, out.stderr
    effective = json.loads(out.stdout)["kv_connector_extra_config"]
    assert effective["dram_bytes"] == 2 << 30 and effective["transport"] == "shm"
    assert effective["lease_ttl_s"] == 30.0 and effective["advertise_host"] == "127.0.0.1"  # defaults filled in

    bad = {**ok, "kv_role": "kv_consumer", "kv_connector_extra_config": {"transfer_mode": "push"}}
    path = tmp_path / "kv.json"
    path.write_text(json.dumps(bad))
    out = check_config(f"@{path}")
    assert out.returncode == 2 and not out.stdout
    assert "kv_connector_extra_config.store_port=0: must be a fixed port on a push-mode decode" in out.stderr


def test_check_config_refuses_what_vllm_would():
    with pytest.raises(ConfigError, match="kv_role='kv_bot'"):
        preflight.check_transfer_config({"kv_connector": "TieredConnector", "kv_role": "kv_bot"})


# ------------------------------------------------------------------------ the proxy
def test_the_proxy_refuses_one_server_as_both_legs_unless_told_they_are_kv_both():
    argv = ["--prefill", "http://127.0.0.1:8100", "--decode", "http://127.0.0.1:8100"]
    with pytest.raises(ValueError, match="--prefill and --decode name the same instance.*pass --kv-both"):
        L.parse_proxy_argv(argv)
    assert L.parse_proxy_argv([*argv, "--kv-both"]).kv_both  # tests/e2e/test_proxy_servers.py runs such a pool


# ------------------------------------------------------------------------ --base-port
def test_base_port_gives_the_same_ports_every_run():
    """Random ports every run before (issue 41): a pool's addresses could not be written down."""
    def ports() -> list[int]:
        return L.planned_ports(L.plan_instances(parse("--base-port", "21000", "--decode", "2", "--decode-tp", "2"),
                                                cores=[0, 1]))
    first = ports()
    assert first == ports()
    assert sorted(first) == list(range(21000, 21000 + 3 + 1 + 2 * 2)), first  # 3 HTTP, 1 + 2x2 store ranks


def test_base_port_refuses_a_port_in_use_before_starting(capsys):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert L.run(parse("--base-port", str(port), "--proxy", "none")) == 2
    err = capsys.readouterr().err
    assert f"--base-port {port}: port {port} on 127.0.0.1 is already in use" in err


def test_the_served_model_name_is_the_model_id_as_vllm_names_it():
    """serve-pd renamed meta-llama/Llama-3.1-8B-Instruct to Llama-3.1-8B-Instruct (issue 41): clients
    that send the id vLLM would serve under got 404s."""
    args = parse()
    args.model = "meta-llama/Llama-3.1-8B-Instruct"
    plan = L.plan_instances(args, cores=[0])[0]
    srv = L.build_server(plan, args, Path("/tmp/logs"))
    assert srv.served_model_name == "meta-llama/Llama-3.1-8B-Instruct"
    cmd = srv.command()
    assert cmd[cmd.index("--served-model-name") + 1] == "meta-llama/Llama-3.1-8B-Instruct"


# ------------------------------------------------------------------------ checks before the model loads
def test_vllms_config_time_hook_runs_the_local_checks(tmp_path):
    """vLLM asks requires_piecewise_for_cudagraph while it builds its config (CUDA, graphs on), before
    any model loads: a missing NVMe directory is refused there, not after minutes of loading."""
    from kvconnectors.tiered.connector import TieredConnector

    missing = tmp_path / "nvme0"
    with pytest.raises(ConfigError) as err:
        TieredConnector.requires_piecewise_for_cudagraph({"nvme_dirs": [str(missing)], "nvme_bytes": "1g"})
    assert err.value.key == "nvme_dirs"
    # a directory start-up would create is left to it: asking does not make directories
    assert TieredConnector.requires_piecewise_for_cudagraph(
        {"nvme_dirs": [str(missing)], "nvme_bytes": "1g", "nvme_create_dirs": True}) is False
    assert not missing.exists()


def test_transport_nixl_without_nixl_is_refused_before_start(monkeypatch):
    from kvconnectors.transport import nixl_agent

    monkeypatch.setattr(nixl_agent, "nixl_import_error", lambda: "ModuleNotFoundError: No module named 'nixl'")
    with pytest.raises(ConfigError, match="transport='nixl': needs the NIXL Python package"):
        preflight.check_transfer_config({"kv_connector": "TieredConnector", "kv_role": "kv_producer",
                                         "kv_connector_extra_config": {"transport": "nixl"}})
