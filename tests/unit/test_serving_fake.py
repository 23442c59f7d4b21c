"""VllmServer without an engine: a fake `vllm.entrypoints.openai.api_server` module (put first on
PYTHONPATH) stands in for the real server, so start-up, health, pinning, logs and teardown are
checked in seconds. One test runs the real vLLM entry point with a bogus model path (about 10 s:
import, then a config error) to check that a failed start is reported fast, with the log tail."""

from __future__ import annotations

import io
import os
import socket
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from kvconnectors import serving
from kvconnectors.serving import ServerStartError, VllmServer, free_port

FAKE_API_SERVER = textwrap.dedent('''
    import argparse, http.server, json, os, signal, subprocess, sys, threading, time
    p = argparse.ArgumentParser()
    p.add_argument("--model"); p.add_argument("--port", type=int); p.add_argument("--host")
    p.add_argument("--kv-transfer-config", type=json.loads, default=None)
    args, _ = p.parse_known_args()
    mode = os.environ.get("FAKE_VLLM_MODE", "ok")
    print("fake vllm starting", args.model, flush=True)
    print("kv-transfer-config:", json.dumps(args.kv_transfer_config), flush=True)
    if not os.path.isdir(args.model):
        print("Traceback (most recent call last):", flush=True)
        print(f"OSError: model path {args.model} does not exist", flush=True)
        sys.exit(3)
    if mode == "ignore_term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # a child process with extra threads, like EngineCore/Worker
    child = subprocess.Popen([sys.executable, "-c",
        "import os,socket,threading,time,uuid\\n"
        # vLLM's EngineCore binds ZMQ IPC sockets as <VLLM_RPC_BASE_PATH>/<uuid> and, killed, leaves them
        "s=socket.socket(socket.AF_UNIX); s.bind(os.path.join(os.environ['VLLM_RPC_BASE_PATH'], str(uuid.uuid4())))\\n"
        "[threading.Thread(target=time.sleep, args=(600,), daemon=True).start() for _ in range(3)]\\n"
        "time.sleep(600)"])
    for _ in range(2):
        threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
    if mode == "hang":
        time.sleep(600)

    class H(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a): pass
        def do_GET(self):
            body = b"ok" if self.path == "/health" else b"# HELP x_total x\\n# TYPE x_total counter\\nx_total 3.0\\n"
            self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
            self.wfile.write(body)
        def do_POST(self):
            n = int(self.headers["Content-Length"]); req = json.loads(self.rfile.read(n))
            ids = list(range(req["max_tokens"]))
            out = {"choices": [{"index": 0, "text": "x", "token_ids": ids}], "echo_model": req["model"],
                   "echo": req}
            if (req.get("kv_transfer_params") or {}).get("do_remote_decode"):  # a P/D prefill leg
                out["kv_transfer_params"] = {"do_remote_prefill": True, "remote_port": args.port,
                                             "kv_role": (args.kv_transfer_config or {}).get("kv_role")}
            body = json.dumps(out).encode()
            self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
            self.wfile.write(body)
    time.sleep(0.5)
    print("fake vllm ready", flush=True)
    http.server.ThreadingHTTPServer((args.host, args.port), H).serve_forever()
''')


def write_fake_vllm(root: Path) -> Path:
    """A `vllm.entrypoints.openai.api_server` module under `root` (put it first on PYTHONPATH)."""
    pkg = root / "vllm" / "entrypoints" / "openai"
    pkg.mkdir(parents=True)
    for d in (root / "vllm", root / "vllm" / "entrypoints", pkg):
        (d / "__init__.py").write_text("")
    (pkg / "api_server.py").write_text(FAKE_API_SERVER)
    return root


@pytest.fixture(scope="module")
def fake_vllm(tmp_path_factory) -> Path:
    return write_fake_vllm(tmp_path_factory.mktemp("fakevllm"))


@pytest.fixture
def model_dir(tmp_path) -> Path:
    d = tmp_path / "tiny"
    d.mkdir()
    return d


def _fake(fake_vllm: Path, model: Path | str, mode: str = "ok", **kw) -> VllmServer:
    return VllmServer(model, pythonpath=[fake_vllm], env={"FAKE_VLLM_MODE": mode}, **kw)


def _assert_gone(pids: list[int]) -> None:
    alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"processes left behind: {alive}"


def test_free_port_is_bindable_and_fresh():
    ports = [free_port() for _ in range(20)]
    assert len(set(ports)) == 20
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))


def test_command_and_environment(model_dir, monkeypatch):
    srv = VllmServer(model_dir, name="p0", served_model_name="tiny", port=1234, core=1,
                     extra_args=["--kv-transfer-config", "{}", "--max-model-len", "4096"],
                     env={"UCX_NET_DEVICES": "eth0"})
    cmd = srv.command()
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert cmd[cmd.index("--port") + 1] == "1234" and cmd[cmd.index("--host") + 1] == "127.0.0.1"
    assert cmd[cmd.index("--served-model-name") + 1] == "tiny"
    for flag in ("--enforce-eager", "--no-enable-prefix-caching"):
        assert flag in cmd
    # extras come last, so vLLM's last-wins argparse lets them override defaults
    assert cmd.index("--max-model-len", cmd.index("--kv-transfer-config")) > cmd.index("--block-size")
    env = srv.environment()
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert env["UCX_MODULES"] == "^ib" and env["UCX_NET_DEVICES"] == "eth0"
    assert srv.url == "http://127.0.0.1:1234"
    monkeypatch.setenv("VLLM_DIST_IDENT", "abc")  # what an in-process CPU engine leaves in this process
    unpinned = VllmServer(model_dir, port=1).environment()
    assert "VLLM_DIST_IDENT" not in unpinned  # vLLM: "Unknown vLLM environment variable"; workers set their own
    assert unpinned.get("VLLM_CPU_OMP_THREADS_BIND") == os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in unpinned  # servers run multi-process
    assert unpinned["HF_HUB_OFFLINE"] == os.environ.get("HF_HUB_OFFLINE", "1")


