"""Measure our `nixl` data path against NIXL driven directly, in one run, same layout.

    from kvconnectors.benchmarks.nixl_bench import bench_nixl_pull
    r = bench_nixl_pull(256 << 20)      # {"ours_gbps": ..., "raw_gbps": ..., "ratio": ..., ...}

- ours: a producer process runs a TieredStore + StoreServer(nixl=True) holding one staged entry of
  `nbytes` (1 layer x nbytes/block_bytes blocks); this process pulls it with StoreClient.read
  (data_path "nixl") into a registered buffer. One timed pull = Read/ReadReply round trip, remote
  agent lookup, descriptor preparation, the READ, checksum verification if `verify`, Release/Ack.
  The producer re-stages a fresh entry between pulls (outside the timing), since a pull releases it.
- raw: a producer process registers a buffer of the same size with a plain NIXL agent; this process
  READs it with its own agent, descriptor lists prepared once (the idiomatic fastest use), timing
  make_prepped_xfer + transfer + polling to DONE, with NIXL's default progress threads
  (`raw_progress_thread`), as vLLM's NixlConnector runs it.

Both use the same block size and mapping: "scatter" sends remote block i to a random local block (a
vLLM-like block table; NIXL cannot merge descriptors), "contiguous" keeps the order. The phases run
one after the other so one's progress threads never compete with the other. GB/s = bytes / s / 1e9,
medians over `iters` timed pulls after `warmup`.

On a CPU-only host the caller sets UCX_NET_DEVICES=lo and UCX_MODULES=^ib before calling
(kvconnectors.transport.ucx_env.set_cpu_defaults; the producer processes inherit the environment).
"""

from __future__ import annotations

import mmap
import multiprocessing as mp
import statistics
import time
from typing import Any

import numpy as np
import xxhash

_FP = "nixl-bench"


def _payload(nbytes: int, seed: int) -> np.ndarray:
    return np.frombuffer(np.random.default_rng(seed).bytes(nbytes), dtype=np.uint8)


def _ours_producer(conn: Any, nbytes: int, block_bytes: int, seed: int, verify: bool, compat: str) -> None:
    from kvconnectors.store import StoreConfig, TieredStore
    from kvconnectors.transport.server import StoreServer

    blocks = nbytes // block_bytes
    data = _payload(nbytes, seed).reshape(blocks, block_bytes)
    sums = {"xxh3": [xxhash.xxh3_64_intdigest(row) for row in data]} if verify else None
    store = TieredStore(StoreConfig(slot_bytes=block_bytes, dram_bytes=nbytes, instance_name="nixlbench"))
    server = StoreServer(store, "127.0.0.1", 0, fingerprint=_FP, num_layers=1, compat=compat, nixl=True)
    conn.send(server.port)
    try:
        while True:
            cmd = conn.recv()
            if cmd == "stop":
                return
            store.create(cmd, 1, blocks)
            store.write(cmd, 0, 0, data)
            store.seal(cmd, sums)
            conn.send("staged")
    finally:
        server.close()
        store.close()


def _raw_producer(conn: Any, nbytes: int, seed: int, progress_thread: bool) -> None:
    from kvconnectors.transport import nixl_agent as nx  # _api: raw NIXL for the baseline

    api = nx._api()
    agent = api.nixl_agent(nx.unique_agent_name("bench-target"),
                           api.nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"]))
    buf = np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8)
    buf[:] = _payload(nbytes, seed)
    agent.register_memory(nx.reg_descs([(buf.ctypes.data, buf.nbytes)]), "DRAM")
    conn.send((agent.get_agent_metadata(), buf.ctypes.data))
    while True:
        if progress_thread:
            cmd = conn.recv()
        else:  # no progress thread: this target must poll its worker for the READ to complete
            agent.get_new_notifs()
            if not conn.poll(0.0005):
                continue
            cmd = conn.recv()
        if cmd == "stop":
            return


def transfer_and_poll(agent: Any, handle: Any, timeout_s: float) -> str:
    """NIXL driven directly, the baselines' way: post the prepped transfer `handle` and poll its state
    without sleeping until it leaves PROC or `timeout_s` has passed; returns the last state (the caller
    releases the handle). Not NixlSink.read's loop on purpose: ours backs off between polls so a long
    READ does not spin a core, and this is the fastest use of NIXL that ours is measured against."""
    state = agent.transfer(handle)
    deadline = time.monotonic() + timeout_s
    while state == "PROC" and time.monotonic() < deadline:
        state = agent.check_xfer_state(handle)
    return state


def _mapping(blocks: int, layout: str, seed: int) -> np.ndarray:
    if layout == "scatter":
        return np.random.default_rng(seed + 1).permutation(blocks)
    if layout == "contiguous":
        return np.arange(blocks)
    raise ValueError(f"layout must be 'scatter' or 'contiguous', got {layout!r}")


