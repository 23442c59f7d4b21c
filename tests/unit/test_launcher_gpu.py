"""`kvconnectors serve-pd` on GPUs, without a GPU and without an engine: the CUDA host is faked by
replacing the launcher's detection (`cuda_device_count`), then plans, command lines, environments,
the --gpus assignment (tensor parallelism included), its errors and --dry-run are checked. The CPU
plan of the same arguments is checked beside it: the CPU-only flags are there, and only there."""

from __future__ import annotations

import argparse
import json
import sys
import types
from pathlib import Path

import pytest

from kvconnectors import serving
from kvconnectors.integration import launcher as L

from launcher_kit import counter, parse  # noqa: E402

# conftest.py's autouse fixture replaces the detection with "no CUDA" for every unit test; the real
# one is taken here, at collection, before any fixture runs.
REAL_CUDA_DEVICE_COUNT = L.cuda_device_count

CPU_ONLY_ARGS = ("--dtype", "--kv-cache-memory-bytes", "--enforce-eager", "--block-size", "--max-model-len")
CPU_ONLY_ENV = ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE", "UCX_MODULES", "UCX_NET_DEVICES")




def block_counter(start: int = 30000):
    """A fake port_block_fn: n consecutive ports per call."""
    state = {"n": start}

    def nxt(n: int) -> int:
        base = state["n"]
        state["n"] += n
        return base
    return nxt


@pytest.fixture
def cuda_host(monkeypatch):
    """A host whose torch sees 4 CUDA devices, no CUDA_VISIBLE_DEVICES, and none of the CPU-only
    variables inherited (other tests in this process may have set them: engines.py sets UCX_*)."""
    monkeypatch.setattr(L, "cuda_device_count", lambda: 4)
    for key in ("CUDA_VISIBLE_DEVICES", *CPU_ONLY_ENV):
        monkeypatch.delenv(key, raising=False)


def servers(args: argparse.Namespace, **kw) -> list[serving.VllmServer]:
    plans = L.plan_instances(args, cores=[0, 1], port_fn=counter(), **kw)
    return [L.build_server(p, args, Path("/tmp/logs")) for p in plans]


# --------------------------------------------------------------------------------------------
# what a CUDA server gets, and what a CPU server keeps


def test_cuda_host_gets_gpus_and_no_cpu_only_flags(cuda_host):
    args = parse("--vllm-args", "--max-num-seqs 8")
    plans = L.plan_instances(args, cores=[0, 1], port_fn=counter())
    assert [(p.name, p.device, p.gpus, p.core) for p in plans] == [
        ("prefill-0", "cuda", ("0",), None), ("decode-0", "cuda", ("1",), None)]
    for plan in plans:
        srv = L.build_server(plan, args, Path("/tmp/logs"))
        cmd, env = srv.command(), srv.environment()
        assert not set(CPU_ONLY_ARGS) & set(cmd), cmd
        assert "float32" not in cmd
        assert cmd[cmd.index("--port") + 2:] == ["--kv-transfer-config", cmd[cmd.index("--kv-transfer-config") + 1],
                                                 "--max-num-seqs", "8"]
        assert env["CUDA_VISIBLE_DEVICES"] == ",".join(plan.gpus)
        assert not set(CPU_ONLY_ENV) & set(env), sorted(set(CPU_ONLY_ENV) & set(env))
        assert srv.core is None and srv.launch_argv()[3] == "-1"  # the shim pins nothing
        assert srv.device == "cuda"


def test_cpu_host_keeps_every_cpu_flag(monkeypatch):
    for key in ("CUDA_VISIBLE_DEVICES", *CPU_ONLY_ENV):
        monkeypatch.delenv(key, raising=False)
    args = parse()
    for i, srv in enumerate(servers(args)):
        cmd, env = srv.command(), srv.environment()
        assert list(serving.CPU_ENGINE_ARGS) == cmd[cmd.index("--port") + 2:cmd.index("--kv-transfer-config")]
        assert set(CPU_ONLY_ARGS) <= set(cmd) and cmd[cmd.index("--dtype") + 1] == "float32"
        assert env["VLLM_CPU_OMP_THREADS_BIND"] == str(i) and srv.core == i and srv.launch_argv()[3] == str(i)
        assert env["UCX_MODULES"] == "^ib" and env["UCX_NET_DEVICES"] == "lo"
        assert "CUDA_VISIBLE_DEVICES" not in env and srv.device == "cpu"