@pytest.mark.timeout(60)
def test_start_pin_request_and_teardown(fake_vllm, model_dir):
    core = max(os.sched_getaffinity(0))
    sink = io.StringIO()
    with _fake(fake_vllm, model_dir, name="prefill-0", core=core, stream_logs=sink) as srv:
        assert srv.is_running()
        pids = [p.pid for p in serving.process_tree(srv.pid)]
        assert len(pids) == 2  # server + its child
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            aff = serving.tree_affinities(srv.pid)
            if len(aff) >= 7 and all(v == {core} for v in aff.values()):
                break
            time.sleep(0.2)
        assert all(v == {core} for v in aff.values()), aff
        assert len(aff) >= 7, aff  # 3 threads + main in the server, 3 + main in the child
        assert srv.greedy_token_ids("hi", max_tokens=4) == [0, 1, 2, 3]
        echo = srv.complete("hi", max_tokens=2)["echo"]
        assert echo["temperature"] == 0 and echo["ignore_eos"] and echo["return_token_ids"]
        assert srv.metrics()["x_total"] == [({}, 3.0)]
    assert not srv.is_running()
    _assert_gone(pids)
    assert not os.path.exists(srv.environment()["VLLM_RPC_BASE_PATH"]), "vLLM's IPC socket folder is left behind"
    assert "fake vllm ready" in srv.log_tail(5)
    assert "[prefill-0] fake vllm ready" in sink.getvalue()
    assert srv.stop() == srv.proc.returncode  # idempotent


@pytest.mark.timeout(60)
def test_bogus_model_fails_fast_with_log_tail(fake_vllm, tmp_path):
    t0 = time.monotonic()
    srv = _fake(fake_vllm, tmp_path / "no-such-model", name="bogus", health_timeout=50)
    with pytest.raises(ServerStartError) as err:
        srv.start()
    assert time.monotonic() - t0 < 20
    msg = str(err.value)
    assert "exited with code 3" in msg and "does not exist" in msg and "bogus" in msg
    assert not srv.is_running()


@pytest.mark.timeout(60)
def test_health_timeout_stops_the_server(fake_vllm, model_dir):
    srv = _fake(fake_vllm, model_dir, mode="hang", health_timeout=3)
    with pytest.raises(ServerStartError) as err:
        srv.start()
    assert "not ready after 3 s" in str(err.value) and "fake vllm starting" in str(err.value)
    assert not srv.is_running()
    assert not serving.process_tree(srv.pid)


@pytest.mark.timeout(60)
def test_sigterm_ignored_escalates_to_sigkill(fake_vllm, model_dir):
    srv = _fake(fake_vllm, model_dir, mode="ignore_term").start()
    pids = [p.pid for p in serving.process_tree(srv.pid)]
    t0 = time.monotonic()
    rpc_dir = srv.environment()["VLLM_RPC_BASE_PATH"]
    assert os.listdir(rpc_dir), "the fake EngineCore bound no IPC socket"
    srv.stop(timeout=2)
    assert time.monotonic() - t0 < 10
    _assert_gone(pids)
    assert not os.path.exists(rpc_dir), "a killed server's IPC sockets are left behind"


@pytest.mark.engine  # no engine is built, but it runs vLLM's start-up (10-20 s of a core)
@pytest.mark.timeout(120)
def test_real_vllm_bogus_model_path_fails_fast(tmp_path):
    """The real entry point (import + argument/config check only; no engine is built)."""
    pytest.importorskip("vllm")
    t0 = time.monotonic()
    srv = VllmServer(tmp_path / "missing-model", name="bogus-real", health_timeout=100)
    with pytest.raises(ServerStartError) as err:
        srv.start()
    elapsed = time.monotonic() - t0
    assert elapsed < 60, f"failed start took {elapsed:.0f} s"
    assert "exited with code" in str(err.value) and "missing-model" in str(err.value)


def test_free_ports_avoid_the_ephemeral_range_and_repeat_never() -> None:
    """Outgoing connections take ephemeral ports; a planned listen port from below that range
    cannot be taken by them between planning and binding."""
    from kvconnectors import serving

    ports = [serving.free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    low = serving._ephemeral_low()
    if low - serving._FIXED_LOW >= 1000:
        assert all(serving._FIXED_LOW <= p < low for p in ports), ports


def test_free_ports_do_not_follow_a_seeded_global_random() -> None:
    import random

    from kvconnectors import serving

    ports = set()
    for _ in range(100):
        random.seed(1234)  # as a test or library may do between calls
        ports.add(serving.free_port())
    assert len(ports) == 100
