"""Transfer microbenchmark: the KV of N tokens, moved side by side in one run through

  limits   memcpy       numpy copyto of the whole payload into one contiguous buffer, in as many
                        threads as the shm path copies with (mover/block_shares.THREADS)
           gather       the realistic block scatter (the name is historical: it writes INTO the
                        cache): each (layer, block) slot into a non-contiguous KV-cache block (numpy
                        fancy-index copy), in the same number of threads
           socket       raw TCP loopback between two processes: sendall of one layer's bytes at a
                        time, as tcp's source sends / one recv_into(MSG_WAITALL) of all that is left,
                        into one contiguous buffer (no framing, no checksums): the ceiling for our tcp
  ours     tcp          one request's load through a real consumer TieredConnectorWorker
                        (start_load_kv -> Puller -> PullPaths' data path -> take_results) from a
                        transfer a real producer worker staged (save_kv_layer / wait_for_save: its
                        StagingBook, Stager and store) and its StoreServer serves; transport tcp
           tcp_aead     tcp with wire_protection "aead": every frame and KV byte sealed (AES-256-GCM,
                        transport/sealed.py), shared secret on both sides; its cost is tcp_aead / tcp
           shm          the same workers with transport shm (store arena in /dev/shm, one copy)
           nixl         the same workers with transport nixl (the consumer's NixlSink READs the
                        producer's arena)
  engines  nixl_direct  NIXL UCX agent-to-agent READ of the same layout, descriptor lists prepared
                        once, progress threads off: the initiator polls the transfer tightly, the
                        target progresses its worker with our server's backoff policy while it runs
           mooncake     Mooncake TransferEngine, protocol tcp, P2PHANDSHAKE, batch_transfer_sync_read
  mover    (--paths mover, or all; not in the default set: torch and ~4x the payload in memory; CPU)
           plain_gather  limit: torch.index_select of the moved blocks OUT of the cache into a host
                        tensor, per layer: what staging is put against
           plain_gather_words  limit: the same gather on the rows viewed as int64 words, as the
                        mover's CPU copy does (element-wise index_select is ~3x slower on bf16): the
                        strongest plain gather, so the mover's own cost shows against it
           stage        kvconnectors.mover Stager.stage + complete into a real TieredStore's arena:
                        one batched gather per layer (copy thread), xxh3 of every row, commit
           stage_raw    the same with the Stager's checksums off: the mover's own cost
           plain_scatter  limit: numpy fancy assignment of host rows INTO the moved blocks, per layer:
                        what loading is put against
           load         Loader.load + its event: one batched scatter per layer from host rows
  These run in this process on vLLM-shaped CPU caches of the same geometry (KVCacheLayout --layout,
  default LBHNC, vLLM's CPU layout; kvconnectors.mover.shapes.synthetic_caches; one allocation, twice
  the request's blocks, the same target block ids), through benchmarks/device.py's LayoutRun (what
  `kvconnectors bench device` times). Ratios stage / plain_gather (and / plain_gather_words) and
  load / plain_scatter (target >= 0.9, issue #14) are in the comparisons and under "mover" in the JSON.

Layout (identical for every path): the producer holds the payload as num_layers x num_blocks slots
(slot = one (layer, block) = block_tokens x kv_heads x head_dim x 2 (K, V) x dtype bytes); the consumer
has a KV cache of one numpy array [kv_blocks, slot_bytes] per layer (kv_blocks = 2 x num_blocks) and
the request's blocks land in random, non-contiguous target block ids, as vLLM's block table gives them.

Method. One producer process (spawned) hosts every source: the raw socket sender, one producer
TieredConnectorWorker per path of ours over the payload's blocks (benchmarks/workers.py: vLLM's
CPU cache layout, no engine; each stages with its own StagingBook into its own store, with per-slot
xxh3 checksums, and serves it with its StoreServer), the NIXL target agent and the Mooncake engine.
This process is the consumer, with one consumer worker per path of ours over the same KV cache. Iterations are round-robin over the paths (the start rotates each round), so
machine noise hits all paths alike. Our entries are re-staged before each pull, off the clock (a pull
releases its entry). The first round is a warm-up (connections, NIXL wire-up, page faults) that is
not timed; in it every path's destination is cleared first and the landed bytes are verified (the
target blocks equal the payload, the other KV blocks stay zero; mover paths: the staged entry read
back from the store equals the source blocks and matches stage's checksums, the loaded / scattered
blocks equal the rows and the other blocks are unchanged, the gathered host tensor equals the source).
--corrupt (the negative control) flips one byte of the warm-up's staged entry in the arena before it
is checked: stage / stage_raw must then fail verification (exit 1).

Timed: for ours, one request's load as vLLM drives it, start_load_kv to take_results reporting it done
(the pull thread's hand-off, the target block views, the kept connection, Read, data, checksum
verification unless --no-checksum, Release); for raw NIXL make_prepped_xfer +
transfer + polling to DONE + handle release; for Mooncake the batch_transfer_sync_read call.

Usage:  python -m kvconnectors.benchmarks.transfer --preset 8b --tokens 2048 --block-tokens 16 --iters 5
        kvconnectors bench transfer --preset tiny --tokens 256 --paths memcpy,socket,tcp,shm
        kvconnectors bench transfer --preset 8b --tokens 1024 --paths mover
"""

from __future__ import annotations

import argparse
import contextlib
import mmap
import multiprocessing as mp
import os
import socket
import sys
import tempfile
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterator

from kvconnectors.benchmarks.common import (DEFAULT_OUT, add_results_argument, bar_chart, fmt, host_info,
                                            module_main, progress, publish, ratio, setup_env, summarize, table)

setup_env()  # before anything can load NIXL / UCX / Mooncake; spawned children inherit it

import numpy as np  # noqa: E402

