"""The `nixl` data path: a consumer READs staged blocks through NIXL (UCX) from a producer's store
arena into non-contiguous destination blocks, under our control protocol.

Producers run in spawned processes (a real TieredStore + StoreServer with nixl=True); the consumer
(StoreClient + NixlSink) runs here. UCX_NET_DEVICES=lo / UCX_MODULES=^ib come from conftest.py (and
again here, before NIXL loads, for a run of this file alone).
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import threading
import time

from kvconnectors.transport.ucx_env import set_cpu_defaults

set_cpu_defaults()

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import xxhash  # noqa: E402

from kvconnectors.errors import ConfigError, FailureCause, TransferError  # noqa: E402
from kvconnectors.transport import nixl as nx  # noqa: E402
from kvconnectors.transport import nixl_agent  # noqa: E402
from kvconnectors.transport import wire  # noqa: E402
from kvconnectors.transport.client import StoreClient  # noqa: E402
from kvconnectors.transport.paths import NixlPull  # noqa: E402

_MISSING = nx.nixl_import_error()
needs_nixl = pytest.mark.skipif(_MISSING is not None,
                                reason=f"nixl is not importable here ({_MISSING}); pip install 'kvconnectors[nixl]'")

SLOT, LAYERS, BLOCKS = 8192, 2, 6
FP = "fp-test"
COMPAT = wire.compat_hash("nixl-test")
TARGETS = [9, 2, 14, 5, 11, 0]  # destination block of remote block i: scattered, out of order


def _data(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (LAYERS, BLOCKS, SLOT), dtype=np.uint8)


def _sums(data: np.ndarray) -> list[int]:
    return [xxhash.xxh3_64_intdigest(data[layer, b]) for layer in range(LAYERS) for b in range(BLOCKS)]


def _producer(conn, port: int, seed: int) -> None:
    """Child process: a store with entry "t1" (good checksums) and "bad" (one wrong checksum)."""
    from kvconnectors.store import StoreConfig, TieredStore
    from kvconnectors.transport.server import StoreServer

    store = TieredStore(StoreConfig(slot_bytes=SLOT, dram_bytes=SLOT * 64, instance_name="nixltest"))
    server = StoreServer(store, "127.0.0.1", port, fingerprint=FP, num_layers=LAYERS, compat=COMPAT, nixl=True)
    data = _data(seed)
    for key in ("t1", "t2", "bad"):
        store.create(key, LAYERS, BLOCKS)
        for layer in range(LAYERS):
            store.write(key, layer, 0, data[layer])
        sums = _sums(data)
        if key == "bad":
            sums[3] ^= 1
        store.seal(key, {"xxh3": sums})
    conn.send((server.port, server.nixl.metadata, server.nixl.base_address))
    while True:
        cmd = conn.recv()
        if cmd == "keys":
            conn.send(sorted(store.keys()))
        elif cmd == "counters":
            conn.send((server.counters.reads, dict(server.counters.rejected)))
        elif cmd == "stop":
            server.close()
            store.close()
            conn.send("stopped")
            return


class Producer:
    def __init__(self, port: int = 0, seed: int = 1):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_producer, args=(child, port, seed), daemon=True)
        self.proc.start()
        if not self.conn.poll(60):
            self.proc.kill()
            raise RuntimeError("producer did not start")
        self.port, self.meta, self.base = self.conn.recv()
        self.data = _data(seed)

    def ask(self, cmd: str):
        self.conn.send(cmd)
        assert self.conn.poll(20), f"producer did not answer {cmd}"
        return self.conn.recv()

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.ask("stop")
            except (OSError, EOFError, AssertionError):
                pass
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(10)


@pytest.fixture(scope="module")
def sink():
    s = nx.NixlSink(tag="test")
    yield s
    s.close()


@pytest.fixture(scope="module")
def cache(sink):
    """Stand-in for a KV cache: (layers, 16 blocks, SLOT), registered once."""
    buf = np.zeros((LAYERS, 16, SLOT), dtype=np.uint8)
    sink.register([buf])
    return buf


def _dest(cache: np.ndarray) -> list[memoryview]:
    return [memoryview(cache[layer, b]) for layer in range(LAYERS) for b in TARGETS]


def _read(client: StoreClient, tid: str, sink, cache, timeout: float = 10.0) -> int:
    return client.read(tid, range(LAYERS), 0, _dest(cache), fingerprint=FP, deadline=time.monotonic() + timeout,
                       path=NixlPull(sink=sink))


def _assert_landed(cache: np.ndarray, data: np.ndarray) -> None:
    for layer in range(LAYERS):
        for i, b in enumerate(TARGETS):
            assert np.array_equal(cache[layer, b], data[layer, i]), f"layer {layer} block {i} -> {b} differs"
    untouched = sorted(set(range(16)) - set(TARGETS))
    assert not cache[:, untouched].any(), "a block outside the destination list was written"


# ------------------------------------------------------------------------------------------ tests
def test_missing_nixl_fails_startup_with_install_hint(monkeypatch):
    def broken():
        raise ImportError("No module named 'nixl'")

    monkeypatch.setattr(nixl_agent, "_api", broken)  # where require_nixl and the agents look it up
    with pytest.raises(ConfigError, match=r"pip install 'kvconnectors\[nixl\]'"):
        nx.require_nixl()
    with pytest.raises(TransferError, match="not importable"):
        nx.NixlSink()


@needs_nixl
def test_pull_into_scattered_blocks_verify_release(sink, cache):
    prod = Producer()
    loads = sink.peer_loads
    try:
        with StoreClient("127.0.0.1", prod.port, compat=COMPAT) as client:
            cache[:] = 0
            assert _read(client, "t1", sink, cache) == LAYERS * BLOCKS * SLOT
            _assert_landed(cache, prod.data)
            assert sink.open_handles == 0

            # A wrong staged checksum is caught (so verification really runs); the consumer answers
            # Ack(ok=False), the producer keeps the entry and the session stays usable.
            with pytest.raises(TransferError) as err:
                _read(client, "bad", sink, cache)
            assert err.value.cause is FailureCause.CHECKSUM_MISMATCH
            assert prod.ask("keys") == ["bad", "t2"]

            with pytest.raises(TransferError) as err:
                _read(client, "no-such-transfer", sink, cache)
            assert err.value.cause is FailureCause.UNKNOWN_TRANSFER

            cache[:] = 0
            _read(client, "t2", sink, cache)  # same session, agent cached: no second add_remote_agent
            _assert_landed(cache, prod.data)
            client.release("bad", time.monotonic() + 5)
        assert prod.ask("keys") == []
        reads, rejected = prod.ask("counters")
        assert reads == 2 and rejected.get("unknown_transfer") == 1
        assert sink.open_handles == 0 and sink.peer_loads == loads + 1
    finally:
        prod.stop()


@needs_nixl
def test_producer_killed_mid_session_then_restarted(sink, cache):
    prod = Producer(seed=2)
    port, key = prod.port, f"127.0.0.1:{prod.port}"
    try:
        client = StoreClient("127.0.0.1", port, compat=COMPAT)
        _read(client, "t1", sink, cache)
        _assert_landed(cache, prod.data)
        stale_meta, stale_base = prod.meta, prod.base
        prod.kill()

        # The control session notices first: typed, fast, well inside the deadline.
        t0 = time.monotonic()
        with pytest.raises(TransferError) as err:
            _read(client, "t2", sink, cache, timeout=3.0)
        assert err.value.cause in (FailureCause.PEER_UNREACHABLE, FailureCause.TIMEOUT)
        assert time.monotonic() - t0 < 3.5
        client.close()

        # A READ at the dead agent (cached peer) fails typed too, releases everything, drops the peer.
        local = np.array([cache[0, b].ctypes.data for b in TARGETS], dtype=np.uint64)
        remote = stale_base + np.arange(len(TARGETS), dtype=np.uint64) * SLOT
        t0 = time.monotonic()
        with pytest.raises(TransferError) as err:
            sink.read(key, stale_meta, remote, local, SLOT, time.monotonic() + 3.0)
        assert err.value.cause in (FailureCause.PEER_UNREACHABLE, FailureCause.TIMEOUT), err.value
        assert time.monotonic() - t0 < 3.5
        assert sink.open_handles == 0 and key not in sink.peers

        # A new producer on the same address: new agent, metadata reloaded, pull works.
        loads = sink.peer_loads
        prod = Producer(port=port, seed=3)
        with StoreClient("127.0.0.1", port, compat=COMPAT) as client:
            cache[:] = 0
            _read(client, "t1", sink, cache)
        _assert_landed(cache, prod.data)
        assert sink.peer_loads == loads + 1 and sink.open_handles == 0
    finally:
        prod.stop()


@needs_nixl
def test_stale_cached_agent_is_replaced_when_producer_restarts(sink, cache):
    """Same address, cached agent still present (no failed read in between): the new metadata wins."""
    prod = Producer(seed=4)
    port = prod.port
    try:
        with StoreClient("127.0.0.1", port, compat=COMPAT) as client:
            _read(client, "t1", sink, cache)
        old = sink.peers[f"127.0.0.1:{port}"]
        prod.kill()
        prod = Producer(port=port, seed=5)
        with StoreClient("127.0.0.1", port, compat=COMPAT) as client:
            cache[:] = 0
            _read(client, "t1", sink, cache)
        _assert_landed(cache, prod.data)
        assert sink.peers[f"127.0.0.1:{port}"] != old and sink.open_handles == 0
    finally:
        prod.stop()


@needs_nixl
def test_agent_wrappers_in_process_no_leak_timeout_and_idle_cpu(sink, cache):
    arena = np.random.default_rng(7).integers(0, 256, (32, SLOT), dtype=np.uint8)
    source = nx.NixlSource(arena.ctypes.data, arena.nbytes, tag="inproc")
    a, b = socket.socketpair()
    done = threading.Event()

    def serve():  # the producer's side of a read: progress until the consumer answers
        source.serve_until_readable(a, time.monotonic() + 30)
        done.set()

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    try:
        local = np.array([cache[1, t].ctypes.data for t in TARGETS], dtype=np.uint64)
        order = np.array([31, 0, 7, 8, 20, 3], dtype=np.uint64)
        for _ in range(150):  # handles and descriptor lists are released every time
            sink.read("inproc", source.metadata, source.base_address + order * SLOT, local, SLOT,
                      time.monotonic() + 10)
        assert sink.open_handles == 0
        for i, t in enumerate(TARGETS):
            assert np.array_equal(cache[1, t], arena[order[i]])

        # A remote range outside the producer's registered arena: typed protocol error, nothing leaks.
        with pytest.raises(TransferError) as err:
            sink.read("inproc", source.metadata, source.base_address + order * SLOT + arena.nbytes, local, SLOT,
                      time.monotonic() + 5)
        assert err.value.cause is FailureCause.PROTOCOL
        # A local range outside registered memory is refused before NIXL sees it.
        with pytest.raises(TransferError, match="outside the memory registered"):
            sink.read("inproc", source.metadata, source.base_address + order * SLOT, local + np.uint64(1 << 40),
                      SLOT, time.monotonic() + 5)
        assert sink.open_handles == 0
    finally:
        b.sendall(b"x")  # "Release": the serving loop stops polling
        server.join(5)
    assert done.is_set() and source.progress_calls > 0

    # A target nobody progresses never answers the wire-up: the READ times out at the deadline.
    silent = nx.NixlSource(arena.ctypes.data, arena.nbytes, tag="silent")
    try:
        t0 = time.monotonic()
        with pytest.raises(TransferError) as err:
            sink.read("silent", silent.metadata, silent.base_address + order * SLOT, local, SLOT,
                      time.monotonic() + 0.5)
        assert err.value.cause is FailureCause.TIMEOUT, err.value
        assert 0.5 <= time.monotonic() - t0 < 2.0
        assert sink.open_handles == 0 and "silent" not in sink.peers

        # Idle agents (progress thread off) cost ~no CPU: three alive here, nothing in flight.
        import psutil

        proc = psutil.Process()
        c0, t0 = proc.cpu_times(), time.monotonic()
        time.sleep(1.0)
        c1, t1 = proc.cpu_times(), time.monotonic()
        busy = (c1.user - c0.user + c1.system - c0.system) / (t1 - t0)
        assert busy < 0.15, f"idle NIXL agents used {busy:.0%} of a core"
    finally:
        silent.close()
        source.close()
        a.close()
        b.close()