def test_device_cpu_on_a_cuda_host_is_todays_cpu_launch(cuda_host, monkeypatch):
    """--device cpu on a CUDA host plans exactly what a CPU host plans (same ports, cores, commands)."""
    on_cuda_host = [(s.command(), s.environment(), s.core) for s in servers(parse("--device", "cpu"))]
    monkeypatch.setattr(L, "cuda_device_count", lambda: 0)
    on_cpu_host = [(s.command(), s.environment(), s.core) for s in servers(parse())]
    assert on_cuda_host == on_cpu_host


def test_nixl_on_cuda_registers_gpu_memory(cuda_host):
    args = parse("--connector", "NixlConnector")
    plans = L.plan_instances(args, cores=[0], port_fn=counter())
    for p in plans:
        assert p.kv_transfer_config == {"kv_connector": "NixlConnector", "kv_role": p.kv_role,
                                        "kv_buffer_device": "cuda"}
        assert set(p.env) == {"VLLM_NIXL_SIDE_CHANNEL_PORT", "VLLM_NIXL_SIDE_CHANNEL_HOST", "CUDA_VISIBLE_DEVICES"}
    # the user's extra still wins (host-buffer mode on a GPU)
    extra = parse("--connector", "NixlConnector", "--kv-transfer-config-extra", '{"kv_buffer_device": "cpu"}')
    assert {p.kv_transfer_config["kv_buffer_device"] for p in L.plan_instances(extra, port_fn=counter())} == {"cpu"}
    vllm_config = pytest.importorskip("vllm.config")
    for p in plans:
        vllm_config.KVTransferConfig(**p.kv_transfer_config)


def test_tiered_config_is_the_same_on_cuda(cuda_host, monkeypatch):
    """The same but for the CPU host's smaller DRAM tier (the connector's own default on CUDA)."""
    on_cuda = [p.kv_transfer_config for p in L.plan_instances(parse("--mode", "push"), port_fn=counter())]
    assert not any("dram_bytes" in c["kv_connector_extra_config"] for c in on_cuda)
    monkeypatch.setattr(L, "cuda_device_count", lambda: 0)
    on_cpu = [p.kv_transfer_config for p in L.plan_instances(parse("--mode", "push"), port_fn=counter())]
    for c in on_cpu:
        assert c["kv_connector_extra_config"].pop("dram_bytes") == L.CPU_KV_CACHE_BYTES
    assert on_cuda == on_cpu


# --------------------------------------------------------------------------------------------
# --gpus, tensor parallelism, detection


@pytest.mark.parametrize("argv, expected", [
    (["--gpus", "0,1,2,3", "--vllm-args", "--tensor-parallel-size 2"], [("0", "1"), ("2", "3")]),
    (["--gpus", "3,2,1,0", "--vllm-args", "-tp 2"], [("3", "2"), ("1", "0")]),
    (["--gpus", "0,1,2,3", "--vllm-args=--tensor_parallel_size=2"], [("0", "1"), ("2", "3")]),
    (["--gpus", "0,1,2,3", "--vllm-args", "-tp 4 --max-num-seqs 4 -tp=2"], [("0", "1"), ("2", "3")]),  # last wins
    (["--gpus", "0,1,2,3,4,5,6,7", "--vllm-args", "-tp 2 -pp 2"], [("0", "1", "2", "3"), ("4", "5", "6", "7")]),
    (["--gpus", "0,1,2,3", "--vllm-args", "--prefill-context-parallel-size 2"], [("0", "1"), ("2", "3")]),
    (["--gpus", "4,5,6", "--prefill", "2"], [("4",), ("5",), ("6",)]),
    (["--gpus", "GPU-aaaa,GPU-bbbb"], [("GPU-aaaa",), ("GPU-bbbb",)]),
    (["--gpus", "0,1,2,3,4"], [("0",), ("1",)]),  # more than needed: the rest stay unused
    (["--gpus", "0,0", "--vllm-args", "--gpu-memory-utilization 0.45"], [("0",), ("0",)]),  # shared
    (["--gpus", "0,1,0,1", "--vllm-args", "-tp 2 --gpu-memory-utilization 0.4"], [("0", "1"), ("0", "1")]),
])
def test_gpus_are_handed_out_in_order_prefill_first(argv, expected, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    plans = L.plan_instances(parse(*argv), port_fn=counter(), port_block_fn=block_counter())  # no detection: cpu host
    assert [p.gpus for p in plans] == expected
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in plans] == [",".join(g) for g in expected]
    assert [p.name for p in plans][:1] == ["prefill-0"] and all(p.core is None for p in plans)