def bench_nixl_pull(nbytes: int = 256 << 20, *, block_bytes: int = 128 << 10, iters: int = 5, warmup: int = 1,
                    layout: str = "scatter", verify: bool = False, raw_progress_thread: bool = True,
                    seed: int = 0, timeout_s: float = 120.0) -> dict[str, Any]:
    """Pull `nbytes` through our nixl path and through raw NIXL; returns GB/s of both (medians),
    the per-pull seconds, and ours/raw. The landed bytes are checked once per phase."""
    from kvconnectors.transport import nixl_agent as nx  # _api: raw NIXL for the baseline
    from kvconnectors.transport import wire
    from kvconnectors.transport.client import StoreClient
    from kvconnectors.transport.nixl import NixlSink
    from kvconnectors.transport.paths import NixlPull

    if nbytes < block_bytes or nbytes % block_bytes:
        raise ValueError(f"nbytes={nbytes} must be a positive multiple of block_bytes={block_bytes}")
    nx.require_nixl()
    blocks = nbytes // block_bytes
    local_of = _mapping(blocks, layout, seed)  # remote block i lands in local block local_of[i]
    expected = _payload(nbytes, seed).reshape(blocks, block_bytes)
    dst = np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8).reshape(blocks, block_bytes)
    dst[:] = 0  # fault the pages in outside the timing
    ctx = mp.get_context("spawn")
    result: dict[str, Any] = {"nbytes": nbytes, "block_bytes": block_bytes, "blocks": blocks, "layout": layout,
                              "iters": iters, "verify": verify, "raw_progress_thread": raw_progress_thread}

    # -------------------------------------------------------------- ours
    compat = wire.compat_hash("nixl-bench")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_ours_producer, args=(child, nbytes, block_bytes, seed, verify, compat), daemon=True)
    proc.start()
    sink = None
    try:
        if not conn.poll(timeout_s):
            raise TimeoutError("the nixl benchmark producer did not start")
        port = conn.recv()
        sink = NixlSink(tag="bench")
        sink.register([dst])
        dest = [memoryview(dst[j]) for j in local_of]
        times = []
        with StoreClient("127.0.0.1", port, compat=compat) as client:
            for k in range(warmup + iters):
                conn.send(f"b{k}")
                if not conn.poll(timeout_s):
                    raise TimeoutError("the nixl benchmark producer did not stage in time")
                conn.recv()
                t0 = time.perf_counter()
                client.read(f"b{k}", [0], 0, dest, fingerprint=_FP, deadline=time.monotonic() + timeout_s,
                            verify=verify, path=NixlPull(sink=sink))
                if k >= warmup:
                    times.append(time.perf_counter() - t0)
        if not np.array_equal(dst[local_of], expected):
            raise AssertionError("our nixl path landed wrong bytes")
        result["ours_s"] = times
        conn.send("stop")
    finally:
        if sink is not None:
            sink.close()
        proc.join(10)
        if proc.is_alive():
            proc.kill()

    # -------------------------------------------------------------- raw NIXL
    dst[:] = 0
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_raw_producer, args=(child, nbytes, seed, raw_progress_thread), daemon=True)
    proc.start()
    try:
        if not conn.poll(timeout_s):
            raise TimeoutError("the raw NIXL benchmark producer did not start")
        meta, base = conn.recv()
        api = nx._api()
        agent = api.nixl_agent(nx.unique_agent_name("bench-raw"),
                               api.nixl_agent_config(enable_prog_thread=raw_progress_thread, backends=["UCX"]))
        reg = agent.register_memory(nx.reg_descs([(dst.ctypes.data, dst.nbytes)]), "DRAM")
        peer = agent.add_remote_agent(meta)
        loc_d = nx.xfer_descs(dst.ctypes.data + local_of.astype(np.uint64) * block_bytes, block_bytes)
        rem_d = nx.xfer_descs(base + np.arange(blocks, dtype=np.uint64) * block_bytes, block_bytes)
        loc = agent.prep_xfer_dlist("NIXL_INIT_AGENT", loc_d, "DRAM")
        rem = agent.prep_xfer_dlist(peer, rem_d, "DRAM")
        idx = np.arange(blocks, dtype=np.int32)
        times = []
        try:
            for k in range(warmup + iters):
                t0 = time.perf_counter()
                h = agent.make_prepped_xfer("READ", loc, idx, rem, idx)
                try:
                    state = transfer_and_poll(agent, h, timeout_s)
                finally:
                    h.release()
                if state != "DONE":
                    raise RuntimeError(f"raw NIXL READ ended in state {state}")
                if k >= warmup:
                    times.append(time.perf_counter() - t0)
        finally:
            loc.release()
            rem.release()
            agent.remove_remote_agent(peer)
            agent.deregister_memory(reg)
            del agent
        if not np.array_equal(dst[local_of], expected):
            raise AssertionError("raw NIXL landed wrong bytes")
        result["raw_s"] = times
        conn.send("stop")
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()

    result["ours_gbps"] = nbytes / statistics.median(result["ours_s"]) / 1e9
    result["raw_gbps"] = nbytes / statistics.median(result["raw_s"]) / 1e9
    result["ratio"] = result["ours_gbps"] / result["raw_gbps"]
    return result


if __name__ == "__main__":
    import json
    import sys

    from kvconnectors.transport.ucx_env import set_cpu_defaults

    set_cpu_defaults()
    mib = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    print(json.dumps(bench_nixl_pull(mib << 20), indent=1, default=lambda x: round(x, 6)))