from kvconnectors import planner  # noqa: E402
from kvconnectors.benchmarks.models import PRESETS, KVBlocks, Preset  # noqa: E402
from kvconnectors.store.buffers import aligned_zeros  # noqa: E402
from kvconnectors.mover import block_shares  # noqa: E402
from kvconnectors.mover.block_views import BlockViews  # noqa: E402
from kvconnectors.benchmarks.nixl_bench import transfer_and_poll  # noqa: E402  (no NIXL import: that is lazy)

BENCH_SECRET = b"kvconnectors-bench-transfer-loopback"  # tcp_aead only; both processes on 127.0.0.1
SEALED = {"tcp_aead"}  # paths run with wire_protection "aead" (and the secret)
TIMEOUT_S = 120.0
MOONCAKE_INSTALL = "pip install mooncake-transfer-engine-non-cuda (and apt-get install libibverbs1)"


# ============================================================================== geometry
@dataclass(frozen=True)
class Geometry(KVBlocks):
    preset: str
    tokens: int
    block_tokens: int

    @property
    def p(self) -> Preset:
        return PRESETS[self.preset]

    @property
    def num_layers(self) -> int:
        return self.p.num_layers

    @property
    def model(self) -> planner.ModelSpec:
        return self.p.model

    @property
    def kv_blocks(self) -> int:
        return 2 * self.num_blocks

    def describe(self) -> dict[str, Any]:
        return {"preset": self.preset, "preset_about": self.p.about, "tokens": self.tokens,
                "block_tokens": self.block_tokens, "num_layers": self.num_layers, "num_blocks": self.num_blocks,
                "slot_bytes": self.slot_bytes, "num_slots": self.num_slots, "bytes_per_token": self.p.token_bytes,
                "total_bytes": self.total_bytes, "kv_cache_blocks_per_layer": self.kv_blocks}


# ============================================================================== paths
@dataclass(frozen=True)
class PathInfo:
    kind: str  # limit / ours / engine
    about: str
    needs_producer: bool
    needs: str = ""  # "nixl" / "mooncake"


PATHS: dict[str, PathInfo] = {
    "memcpy": PathInfo("limit", "numpy copyto, contiguous -> contiguous, as many threads as shm", False),
    "gather": PathInfo("limit", "slots -> non-contiguous KV blocks (fancy-index copy), as many threads as shm",
                       False),
    "socket": PathInfo("limit", "raw TCP loopback, 2 processes, sendall per layer / recv_into(MSG_WAITALL)",
                       True),
    "tcp": PathInfo("ours", "producer worker -> consumer worker's Puller, transport tcp", True),
    "tcp_aead": PathInfo("ours", "tcp with wire_protection aead (every frame and KV byte AES-256-GCM sealed)", True),
    "shm": PathInfo("ours", "producer worker -> consumer worker's Puller, transport shm", True),
    "nixl": PathInfo("ours", "producer worker -> consumer worker's Puller, transport nixl (NixlSink)", True,
                     "nixl"),
    "nixl_direct": PathInfo("engine", "NIXL UCX READ agent-to-agent, prepped dlists", True, "nixl"),
    "mooncake": PathInfo("engine", "Mooncake TransferEngine tcp, P2PHANDSHAKE, sync batch read", True,
                         "mooncake"),
    "plain_gather": PathInfo("limit", "torch.index_select of the blocks out of the cache into a host tensor",
                             False, "torch"),
    "plain_gather_words": PathInfo("limit", "the same index_select on the rows viewed as int64 words (CpuOps' "
                                   "gather): the mover's copy without the mover", False, "torch"),
    "stage": PathInfo("mover", "Stager.stage+complete -> TieredStore arena, xxh3 of every row", False, "torch"),
    "stage_raw": PathInfo("mover", "stage with the Stager's checksums off: the mover's own cost", False, "torch"),
    "plain_scatter": PathInfo("limit", "numpy fancy assignment of host rows into the blocks", False, "torch"),
    "load": PathInfo("mover", "Loader.load + event: one scatter per layer from host rows", False, "torch"),
}
# mover rows: the benchmarks/device.py LayoutRun method each one times
MOVER = {"plain_gather": "gather", "plain_gather_words": "gather_words", "stage": "stage", "stage_raw": "stage_raw", "plain_scatter": "scatter",
         "load": "load"}
STAGE_PATHS = ("stage", "stage_raw")
GROUPS = {"default": [p for p in PATHS if p not in MOVER], "mover": list(MOVER), "all": list(PATHS)}
# Targets of the redesign issue (#15 item 9: tcp >= 0.97x a raw socket, shm >= 0.9x the scattered gather,
# nixl >= 0.95x NIXL driven directly), of the security issue (aead costs at most half) and of #14 (mover).
COMPARISONS = (("tcp", "socket", 0.97), ("tcp_aead", "tcp", 0.5), ("shm", "gather", 0.9), ("nixl", "nixl_direct", 0.95),
               ("stage", "plain_gather", 0.9), ("stage_raw", "plain_gather", 0.9),
               ("stage", "plain_gather_words", 0.9), ("stage_raw", "plain_gather_words", 0.9),
               ("load", "plain_scatter", 0.9))
KIND_COLOR = {"limit": "#9e9e9e", "ours": "#1f77b4", "engine": "#ff7f0e", "mover": "#2ca02c"}


def parse_paths(text: str | list[str]) -> list[str]:
    """Path names and groups (default, mover, all), comma-separated or a list, in order, each once."""
    names = text if isinstance(text, list) else [p.strip() for p in text.split(",") if p.strip()]
    bad = [n for n in names if n not in PATHS and n not in GROUPS]
    if bad or not names:
        raise ValueError(f"unknown path(s) {bad or text!r}; choose from {', '.join(PATHS)} or a group: "
                         f"{', '.join(GROUPS)}")
    return list(dict.fromkeys(p for n in names for p in GROUPS.get(n, [n])))


