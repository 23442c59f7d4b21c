"""Data paths as objects (transport/paths/): a new path is one class, given to the server and the
client that use it; metric labels are the paths' own; fault injection wraps a path.

Seen to fail: with the pattern path left out of the server's `paths`, the read is refused
("unknown data_path 'pattern'"); with FaultyPath.serve passing `outgoing` through unchanged, the
corrupt rule no longer changes the bytes (the checksum check passes).
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import xxhash

from kvconnectors.errors import FailureCause, TransferError
from kvconnectors.store import StoreConfig, TieredStore
from kvconnectors.transport import wire
from kvconnectors.transport.client import StoreClient
from kvconnectors.transport.faults import FaultPlan, FaultRule, FaultyPath, with_fault
from kvconnectors.transport.paths import SHM_PULL, TCP_PULL, TCP_PUSH, NixlPull, NixlPush, ReadContext, TcpPull
from kvconnectors.transport.paths.fake import FakeMedium, FakePull
from kvconnectors.transport.server import StoreServer

SLOT, LAYERS, BLOCKS = 4096, 2, 3
FP = "fp-paths"
COMPAT = wire.compat_hash("tiered")


class PatternPath(TcpPull):
    """A made-up path: streams like tcp, but serves a fixed pattern instead of the store's bytes."""
    name, label = "pattern", "pattern"

    def serve(self, ctx, sock, read, nvme_slots, ttl, checksums, outgoing=None) -> None:
        n = len(read.layers) * read.num_blocks * ctx.store.slot_bytes
        wire.send_msg(sock, wire.ReadReply(ok=True, nbytes=n, lease_ttl_s=ttl))
        wire.send_all(sock, [memoryview(np.full(n, 0xA5, dtype=np.uint8))])


def _staged_server(paths=None, faults=None) -> tuple[TieredStore, StoreServer]:
    store = TieredStore(StoreConfig(slot_bytes=SLOT, dram_bytes=32 * SLOT, lease_ttl_s=30))
    data = np.arange(LAYERS * BLOCKS * SLOT, dtype=np.uint32).astype(np.uint8).reshape(LAYERS, BLOCKS, SLOT)
    store.create("t", LAYERS, BLOCKS)
    for layer in range(LAYERS):
        store.write("t", layer, 0, data[layer])
    store.seal("t", {"xxh3": [xxhash.xxh3_64_intdigest(data[l, b]) for l in range(LAYERS) for b in range(BLOCKS)]})
    return store, StoreServer(store, "127.0.0.1", 0, fingerprint=FP, num_layers=LAYERS, compat=COMPAT, paths=paths,
                              faults=faults)


@pytest.mark.parametrize("offered", [True, False])
def test_a_new_path_is_one_class_given_to_both_ends(offered) -> None:
    store, srv = _staged_server(paths=[TCP_PULL, PatternPath()] if offered else [TCP_PULL])
    dest_buf = np.zeros((LAYERS * BLOCKS, SLOT), dtype=np.uint8)
    try:
        with StoreClient("127.0.0.1", srv.port, compat=COMPAT) as c:
            read = lambda: c.read("t", range(LAYERS), 0, [memoryview(r) for r in dest_buf], fingerprint=FP,  # noqa: E731
                                  deadline=time.monotonic() + 5, path=PatternPath())
            if offered:
                assert read() == dest_buf.nbytes
                assert (dest_buf == 0xA5).all()
            else:
                with pytest.raises(TransferError, match="unknown data_path 'pattern'") as exc:
                    read()
                assert exc.value.cause is FailureCause.PROTOCOL
    finally:
        srv.close()
        store.close()


def test_a_server_refuses_a_known_path_it_does_not_offer_naming_why() -> None:
    store, srv = _staged_server()
    try:
        with StoreClient("127.0.0.1", srv.port, compat=COMPAT) as c, pytest.raises(TransferError) as exc:
            c.read("t", range(LAYERS), 0, [memoryview(bytearray(SLOT)) for _ in range(LAYERS * BLOCKS)],
                   fingerprint=FP, deadline=time.monotonic() + 5, path=SHM_PULL)
        assert "data_path 'shm' asked, but this store has no shm arena" in str(exc.value)
    finally:
        srv.close()
        store.close()


def test_metric_labels_are_the_paths_own() -> None:
    assert [p.label for p in (TCP_PULL, SHM_PULL, NixlPull())] == ["tcp", "shm", "nixl"]
    assert [p.label for p in (TCP_PUSH, NixlPush())] == ["push_tcp", "push_nixl"]
    assert [p.name for p in (TCP_PULL, SHM_PULL, NixlPull(), TCP_PUSH, NixlPush())] == [
        "inline", "shm", "nixl", "inline", "nixl"]  # the wire's data_path values, unchanged


def test_data_faults_wrap_the_path_and_control_faults_do_not() -> None:
    assert with_fault(TCP_PULL, None) is TCP_PULL
    assert with_fault(TCP_PULL, FaultRule(action="drop")) is TCP_PULL
    wrapped = with_fault(TCP_PULL, FaultRule(action="corrupt"))
    assert isinstance(wrapped, FaultyPath) and wrapped.label == "tcp" and wrapped.streams
    store, srv = _staged_server(faults=FaultPlan.from_config([{"action": "corrupt"}]))
    try:
        with StoreClient("127.0.0.1", srv.port, compat=COMPAT) as c, pytest.raises(TransferError) as exc:
            c.read("t", range(LAYERS), 0, [memoryview(bytearray(SLOT)) for _ in range(LAYERS * BLOCKS)],
                   fingerprint=FP, deadline=time.monotonic() + 5)
        assert exc.value.cause is FailureCause.CHECKSUM_MISMATCH
    finally:
        srv.close()
        store.close()