def test_default_gpus_follow_the_inherited_cuda_visible_devices(cuda_host, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    plans = L.plan_instances(parse("--vllm-args", "-tp 2"), port_fn=counter(), port_block_fn=block_counter())
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in plans] == ["4,5", "6,7"]
    # CUDA stops at its first invalid entry: only as many as torch counts are used
    assert L.visible_gpus(2, {"CUDA_VISIBLE_DEVICES": "3, 1,junk,2"}) == ["3", "1"]
    assert L.visible_gpus(3, {}) == ["0", "1", "2"]


def test_tensor_parallel_tiered_store_ports_are_blocks(cuda_host):
    """Rank r of a TieredConnector instance listens on store_port + r: with -tp 2 each store_port
    comes from port_block_fn(2), not from the single-port port_fn."""
    asked: list[int] = []

    def block(n: int) -> int:
        asked.append(n)
        return 31000 + 10 * len(asked)

    plans = L.plan_instances(parse("--vllm-args", "-tp 2"), port_fn=counter(), port_block_fn=block)
    assert asked == [2, 2]
    assert [p.kv_transfer_config["kv_connector_extra_config"]["store_port"] for p in plans] == [31010, 31020]


def test_free_port_block_is_consecutive_free_and_fresh(monkeypatch):
    """Blocks are bindable, and no port of a block is handed out again, by free_port_block or free_port:
    the draws are scripted so that each call is offered a port already given first."""
    import socket

    if serving._ephemeral_low() - serving._FIXED_LOW < 1100:
        pytest.skip("no room below the ephemeral range: ports come from the kernel here")
    base = next(b for b in range(40000, 48000, 20)
                if all(serving._bindable("127.0.0.1", q) and q not in serving._ports_given for q in range(b, b + 16)))
    draws = iter([base, base, base + 10, base + 1, base + 13, base + 2, base + 14])
    monkeypatch.setattr(serving, "_port_rng", types.SimpleNamespace(randrange=lambda lo, hi: next(draws)))
    assert serving.free_port_block(3) == base
    for port in range(base, base + 3):
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
    assert serving.free_port_block(3) == base + 10  # base was offered again: taken
    assert serving.free_port() == base + 13  # base + 1 is in the first block
    assert serving.free_port_block(1) == base + 14  # n == 1 is free_port


def test_detection_imports_torch_only_where_an_nvidia_driver_is(monkeypatch):
    fake_torch = types.SimpleNamespace(cuda=types.SimpleNamespace(is_available=lambda: True, device_count=lambda: 3))
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    monkeypatch.setattr(L.Path, "exists", lambda self: False)
    assert REAL_CUDA_DEVICE_COUNT() == 0  # no driver: torch is not asked
    monkeypatch.setattr(L.Path, "exists", lambda self: str(self) == "/dev/nvidiactl")
    assert REAL_CUDA_DEVICE_COUNT() == 3
    fake_torch.cuda.is_available = lambda: False  # a CPU torch on a GPU host (vllm-cpu)
    assert REAL_CUDA_DEVICE_COUNT() == 0