def why_unavailable(need: str) -> str | None:
    if need == "nixl":
        from kvconnectors.transport.nixl import INSTALL_HINT, nixl_import_error

        why = nixl_import_error()
        return None if why is None else f"NIXL does not import here ({why}); {INSTALL_HINT}"
    if need == "torch":
        try:
            import torch  # noqa: F401
        except Exception as exc:
            return f"torch does not import here ({type(exc).__name__}: {exc}); the mover paths need it"
    if need == "mooncake":
        try:
            from mooncake.engine import TransferEngine  # noqa: F401
        except Exception as exc:  # ImportError, or a missing shared library (OSError)
            return f"Mooncake does not import here ({type(exc).__name__}: {exc}); {MOONCAKE_INSTALL}"
    return None


# ============================================================================== memory
def aligned(nbytes: int) -> tuple[mmap.mmap, np.ndarray]:
    """Page-aligned, zero-filled and faulted in (so first-touch page faults stay out of the timing).
    Shared anonymous memory, as this benchmark has always used (its numbers stay comparable)."""
    return aligned_zeros(nbytes, shared=True)


def make_payload(geom: Geometry, seed: int) -> tuple[mmap.mmap, np.ndarray]:
    """Random (incompressible) bytes, [num_layers, num_blocks, slot_bytes], identical in every process."""
    m, a = aligned(geom.total_bytes)
    rng = np.random.default_rng(seed)
    chunk = 16 << 20
    for off in range(0, a.size - a.size % 8, chunk):
        n = min(chunk, (a.size - off) // 8 * 8)
        a[off:off + n] = rng.integers(0, 2**64 - 1, n // 8, dtype=np.uint64, endpoint=True).view(np.uint8)
    if a.size % 8:
        a[a.size - a.size % 8:] = rng.integers(0, 256, a.size % 8, dtype=np.uint8)
    return m, a.reshape(geom.num_layers, geom.num_blocks, geom.slot_bytes)


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


# ============================================================================== our paths: real workers
def _worker_config(path: str, geom: Geometry, checksum: bool, secret_file: str) -> dict[str, Any]:
    """TieredConfig of both ends of one of our paths (tcp, tcp_aead, shm, nixl): its transport and
    wire protection; a store for one transfer; deadlines a loaded benchmark host never hits."""
    cfg: dict[str, Any] = {"transport": "tcp" if path in ("tcp", "tcp_aead") else path, "checksum": checksum,
                           "dram_bytes": geom.total_bytes, "lease_ttl_s": 600, "load_timeout_s": TIMEOUT_S,
                           "connect_timeout_s": 10, "retries": 0, "instance_name": f"bench_{path}_",
                           "max_concurrent_loads": 1}
    if path in SEALED:
        cfg.update(wire_protection="aead", secret_file=secret_file)
    return cfg


@contextlib.contextmanager
def _secret_file() -> Iterator[str]:
    """The loopback benchmark's shared secret in an owner-only file while workers start (a worker
    reads its secret_file once, when it is made)."""
    fd, name = tempfile.mkstemp(prefix="kvc-bench-secret-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(BENCH_SECRET)
        yield name
    finally:
        os.unlink(name)


# ============================================================================== producer process
def _socket_sender(lsock: socket.socket, data: memoryview, chunk: int) -> None:
    """Raw socket baseline: one connection; each request byte is answered with the whole payload,
    sent `chunk` bytes (one layer's) at a time as tcp's source sends (no framing, no checksums, no
    copies). One sendmsg over the whole rest ran at 0.6x of that on this VM: the stronger limit."""
    try:
        c, _ = lsock.accept()
    except OSError:
        return
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    with c:
        while True:
            try:
                if not c.recv(1):
                    return
                for start in range(0, len(data), chunk):
                    c.sendall(data[start:start + chunk])
            except OSError:
                return


def _producer_main(conn: Any, geom_d: dict, paths: list[str], checksum: bool, seed: int) -> None:
    setup_env()
    geom = Geometry(**geom_d)
    info: dict[str, Any] = {"errors": {}, "pid": os.getpid()}
    closers: list[Callable[[], None]] = []
    try:
        _mm, payload = make_payload(geom, seed)
        flat = payload.reshape(-1)
        base = int(flat.__array_interface__["data"][0])
        ours = [p for p in paths if PATHS[p].kind == "ours"]
        producers: dict[str, Any] = {}  # path -> a producer TieredConnectorWorker over the payload's blocks
        if ours:
            from kvconnectors.benchmarks import workers

            caches = workers.cpu_caches(list(payload), geom.model, geom.block_tokens)
            with _secret_file() as secret:
                for p in ours:
                    try:
                        producers[p] = workers.make_worker("p", caches, geom.model, geom.block_tokens,
                                                           f"bench-p-{p}", **_worker_config(p, geom, checksum, secret))
                    except Exception as exc:
                        info["errors"][p] = f"producer could not start its worker: {_describe(exc)}"
                        continue
                    closers.append(producers[p].shutdown)
        if "socket" in paths:
            lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            lsock.bind(("127.0.0.1", 0))
            lsock.listen(1)
            info["port_socket"] = lsock.getsockname()[1]
            threading.Thread(target=_socket_sender, args=(lsock, memoryview(flat), len(flat) // geom.num_layers),
                             daemon=True).start()
            closers.append(lsock.close)
        nixl_agent = None
        if "nixl_direct" in paths:
            try:
                from kvconnectors.transport import nixl_agent as nx  # _api: raw NIXL for the baseline

                api = nx._api()
                nixl_agent = api.nixl_agent(nx.unique_agent_name("bench-target"),
                                            api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
                nixl_agent.register_memory(nx.reg_descs([(base, flat.nbytes)]), "DRAM")
                info["nixl_direct"] = (nixl_agent.get_agent_metadata(), base)
            except Exception as exc:
                info["errors"]["nixl_direct"] = f"producer NIXL agent failed: {_describe(exc)}"
                nixl_agent = None
        if "mooncake" in paths:
            try:
                from mooncake.engine import TransferEngine

                te = TransferEngine()
                rc = te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
                if rc != 0:
                    raise RuntimeError(f"TransferEngine.initialize('127.0.0.1', 'P2PHANDSHAKE', 'tcp', '') = {rc}")
                rc = te.register_memory(base, flat.nbytes)
                if rc != 0:
                    raise RuntimeError(f"TransferEngine.register_memory = {rc}")
                info["mooncake"] = (f"127.0.0.1:{te.get_rpc_port()}", base)
                closers.append(lambda: te.unregister_memory(base))
            except Exception as exc:
                info["errors"]["mooncake"] = f"producer Mooncake engine failed to start: {_describe(exc)}"
        conn.send(("ready", info))

        while True:
            cmd = conn.recv()
            if cmd[0] == "stop":
                break
            if cmd[0] == "stage":  # the producer worker's step: every layer staged, then sealed
                _, p, key = cmd
                t0 = time.perf_counter()
                try:
                    ticket = workers.stage(producers[p], key, list(range(geom.num_blocks)), geom.block_tokens)
                except Exception as exc:
                    conn.send(("error", _describe(exc)))
                    continue
                conn.send(("staged", (time.perf_counter() - t0, ticket)))
            elif cmd[0] == "nixl_serve":  # progress the target agent until the READ's notification
                deadline = time.monotonic() + TIMEOUT_S
                polls, got = 0, False
                backoff = nx.Backoff()  # the same progress policy as our StoreServer's NixlSource
                while not got and time.monotonic() < deadline:
                    polls += 1
                    got = any(nixl_agent.get_new_notifs().values())
                    if not got:
                        time.sleep(backoff.next())
                conn.send(("served", got, polls))
    except BaseException as exc:  # tell the consumer instead of leaving it waiting
        try:
            conn.send(("crashed", f"{_describe(exc)}\n{traceback.format_exc()}"))
        except Exception:
            pass
    finally:
        for close in reversed(closers):
            try:
                close()
            except Exception:
                pass


# ============================================================================== consumer side
class Producer:
    def __init__(self, geom: Geometry, paths: list[str], checksum: bool, seed: int):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_producer_main, args=(child, asdict(geom), paths, checksum, seed),
                                daemon=True, name="kvc-bench-producer")
        self.proc.start()
        self.info = self.call(None, timeout=TIMEOUT_S, expect="ready")

    def call(self, msg: Any, timeout: float = TIMEOUT_S, expect: str | None = None) -> Any:
        if msg is not None:
            self.conn.send(msg)
        deadline = time.monotonic() + timeout
        while not self.conn.poll(0.2):
            if not self.proc.is_alive():
                raise RuntimeError(f"the producer process exited (code {self.proc.exitcode}) without answering")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the producer process did not answer {msg!r} within {timeout:.0f} s")
        reply = self.conn.recv()
        if reply[0] == "crashed":
            raise RuntimeError(f"producer process crashed: {reply[1]}")
        if reply[0] == "error":
            raise RuntimeError(f"producer: {reply[1]}")
        if expect is not None and reply[0] != expect:
            raise RuntimeError(f"producer answered {reply[0]!r}, expected {expect!r}")
        return reply[1] if len(reply) == 2 else reply[1:]

    def stage(self, path: str, key: str) -> tuple[float, dict[str, Any]]:
        """Stage a transfer on the producer worker of `path`: (seconds it took, its ticket)."""
        return self.call(("stage", path, key), expect="staged")

    def close(self) -> None:
        try:
            if self.proc.is_alive():
                self.conn.send(("stop",))
        except OSError:
            pass
        self.proc.join(15)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


class Consumer:
    """The consumer's buffers and one `run_<path>()` per path (each returns the timed seconds)."""

    def __init__(self, geom: Geometry, checksum: bool, seed: int, producer: Producer | None, paths: list[str],
                 layout: str = "LBHNC", corrupt: bool = False):
        self.geom, self.checksum, self.producer = geom, checksum, producer
        self.seed, self.layout, self.corrupt = seed, layout, corrupt
        self.mover: Any = None  # benchmarks.device.LayoutRun, built by the first mover path's setup
        self._mm_payload, self.payload = make_payload(geom, seed)
        self.flat_payload = self.payload.reshape(-1)
        rng = np.random.default_rng(seed + 1)
        self.targets = rng.choice(geom.kv_blocks, geom.num_blocks, replace=False)  # scattered, unordered
        self.targets_list = self.targets.tolist()
        self.others = np.setdiff1d(np.arange(geom.kv_blocks), self.targets)
        self._keep: list[Any] = []
        self.flat_dst = None
        if any(p in paths for p in ("memcpy", "socket")):
            m, self.flat_dst = aligned(geom.total_bytes)
            self._keep.append(m)
        self.kv: list[np.ndarray] = []
        if any(p not in ("memcpy", "socket") and p not in MOVER for p in paths):
            for _ in range(geom.num_layers):  # one allocation per layer, like vLLM's per-layer tensors
                m, a = aligned(geom.kv_blocks * geom.slot_bytes)
                self._keep.append(m)
                self.kv.append(a.reshape(geom.kv_blocks, geom.slot_bytes))
        self.seq = 0
        self.sock: socket.socket | None = None
        self.nx_agent = None
        self.nx_handles: list[Any] = []
        self.te = None
        self.extra: dict[str, dict[str, Any]] = {}
        self.workers: dict[str, Any] = {}  # our path -> its consumer TieredConnectorWorker over self.kv
        self.copy_threads = block_shares.THREADS  # the limits copy with as many threads as shm does
        self._copy_pool = ThreadPoolExecutor(max_workers=self.copy_threads, thread_name_prefix="bench-copy")

    # ------------------------------------------------------------------ set-up per path
    def target_blocks(self) -> BlockViews:
        """The target blocks, layer-major (as the engines' rows read them)."""
        return BlockViews(self.kv, range(self.geom.num_layers), self.targets_list)

    def target_addrs(self) -> np.ndarray:
        """uint64 address of every target block, layer-major (the engines' destination descriptors)."""
        return self.target_blocks().addrs()

    def setup(self, path: str) -> None:
        info = self.producer.info if self.producer else {}
        if path in info.get("errors", {}):
            raise RuntimeError(info["errors"][path])
        if path == "socket":
            self.sock = socket.create_connection(("127.0.0.1", info["port_socket"]), timeout=TIMEOUT_S)
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        elif PATHS[path].kind == "ours":  # (nixl: the worker's agent registers the cache at its first pull)
            from kvconnectors.benchmarks import workers

            caches = workers.cpu_caches(self.kv, self.geom.model, self.geom.block_tokens)
            with _secret_file() as secret:
                self.workers[path] = workers.make_worker("c", caches, self.geom.model, self.geom.block_tokens,
                                                         f"bench-c-{path}",
                                                         **_worker_config(path, self.geom, self.checksum, secret))
        elif path == "nixl_direct":
            self._setup_nixl_direct(*info["nixl_direct"])
        elif path == "mooncake":
            self._setup_mooncake(*info["mooncake"])
        elif path in MOVER and self.mover is None:
            self._setup_mover()

    def _setup_mover(self) -> None:
        """vLLM-shaped CPU caches of this geometry, a TieredStore, a Stager and a Loader (bench device's LayoutRun)."""
        import torch

        from kvconnectors.benchmarks.device import LayoutRun, _layouts

        g = self.geom
        dtypes = {4: torch.float32, 2: torch.bfloat16}
        if g.model.dtype_bytes not in dtypes:
            raise ValueError(f"mover paths: no {g.model.dtype_bytes}-byte KV dtype here (fp32 and bf16 only)")
        (layout,) = _layouts(self.layout)
        self.mover = LayoutRun(layout, "cpu", g.num_layers, g.num_blocks, self.seed, heads=g.model.kv_heads,
                               block_size=g.block_tokens, content=2 * g.model.head_dim,
                               dtype=dtypes[g.model.dtype_bytes], ids=self.targets, cache_blocks=g.kv_blocks)
        if self.mover.g.block_bytes != g.slot_bytes or self.mover.nbytes != g.total_bytes:
            raise AssertionError(f"mover caches: {self.mover.g.block_bytes} bytes per block, {self.mover.nbytes} "
                                 f"per transfer; the geometry says {g.slot_bytes} and {g.total_bytes}")

    def mover_info(self) -> dict[str, Any] | None:
        r = self.mover
        if r is None:
            return None
        return {"layout": r.layout, "device": "cpu", "ops": type(r.ops).__name__, "geometry": r.g.describe(),
                "all_layer_gather": r.stager.all_layer_gather, "arena_pinned": r.stager.arena_pinned,
                "bytes_per_transfer": r.nbytes, "cache_blocks_per_layer": r.cache_blocks,
                "source": "synthetic_caches (seeded random bytes), not the payload"}

    def _setup_nixl_direct(self, meta: bytes, remote_base: int) -> None:
        from kvconnectors.transport import nixl_agent as nx  # _api: raw NIXL for the baseline

        g = self.geom
        api = nx._api()
        agent = api.nixl_agent(nx.unique_agent_name("bench-direct"),
                               api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        self.nx_agent = agent
        regs = nx.reg_descs([(a.ctypes.data, a.nbytes) for a in self.kv])
        self.nx_handles.append(("mem", agent.register_memory(regs, "DRAM")))
        peer = agent.add_remote_agent(meta)
        self.nx_peer = peer
        loc = nx.xfer_descs(self.target_addrs(), g.slot_bytes)
        rem = nx.xfer_descs(np.uint64(remote_base) + np.arange(g.num_slots, dtype=np.uint64)
                            * np.uint64(g.slot_bytes), g.slot_bytes)
        self.nx_loc = agent.prep_xfer_dlist("NIXL_INIT_AGENT", loc, "DRAM")
        self.nx_rem = agent.prep_xfer_dlist(peer, rem, "DRAM")
        self.nx_handles += [("h", self.nx_loc), ("h", self.nx_rem)]
        self.nx_idx = np.arange(g.num_slots, dtype=np.int32)

    def _setup_mooncake(self, session: str, remote_base: int) -> None:
        from mooncake.engine import TransferEngine

        g = self.geom
        # Mooncake's TCP transport refuses a batch with more slices than its per-peer queue holds
        # ("TCP lane queue-full rejection", then rc -1; 4096 slices of 64 KiB are already too many for
        # the default), so size the queue for one whole transfer. Read when the engine starts.
        os.environ.setdefault("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", str(max(8192, 4 * g.num_slots)))
        te = TransferEngine()
        rc = te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
        if rc != 0:
            raise RuntimeError(f"consumer TransferEngine.initialize(..., 'P2PHANDSHAKE', 'tcp', '') = {rc}")
        for a in self.kv:
            rc = te.register_memory(a.ctypes.data, a.nbytes)
            if rc != 0:
                raise RuntimeError(f"consumer TransferEngine.register_memory = {rc}")
        self.te, self.mc_session = te, session
        self.mc_local = self.target_addrs().tolist()
        self.mc_remote = (np.uint64(remote_base) + np.arange(g.num_slots, dtype=np.uint64)
                          * np.uint64(g.slot_bytes)).tolist()
        self.mc_len = [g.slot_bytes] * g.num_slots

    def close(self) -> None:
        if self.mover is not None:
            self.mover.close()
            self.mover = None
        for worker in self.workers.values():
            worker.shutdown()
        self._copy_pool.shutdown(wait=True)
        if self.sock is not None:
            self.sock.close()
        if self.nx_agent is not None:
            for kind, h in reversed(self.nx_handles):
                try:
                    self.nx_agent.deregister_memory(h) if kind == "mem" else h.release()
                except Exception:
                    pass
            try:
                self.nx_agent.remove_remote_agent(self.nx_peer)
            except Exception:
                pass
            self.nx_agent = None
        if self.te is not None:
            for a in self.kv:
                try:
                    self.te.unregister_memory(a.ctypes.data)
                except Exception:
                    pass

    # ------------------------------------------------------------------ destination checks
    def clear(self, path: str) -> None:
        if path in MOVER:
            self.mover.clear(MOVER[path])
        elif path in ("memcpy", "socket"):
            self.flat_dst[:] = 0
        else:
            for a in self.kv:
                a[:] = 0

    def verify(self, path: str) -> None:
        if path in MOVER:
            problems = self.mover.check(MOVER[path], corrupt=self.corrupt and path in STAGE_PATHS)
            if problems:
                more = f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""
                raise AssertionError("; ".join(problems[:3]) + more)
            return
        if path in ("memcpy", "socket"):
            if not np.array_equal(self.flat_dst, self.flat_payload):
                raise AssertionError(f"{path}: landed bytes differ from the payload")
            return
        for layer, a in enumerate(self.kv):
            if not np.array_equal(a[self.targets], self.payload[layer]):
                bad = int(np.flatnonzero((a[self.targets] != self.payload[layer]).any(axis=1))[0])
                raise AssertionError(f"{path}: layer {layer}, block {bad} (KV block {self.targets[bad]}) "
                                     "differs from the payload")
            if self.others.size and a[self.others].any():
                raise AssertionError(f"{path}: layer {layer}: bytes landed outside the target blocks")

    # ------------------------------------------------------------------ one timed transfer per path
    def run(self, path: str) -> float:
        if path in MOVER:
            return getattr(self.mover, MOVER[path])()
        return getattr(self, f"run_{path}")()

    def _in_threads(self, work: Callable[[int, int], None], n: int) -> None:
        """work(start, stop) over `copy_threads` contiguous shares of range(n) at once (this thread
        takes the first), as the shm path splits its copy (mover/block_shares.py)."""
        k = max(1, min(self.copy_threads, n))
        bounds = [n * i // k for i in range(k + 1)]
        others = [self._copy_pool.submit(work, bounds[i], bounds[i + 1]) for i in range(1, k)]
        work(bounds[0], bounds[1])
        for f in others:
            f.result()

    def run_memcpy(self) -> float:
        dst, src = self.flat_dst, self.flat_payload

        def share(start: int, stop: int) -> None:  # numpy copies without the GIL
            np.copyto(dst[start:stop], src[start:stop])

        t0 = time.perf_counter()
        self._in_threads(share, src.size)
        return time.perf_counter() - t0

    def run_gather(self) -> float:
        blocks = self.geom.num_blocks

        def share(start: int, stop: int) -> None:  # slots [start, stop), layer-major
            for layer in range(start // blocks, (stop - 1) // blocks + 1):
                lo, hi = max(start - layer * blocks, 0), min(stop - layer * blocks, blocks)
                self.kv[layer][self.targets[lo:hi]] = self.payload[layer, lo:hi]

        t0 = time.perf_counter()
        self._in_threads(share, self.geom.num_slots)
        return time.perf_counter() - t0

    def run_socket(self) -> float:
        view = memoryview(self.flat_dst)
        n = len(view)
        t0 = time.perf_counter()
        self.sock.sendall(b"g")
        got = 0
        while got < n:  # MSG_WAITALL: the kernel fills the whole rest before waking us (few, large receives)
            k = self.sock.recv_into(view[got:], n - got, socket.MSG_WAITALL)
            if k == 0:
                raise ConnectionError(f"socket sender closed after {got} of {n} bytes")
            got += k
        return time.perf_counter() - t0

    def _run_ours(self, path: str) -> float:
        """One request's load through the consumer worker (start_load_kv -> its Puller -> the data
        path of its transport -> take_results), from a transfer its producer worker staged."""
        from kvconnectors.benchmarks import workers

        self.seq += 1
        key = f"{path}-{self.seq}"
        stage_s, ticket = self.producer.stage(path, key)  # off the clock
        self.extra.setdefault(path, {}).setdefault("stage_s", []).append(stage_s)
        t0 = time.perf_counter()
        workers.load(self.workers[path], key, ticket, self.targets_list, TIMEOUT_S)
        return time.perf_counter() - t0

    def run_tcp(self) -> float:
        return self._run_ours("tcp")

    def run_tcp_aead(self) -> float:
        return self._run_ours("tcp_aead")

    def run_shm(self) -> float:
        return self._run_ours("shm")

    def run_nixl(self) -> float:
        return self._run_ours("nixl")

    def run_nixl_direct(self) -> float:
        agent = self.nx_agent
        self.producer.conn.send(("nixl_serve",))  # the target polls its worker until our notification
        t0 = time.perf_counter()
        h = agent.make_prepped_xfer("READ", self.nx_loc, self.nx_idx, self.nx_rem, self.nx_idx, b"bench-done")
        try:
            state = transfer_and_poll(agent, h, TIMEOUT_S)
        finally:
            h.release()
        elapsed = time.perf_counter() - t0
        got, _polls = self.producer.call(None, expect="served")
        if state != "DONE":
            raise RuntimeError(f"NIXL READ ended in state {state}")
        if not got:
            raise RuntimeError("the NIXL target never saw the READ's notification")
        return elapsed

    def run_mooncake(self) -> float:
        t0 = time.perf_counter()
        rc = self.te.batch_transfer_sync_read(self.mc_session, self.mc_local, self.mc_remote, self.mc_len)
        elapsed = time.perf_counter() - t0
        if rc != 0:
            raise RuntimeError(f"batch_transfer_sync_read returned {rc}")
        return elapsed


# ============================================================================== driver
def run_transfer(preset: str = "8b", tokens: int = 2048, block_tokens: int = 16, iters: int = 5,
                 paths: str | list[str] = "default", out: str | None = None, checksum: bool = True,
                 warmup: int = 1, seed: int = 0, show_progress: bool = True, quiet: bool = False,
                 results_dir: str | None = None, layout: str = "LBHNC", corrupt: bool = False) -> dict[str, Any]:
    """Run the benchmark; print the table (unless quiet); write JSON + PNG; return the result dict."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    if tokens < 1 or block_tokens < 1 or iters < 1 or warmup < 0:
        raise ValueError("tokens, block-tokens and iters must be >= 1, warmup >= 0")
    geom = Geometry(preset, tokens, block_tokens)
    names = parse_paths(paths)
    if any(p in MOVER for p in names):  # (imports torch: only for the mover paths)
        from kvconnectors.benchmarks.device import _layouts

        layouts = _layouts(layout)
        if len(layouts) != 1:
            raise ValueError(f"--layout: one KVCacheLayout, got {layout!r}")
        layout = layouts[0]
    if corrupt and not any(p in STAGE_PATHS for p in names):
        raise ValueError("--corrupt flips a staged byte: it needs stage or stage_raw in --paths")
    status: dict[str, dict[str, Any]] = {p: {"kind": PATHS[p].kind, "about": PATHS[p].about, "status": "ok",
                                             "reason": None, "verified": False, "times_s": []} for p in names}

    def drop(p: str, state: str, why: str) -> None:
        status[p].update(status=state, reason=why)
        if p in active:
            active.remove(p)

    active = list(names)
    for p in names:
        need = PATHS[p].needs
        why = why_unavailable(need) if need else None
        if why:
            drop(p, "skipped", why)

    producer = consumer = None
    t_start = time.perf_counter()
    try:
        need_producer = [p for p in active if PATHS[p].needs_producer]
        if need_producer:
            try:
                producer = Producer(geom, need_producer, checksum, seed)
            except Exception as exc:
                for p in need_producer:
                    drop(p, "failed", f"producer process did not start: {_describe(exc)}")
        consumer = Consumer(geom, checksum, seed, producer, active, layout, corrupt)
        for p in list(active):
            try:
                consumer.setup(p)
            except Exception as exc:
                drop(p, "skipped" if PATHS[p].kind == "engine" else "failed", _describe(exc))

        rounds = warmup + iters
        bar = progress(rounds * len(active), f"transfer {preset} {tokens} tok", show_progress)
        try:
            for r in range(rounds):
                order = active[r % len(active):] + active[:r % len(active)] if active else []
                for p in order:
                    if p not in active:
                        continue
                    bar.set_postfix_str(p)
                    try:
                        check = r == 0
                        if check:
                            consumer.clear(p)
                        dt = consumer.run(p)
                        if check:
                            consumer.verify(p)
                            status[p]["verified"] = True
                        if r >= warmup:
                            status[p]["times_s"].append(dt)
                    except Exception as exc:
                        drop(p, "failed", _describe(exc))
                    bar.update(1)
        finally:
            bar.close()
    finally:
        mover_info = consumer.mover_info() if consumer is not None else None
        if consumer is not None:
            consumer.close()
        if producer is not None:
            producer.close()

    mover = mover_info
    result = _result(geom, names, status, consumer, checksum, iters, warmup, seed, time.perf_counter() - t_start,
                     mover, layout, corrupt)
    stem = (f"transfer_{preset}_{tokens}tok_b{block_tokens}{'' if checksum else '_nocsum'}"
            + (f"_{layout}" if mover and layout != "LBHNC" else "") + ("_corrupt" if corrupt else ""))
    return publish(result, out, stem, _plot, render, quiet, results_dir)


def _result(geom: Geometry, names: list[str], status: dict, consumer: Consumer | None, checksum: bool,
            iters: int, warmup: int, seed: int, wall_s: float, mover: dict[str, Any] | None = None,
            layout: str = "LBHNC", corrupt: bool = False) -> dict[str, Any]:
    paths: dict[str, Any] = {}
    for p in names:
        s = dict(status[p])
        if s["status"] == "ok" and not s["times_s"]:
            s.update(status="failed", reason="no timed iteration completed")
        if s["status"] == "ok":
            s.update(summarize(s["times_s"], geom.total_bytes, geom.tokens))
        if consumer is not None and p in consumer.extra:
            stage = consumer.extra[p].get("stage_s", [])
            if stage:
                s["producer_stage_s_median"] = float(np.median(stage))
        paths[p] = s
    mem = paths.get("memcpy", {}).get("gbps_median")
    for s in paths.values():
        s["vs_memcpy"] = ratio(s.get("gbps_median"), mem)
    comparisons = []
    for ours, base, target in COMPARISONS:
        if ours not in paths:
            continue
        r = ratio(paths[ours].get("gbps_median"), paths.get(base, {}).get("gbps_median"))
        comparisons.append({"ours": ours, "baseline": base, "ratio": r, "target": target,
                            "met": None if r is None else r >= target,
                            "ratio_p99": ratio(paths[ours].get("gbps_p99"), paths.get(base, {}).get("gbps_p99"))})
    if mover is not None:  # the mover's ratios under bench device's names (None when a side did not run)
        med = {p: s.get("gbps_median") for p, s in paths.items()}
        mover["ratios"] = {f"{p}_vs_{b}": ratio(med.get(p), med.get(b)) for p, b, _ in COMPARISONS if p in MOVER}
    return {
        "benchmark": "transfer",
        "config": {**geom.describe(), "iters": iters, "warmup_rounds": warmup, "seed": seed,
                   "checksum": checksum, "paths": names, "order": "round-robin, start rotated each round",
                   "gb": "1e9 bytes", "layout": layout, "corrupt": corrupt,
                   "limit_copy_threads": block_shares.THREADS},
        "mover": mover,
        "host": host_info(),
        "env": {k: os.environ.get(k) for k in ("UCX_MODULES", "UCX_NET_DEVICES", "UCX_TLS",
                                               "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", "MC_TCP_LANES_PER_PEER")},
        "paths": paths,
        "comparisons": comparisons,
        "wall_s": wall_s,
    }


def render(result: dict[str, Any]) -> str:
    c = result["config"]
    head = (f"transfer: preset {c['preset']} ({c['num_layers']} layers, {c['bytes_per_token'] // 1024} KiB/token), "
            f"{c['tokens']} tokens = {c['num_blocks']} blocks of {c['block_tokens']} tokens, slot "
            f"{c['slot_bytes'] // 1024} KiB, {c['total_bytes'] / 2**20:.1f} MiB per transfer; {c['iters']} timed "
            f"iterations + {c['warmup_rounds']} warm-up, round-robin; checksums {'ON' if c['checksum'] else 'OFF'}")
    rows = []
    for name, s in result["paths"].items():
        if s["status"] == "ok":
            rows.append([name, s["kind"], s["gbps_median"], s["gbps_p99"], s["us_per_token_median"],
                         s["us_per_token_p99"], s["vs_memcpy"], s["verified"], ""])
        else:
            rows.append([name, s["kind"], None, None, None, None, None, s["verified"],
                         f"{s['status'].upper()}: {s['reason']}"])
    t1 = table(["path", "kind", "GB/s med", "GB/s p99", "us/tok med", "us/tok p99", "x memcpy", "verified", "note"],
               rows, align="llrrrrrll")
    crow = [[f"{x['ours']} / {x['baseline']}", x["ratio"], x["ratio_p99"], f">= {x['target']}",
             "-" if x["met"] is None else ("met" if x["met"] else "MISSED")] for x in result["comparisons"]]
    t2 = table(["ours / baseline", "ratio (med)", "ratio (p99)", "target", "verdict"], crow, align="lrrrl")
    extra = []
    mv = result.get("mover")
    if mv:
        r = {k: "-" if v is None else f"{fmt(v)}x" for k, v in mv["ratios"].items()}
        extra.append(f"mover: {mv['layout']} CPU caches ({mv['ops']}, "
                     + ("one gather for all layers" if mv["all_layer_gather"] else "one gather per layer")
                     + f"): stage {r['stage_vs_plain_gather']} the plain gather's GB/s "
                     f"({r['stage_raw_vs_plain_gather']} without checksums; against the int64-word gather "
                     f"{r.get('stage_vs_plain_gather_words', '-')} / {r.get('stage_raw_vs_plain_gather_words', '-')}), "
                     f"load {r['load_vs_plain_scatter']} the plain scatter's (target >= 0.9)")
        if c.get("corrupt"):
            extra.append("  (--corrupt: a byte of the warm-up's staged entry was flipped in the arena before "
                         "its check: stage rows must read FAILED)")
    files = result.get("files", {})
    tail = f"JSON {files.get('json')}\nPNG  {files.get('png')}" if files else ""
    return "\n".join([head, "", t1, "", t2, ""] + (extra + [""] if extra else []) + [tail]).rstrip()


def _plot(result: dict[str, Any], path) -> None:
    ok = [(n, s) for n, s in result["paths"].items() if s["status"] == "ok"]
    if not ok:
        return
    c = result["config"]
    notes = [f"{x['ours']}/{x['baseline']} = {x['ratio']:.2f} (target >= {x['target']})"
             for x in result["comparisons"] if x["ratio"] is not None]
    skipped = [f"{n}: {s['status']}" for n, s in result["paths"].items() if s["status"] != "ok"]
    if skipped:
        notes.append("not run: " + ", ".join(skipped))
    bar_chart(path, [n for n, _ in ok], [s["gbps_median"] for _, s in ok], [s["gbps_p99"] for _, s in ok],
              [KIND_COLOR[s["kind"]] for _, s in ok],
              title=(f"KV transfer, preset {c['preset']}, {c['tokens']} tokens, block {c['block_tokens']} "
                     f"({c['total_bytes'] / 2**20:.0f} MiB), checksums {'on' if c['checksum'] else 'off'}"),
              notes=notes, legend=[(k, c) for k, c in KIND_COLOR.items() if any(s["kind"] == k for _, s in ok)])


# ============================================================================== command line
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", choices=sorted(PRESETS), default="8b",
                        help="model KV geometry: " + "; ".join(f"{k}: {v.about}" for k, v in PRESETS.items()))
    parser.add_argument("--tokens", type=int, default=2048, help="tokens whose KV is moved per transfer")
    parser.add_argument("--block-tokens", type=int, default=16,
                        help="tokens per KV block; one (layer, block) slot is the unit every path moves")
    parser.add_argument("--iters", type=int, default=5, help="timed iterations per path (after the warm-up round)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed warm-up rounds (the first one also verifies)")
    parser.add_argument("--paths", default="default",
                        help=f"comma-separated paths and groups: {', '.join(PATHS)}; groups: default "
                             f"({','.join(GROUPS['default'])}), mover ({','.join(GROUPS['mover'])}: the "
                             "kvconnectors.mover Stager/Loader on CPU caches beside plain torch/numpy copies, "
                             "ratios stage/plain_gather and load/plain_scatter), all")
    parser.add_argument("--layout", default="LBHNC",
                        help="KVCacheLayout of the mover paths' CPU caches (LBHNC, vLLM's CPU layout; LBNHC LHBNC "
                             "BLHNC BLNHC BHLNC)")
    parser.add_argument("--corrupt", action="store_true",
                        help="negative control (tests): flip one byte of the warm-up's staged entry in the store "
                             "before it is verified; stage/stage_raw must then fail and the run exit 1")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="output directory for the JSON and PNG")
    parser.add_argument("--no-checksum", action="store_true",
                        help="stage without checksums and read with verify=False (production default is on)")
    parser.add_argument("--seed", type=int, default=0, help="payload and block-table seed")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    add_results_argument(parser)


def run(args: argparse.Namespace) -> int:
    try:
        result = run_transfer(preset=args.preset, tokens=args.tokens, block_tokens=args.block_tokens,
                              iters=args.iters, paths=args.paths, out=args.out, checksum=not args.no_checksum,
                              warmup=args.warmup, seed=args.seed, show_progress=not args.no_progress,
                              results_dir=args.results_dir, layout=args.layout, corrupt=args.corrupt)
    except ValueError as exc:
        print(f"kvconnectors bench transfer: {exc}", file=sys.stderr)
        return 2
    return 1 if any(s["status"] == "failed" for s in result["paths"].values()) else 0


def main(argv: list[str] | None = None) -> int:
    return module_main("kvconnectors.benchmarks.transfer", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