class _Log:
    """Collects what a source end logs."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def warning(self, msg, *args) -> None:
        self.lines.append(msg % args)

    info = warning


def _context(store: TieredStore) -> tuple[ReadContext, list[int], _Log]:
    """What TcpPull.serve is given by a server, without the sockets and threads of a real one."""
    reads: list[int] = []
    log = _Log()
    return ReadContext(store=store, idle_timeout_s=5.0, count_read=reads.append, reject=lambda reason: None,
                       finish_offset_read=lambda *a: None, log=log), reads, log


def test_an_entry_spilled_after_the_servers_look_is_streamed_from_the_tiers(tmp_path) -> None:
    """The server decides between pinning (DRAM) and streaming (NVMe) from `info`, taken a moment
    before: an entry spilled in between, with DRAM too full of pinned entries to bring it back,
    used to fail the read with store_full (seen in an e2e run at 256 KiB of DRAM). Now it is
    streamed from the tiers, byte-exact. Seen to fail: without the StoreFullError fallback in
    TcpPull.serve this raises "cannot pin"."""
    import socket

    slot = 4096
    cfg = StoreConfig(slot_bytes=slot, dram_bytes=4 * slot, nvme_dirs=[str(tmp_path / "nvme")],
                      nvme_bytes=64 * slot, nvme_create_dirs=True, lease_ttl_s=30)
    store = TieredStore(cfg)
    try:
        rng = np.random.default_rng(0)
        data = rng.integers(0, 256, size=(2, 2, slot), dtype=np.uint8)
        store.create("old", 2, 2)
        for layer in range(2):
            store.write("old", layer, 0, data[layer])
        store.seal("old")
        store.create("new", 2, 2)  # fills DRAM: "old" spills to NVMe
        for layer in range(2):
            store.write("new", layer, 0, data[layer])
        store.seal("new")
        assert store.info("old").nvme_slots, "the setup did not spill the older entry"
        read = wire.Read(transfer_id="old", layers=[0, 1], first_block=0, num_blocks=2, fingerprint="f")
        a, b = socket.socketpair()
        with a, b, store.pinned_views("new", [0, 1]):  # DRAM pinned: "old" cannot come back
            b.settimeout(10)
            ctx, reads, log = _context(store)
            TCP_PULL.serve(ctx, a, read, 0, 30.0, None)  # stale: "no NVMe slots"
            reply = wire.recv_msg(b, deadline=time.monotonic() + 10)
            got = np.empty(data.size, dtype=np.uint8)
            wire.recv_exact(b, memoryview(got), time.monotonic() + 10)
        assert reply.ok and reply.nbytes == data.size and reads == [data.size] and not log.lines
        assert np.array_equal(got, data.reshape(-1))
    finally:
        store.close()


def test_the_fake_pair_carries_a_read_through_the_real_server_and_client() -> None:
    """FakePull (paths/fake.py): the control protocol runs for real, the bytes go through memory;
    the entry is released after the sink end, as for shm."""
    medium = FakeMedium()
    store, srv = _staged_server(paths=[TCP_PULL, FakePull(medium)])
    dest_buf = np.zeros((LAYERS * BLOCKS, SLOT), dtype=np.uint8)
    try:
        with StoreClient("127.0.0.1", srv.port, compat=COMPAT) as c:
            got = c.read("t", range(LAYERS), 0, [memoryview(r) for r in dest_buf], fingerprint=FP,
                         deadline=time.monotonic() + 5, path=FakePull(medium))
        assert got == dest_buf.nbytes == medium.carried
        want = np.arange(LAYERS * BLOCKS * SLOT, dtype=np.uint32).astype(np.uint8).reshape(-1, SLOT)
        assert np.array_equal(dest_buf, want)
        deadline = time.monotonic() + 5
        while store.contains("t") and time.monotonic() < deadline:  # released by the client's Release
            time.sleep(0.01)
        assert not store.contains("t")
    finally:
        srv.close()
        store.close()


def test_a_fake_medium_that_corrupts_a_row_fails_the_read_and_keeps_the_entry() -> None:
    """A handler on the fake medium stands in for a medium that delivers the wrong bytes: the
    client's checksum check names the block, answers Ack(ok=False), and the producer keeps the
    entry for a retry. Seen to fail: with verify=False the read succeeds on the corrupted bytes."""
    def flip_block_4(read, rows):
        rows = rows.copy()
        rows[4] ^= 0xFF
        return rows

    medium = FakeMedium(handler=flip_block_4)
    store, srv = _staged_server(paths=[TCP_PULL, FakePull(medium)])
    dest = [memoryview(bytearray(SLOT)) for _ in range(LAYERS * BLOCKS)]
    try:
        with StoreClient("127.0.0.1", srv.port, compat=COMPAT) as c:
            with pytest.raises(TransferError, match="block 4 of 6") as exc:
                c.read("t", range(LAYERS), 0, dest, fingerprint=FP, deadline=time.monotonic() + 5,
                       path=FakePull(medium))
            assert exc.value.cause is FailureCause.CHECKSUM_MISMATCH
            medium.handler = None  # the same connection stays in step: the retry reads it whole
            assert c.read("t", range(LAYERS), 0, dest, fingerprint=FP, deadline=time.monotonic() + 5,
                          path=FakePull(medium)) == LAYERS * BLOCKS * SLOT
    finally:
        srv.close()
        store.close()