def test_auto_is_cpu_without_cuda_and_cuda_with_it(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert L.resolve_device(parse(), count_fn=lambda: 0).device == "cpu"
    assert L.resolve_device(parse("--device", "cpu"), count_fn=lambda: 8).device == "cpu"
    p = L.resolve_device(parse(), count_fn=lambda: 2)
    assert (p.device, p.gpus, p.per_instance) == ("cuda", ("0", "1"), 1)
    p = L.resolve_device(parse("--gpus", "5"), count_fn=lambda: pytest.fail("--gpus needs no detection"))
    assert (p.device, p.gpus) == ("cuda", ("5",))


# --------------------------------------------------------------------------------------------
# errors name the flag and the value, before anything starts


@pytest.mark.parametrize("argv, needle", [
    (["--gpus", "0", "--vllm-args", "--tensor-parallel-size 2"],
     "--gpus 0: 2 instances (1 prefill + 1 decode) x 2 GPUs each (tensor parallel 2) need 4 GPUs, 1 given"),
    (["--gpus", "0,1,2", "--prefill", "2", "--decode", "2"],
     "--gpus 0,1,2: 4 instances (2 prefill + 2 decode) x 1 GPU each (no tensor parallelism) need 4 GPUs, 3 given"),
    (["--prefill", "3", "--decode", "2"], "need 5 GPUs, 4 visible"),
    (["--gpus", "0,1", "--device", "cpu"], "--gpus 0,1 needs --device cuda (or auto), not --device cpu"),
    (["--gpus", "0,0,1,1", "--vllm-args", "-tp 2 --gpu-memory-utilization 0.4"],
     "prefill-0 would get GPUs 0,0: one engine's 2 ranks need 2 different GPUs"),
    (["--gpus", "0,0"], "GPU 0 is shared by prefill-0, decode-0; give each a share of its memory with "
                        "--vllm-args '--gpu-memory-utilization F', F at most 0.50 (vLLM's default 0.9 each"),
    (["--gpus", "0,0", "--vllm-args", "--gpu-memory-utilization 0.6"], "--gpu-memory-utilization 0.6 x 2 > 1"),
    (["--vllm-args", "-dp 2"], "--vllm-args --data-parallel-size 2: serve-pd places one engine per instance"),
    (["--vllm-args", "--device-ids 2,3"], "--vllm-args --device-ids 2,3: serve-pd picks each instance's GPUs"),
    (["--vllm-args", "-tp two"], "--vllm-args: -tp 'two': expected an integer >= 1"),
    (["--vllm-args", "-tp 0"], "--vllm-args: -tp '0': expected an integer >= 1"),
    (["--vllm-args=--tensor-parallel-size"], "--vllm-args: --tensor-parallel-size has no value"),
    (["--vllm-args", "--gpu-memory-utilization 1.5"], "--gpu-memory-utilization '1.5': expected a fraction in (0, 1]"),
])
def test_gpu_errors_name_flag_and_value(argv, needle, cuda_host, capsys):
    assert L.run(parse(*argv)) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvconnectors serve-pd: error: ") and needle in err, err


def test_device_cuda_without_a_gpu_says_so(monkeypatch, capsys):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert L.run(parse("--device", "cuda")) == 2  # conftest: torch sees no CUDA device
    assert ("--device cuda: no CUDA device visible to torch here, CUDA_VISIBLE_DEVICES='';"
            " pass --gpus, or use --device cpu") in capsys.readouterr().err


@pytest.mark.parametrize("value", ["0,,1", "-1", "a,b", ""])
def test_bad_gpus_value_is_an_argparse_error(value, capsys):
    with pytest.raises(SystemExit):
        parse("--gpus", value)
    assert f"argument --gpus: expected comma-separated GPU indices or UUIDs (e.g. 0,1,2,3 or GPU-…), got {value!r}" \
        in capsys.readouterr().err


# --------------------------------------------------------------------------------------------
# --dry-run, --help, PDCluster


def test_dry_run_shows_the_gpu_assignment(cuda_host, capsys):
    argv = ["--gpus", "0,1,2,3,4,5", "--vllm-args", "-tp 2", "--connector", "NixlConnector", "--dry-run",
            "--log-dir", "/tmp/x"]
    assert L.run(parse(*argv)) == 0
    out = capsys.readouterr().out
    assert "# device cuda: 2 GPU(s) per instance (tensor parallel 2), from --gpus 0,1,2,3,4,5; unused: 4,5" in out
    assert "# GPUs: prefill-0 -> 0,1, decode-0 -> 2,3" in out
    assert "# prefill-0 (kv_producer, GPUs 0,1, " in out and "# decode-0 (kv_consumer, GPUs 2,3, " in out
    assert out.count("CUDA_VISIBLE_DEVICES=0,1 ") == 1 and out.count("CUDA_VISIBLE_DEVICES=2,3 ") == 1
    assert out.count('"kv_buffer_device":"cuda"') == 2
    for flag in (*CPU_ONLY_ARGS, "VLLM_CPU_OMP_THREADS_BIND", "core "):
        assert flag not in out, flag


def test_dry_run_header_tells_each_pools_tensor_parallelism(cuda_host, capsys):
    """It said "1 GPU(s) per instance (no tensor parallelism)" beside --prefill-tp 2 (issue 41)."""
    assert L.run(parse("--gpus", "0,1,2", "--prefill-tp", "2", "--connector", "NixlConnector", "--dry-run")) == 0
    out = capsys.readouterr().out
    assert ("# device cuda: prefill 2 GPU(s) per instance (tensor parallel 2); decode 1 GPU(s) per instance "
            "(no tensor parallelism), from --gpus 0,1,2") in out, out.splitlines()[0]


def test_dry_run_on_cpu_shows_no_gpus(capsys):
    assert L.run(parse("--dry-run", "--log-dir", "/tmp/x")) == 0
    out = capsys.readouterr().out
    assert "GPU" not in out and "CUDA_VISIBLE_DEVICES" not in out
    assert "# prefill-0 (kv_producer, core " in out and out.count("--dtype float32") == 2


def test_help_explains_device_and_gpus():
    parser = argparse.ArgumentParser()
    L.add_arguments(parser)
    helps = {a.dest: a.help for a in parser._actions}
    for needle in ("cpu:", "cuda:", "auto:", "--dtype float32", "VLLM_CPU_OMP_THREADS_BIND",
                   "CUDA_VISIBLE_DEVICES", "kv_buffer_device cuda", "torch sees a CUDA device"):
        assert needle in helps["device"], needle
    for needle in ("prefill instances first", "--tensor-parallel-size/-tp", "--pipeline-parallel-size/-pp", "-pcp",
                   "--gpus 0,1,2,3", "UUIDs", "share a GPU", "--gpu-memory-utilization", "CUDA_VISIBLE_DEVICES"):
        assert needle in helps["gpus"], needle
    assert "CPU only" in helps["no_pin"]


def test_pd_cluster_passes_device_and_gpus(tmp_path, cuda_host):
    from kvconnectors.integration.cluster import PDCluster

    pd = PDCluster("/models/tiny", gpus="2,3", connector="NixlConnector", log_dir=tmp_path)
    assert [(s.device, s.core, s.environment()["CUDA_VISIBLE_DEVICES"]) for s in pd.servers] == [
        ("cuda", None, "2"), ("cuda", None, "3")]
    assert [s.device for s in PDCluster("/models/tiny", device="cpu", log_dir=tmp_path).servers] == ["cpu", "cpu"]


def test_vllm_server_refuses_a_core_on_cuda():
    with pytest.raises(ValueError, match="core 0: CPU pinning is for device 'cpu' only"):
        serving.VllmServer("/models/tiny", port=1, core=0, device="cuda")
    with pytest.raises(ValueError, match="device 'rocm'"):
        serving.VllmServer("/models/tiny", port=1, device="rocm")



def test_per_pool_tensor_parallel_on_cuda(cuda_host):
    """--prefill-tp / --decode-tp size each pool on its own: GPUs handed out per instance, a store
    port block per rank count, and each server's own --tensor-parallel-size after --vllm-args."""
    asked: list[int] = []

    def block(n: int) -> int:
        asked.append(n)
        return 31000 + 10 * len(asked)

    args = parse("--gpus", "0,1,2,3,4,5", "--prefill-tp", "4", "--decode-tp", "2")
    plans = L.plan_instances(args, port_fn=counter(), port_block_fn=block)
    assert [(p.name, p.tp, p.gpus) for p in plans] == [("prefill-0", 4, ("0", "1", "2", "3")),
                                                       ("decode-0", 2, ("4", "5"))]
    assert asked == [4, 2]
    for p in plans:
        argv = L.server_args(p, args)
        assert argv[-2:] == ["--tensor-parallel-size", str(p.tp)], argv
    assert plans[0].where() == "GPUs 0,1,2,3"
    with pytest.raises(ValueError, match=r"prefill-0 4, decode-0 2 GPUs: tensor parallel per pool\) need 6 GPUs, 4"):
        L.plan_instances(parse("--gpus", "0,1,2,3", "--prefill-tp", "4", "--decode-tp", "2"),
                         port_fn=counter(), port_block_fn=block)


def test_per_pool_tensor_parallel_on_cpu_binds_one_core_per_rank():
    """On CPU a TP-2 instance binds its ranks to two cores (VLLM_CPU_OMP_THREADS_BIND "0|1") and is not
    pinned as a tree; a TP-1 instance keeps its one pinned core; no flag when the pools agree."""
    args = parse("--device", "cpu", "--prefill-tp", "2", "--decode-tp", "1")
    plans = L.plan_instances(args, cores=[0, 1], port_fn=counter(), port_block_fn=block_counter())
    pre, dec = plans
    assert (pre.tp, pre.core, pre.env["VLLM_CPU_OMP_THREADS_BIND"]) == (2, None, "0|1")
    assert (dec.tp, dec.core) == (1, 0) and "VLLM_CPU_OMP_THREADS_BIND" not in dec.env
    assert L.server_args(pre, args)[-2:] == ["--tensor-parallel-size", "2"]
    assert "--tensor-parallel-size" not in L.server_args(dec, args)
    assert pre.where() == "cores 0,1 (TP 2)" and dec.where() == "core 0"
    server = L.build_server(pre, args, Path("/tmp"))
    assert server.environment()["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"
    same = L.plan_instances(parse("--device", "cpu"), cores=[0, 1], port_fn=counter(), port_block_fn=block_counter())
    assert [(p.tp, p.core, p.extra_args) for p in same] == [(1, 0, ()), (1, 1, ())]
