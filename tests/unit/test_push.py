"""Push mode on the transfer plane: a producer store + PushSender streaming layer groups into a
consumer's landing store over real sockets (inline, and NIXL where it imports). No engine: the
producer's and the consumer's KV caches are plain torch tensors, staged into the producer store
by the mover's Stager and copied out of the landing store into the consumer's cache by its
Loader, as the connector's worker does."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from kvconnectors.errors import FailureCause, TransferError
from kvconnectors.mover import CpuOps, Loader, Stager, describe_kv_caches
from kvconnectors.store import StoreConfig, TieredStore
from kvconnectors.transport import wire
from kvconnectors.transport.client import StoreClient, store_status
from kvconnectors.transport.faults import FaultPlan
from kvconnectors.transport.landing import Landing
from kvconnectors.transport.nixl import nixl_import_error
from kvconnectors.transport.paths import TCP_PUSH, NixlPush
from kvconnectors.transport.protocol import parse_target
from kvconnectors.transport.push import PushJob, PushSender
from kvconnectors.transport.server import StoreServer

SLOT = 4096
LAYERS, BLOCKS = 4, 6
CACHE_BLOCKS = 16   # blocks of each side's KV cache; a request's BLOCKS sit at scattered ids
SRC_IDS = np.random.default_rng(11).permutation(CACHE_BLOCKS)[:BLOCKS]
DST_IDS = np.random.default_rng(12).permutation(CACHE_BLOCKS)[:BLOCKS]
FP = "fp-push"
COMPAT = wire.compat_hash("tiered")


class KVCache:
    """An engine's KV cache as vLLM hands it to a connector (layout LBHNC: one allocation, a
    [blocks, 1, 1, SLOT] uint8 view per layer, a block being one slot of bytes), with `rows`, a
    numpy [LAYERS, CACHE_BLOCKS, SLOT] view of the same memory."""

    def __init__(self) -> None:
        self.rows = np.zeros((LAYERS, CACHE_BLOCKS, SLOT), np.uint8)
        full = torch.from_numpy(self.rows).view(LAYERS, CACHE_BLOCKS, 1, 1, SLOT)
        self.geometry = describe_kv_caches({f"model.layers.{i}.self_attn.attn": full[i] for i in range(LAYERS)},
                                           block_size=1, layout="LBHNC")


class Pair:
    """A producer (KV cache + store + Stager + server + sender) and a consumer (landing store
    server + KV cache + Loader)."""

    def __init__(self, *, nixl: bool = False, landing_dram_slots: int = 256, faults: FaultPlan | None = None,
                 landing_fp: str = FP, ttl: float = 30.0):
        self.ops = CpuOps("push-test-copy")
        self.kv, self.consumer_kv = KVCache(), KVCache()
        self.src = TieredStore(StoreConfig(slot_bytes=SLOT, dram_bytes=256 * SLOT, lease_ttl_s=30))
        self.stager = Stager(self.kv.geometry, self.src, self.ops, checksum=True)
        self.loader = Loader(self.consumer_kv.geometry, self.ops)
        self.src_server = StoreServer(self.src, "127.0.0.1", 0, fingerprint=FP, num_layers=LAYERS, compat=COMPAT,
                                      nixl=nixl)
        self.dst = TieredStore(StoreConfig(slot_bytes=SLOT, dram_bytes=landing_dram_slots * SLOT, lease_ttl_s=ttl))
        paths = [TCP_PUSH]
        if nixl:
            from kvconnectors.transport.nixl import NixlSink

            paths.append(NixlPush(sink_factory=lambda: NixlSink(tag="landing-test")))
        self.landing = Landing(self.dst, fingerprint=landing_fp, num_layers=LAYERS, paths=paths)
        self.dst_server = StoreServer(self.dst, "127.0.0.1", 0, fingerprint=landing_fp, num_layers=LAYERS,
                                      compat=COMPAT, landing=self.landing, faults=faults)
        self.done: dict[str, TransferError | None] = {}
        self.done_event = threading.Event()
        self.sender = PushSender(self.src, fingerprint=FP, num_layers=LAYERS, timeout_s=5,
                                 client_factory=lambda h, p: StoreClient(h, p, compat=COMPAT, connect_timeout_s=2),
                                 on_done=self._on_done,
                                 path=NixlPush(source=self.src_server.nixl) if nixl else TCP_PUSH)
        self.target = ("127.0.0.1", self.dst_server.port)

    def _on_done(self, tid: str, target: tuple[str, int], err: TransferError | None) -> None:
        self.done[tid] = err
        self.done_event.set()

    def use_store(self, store: TieredStore) -> None:
        """Stage into (and push from) another producer store."""
        self.src.close()
        self.sender.store = self.src = store
        self.stager = Stager(self.kv.geometry, store, self.ops, checksum=True)

    def fill(self, seed: int) -> np.ndarray:
        """The forward pass: seeded bytes into the request's blocks of the producer's KV cache;
        returns them as [LAYERS, BLOCKS, SLOT]."""
        data = np.random.default_rng(seed).integers(0, 256, (LAYERS, BLOCKS, SLOT), dtype=np.uint8)
        self.kv.rows[:, SRC_IDS] = data
        return data

    def stage(self, tid: str, layer: int) -> list[int]:
        """One layer's save, as the worker does it: the Stager copies the request's blocks of the
        layer into the entry's slots and commits them; returns their xxh3 checksums."""
        copy = self.stager.stage(tid, [layer], 0, SRC_IDS, after=self.ops.forward_event())
        return self.stager.complete(copy, timeout_s=5)[0].tolist()

    def stage_and_push(self, tid: str, group: int = 2, seed: int = 0, corrupt_sums: bool = False,
                       token: str = "") -> np.ndarray:
        data = self.fill(seed)
        self.src.create(tid, LAYERS, BLOCKS)
        pending: list[int] = []
        sums: list[int] = []
        for layer in range(LAYERS):
            sums += self.stage(tid, layer)
            pending.append(layer)
            if len(pending) == group or layer == LAYERS - 1:
                self.sender.submit(PushJob(tid, self.target, pending, 0, BLOCKS,
                                           [s ^ int(corrupt_sums) for s in sums], **({"token": token} if token else {})))
                pending, sums = [], []
        self.src.seal(tid)
        self.sender.submit(PushJob(tid, self.target, end=True))
        return data

    def close(self) -> None:
        self.sender.close()
        for s in (self.src_server, self.dst_server):
            s.close()
        self.src.close()
        self.dst.close()
        self.ops.close()


@pytest.fixture
def pair():
    p = Pair()
    yield p
    p.close()


def landed(p: Pair, tid: str) -> np.ndarray:
    """The consumer's side, as tiered/landed.py's LandedReader.load: wait for the sealed landing copy, read
    every layer out of the landing store, have the Loader copy it into the request's blocks of a
    cleared consumer KV cache; returns those blocks as [LAYERS, BLOCKS, SLOT]."""
    p.landing.entries.wait(tid, time.monotonic() + 5, time.monotonic() + 5)
    p.consumer_kv.rows[:] = 0
    rows = p.loader.landing_buffer(LAYERS * BLOCKS)
    try:
        p.dst.read_into(tid, list(range(LAYERS)), 0, rows)
        p.loader.load(rows, range(LAYERS), DST_IDS).wait(5)
    finally:
        p.loader.release_buffer(rows)
    others = np.ones(CACHE_BLOCKS, bool)
    others[DST_IDS] = False
    assert not p.consumer_kv.rows[:, others].any(), "the load wrote outside the request's blocks"
    return p.consumer_kv.rows[:, DST_IDS]


def test_pushed_layer_groups_land_byte_exact_and_the_producer_lets_go(pair) -> None:
    data = pair.stage_and_push("t1", group=1)
    assert np.array_equal(landed(pair, "t1"), data)
    assert pair.sender.flush(5) and pair.done == {"t1": None}
    assert pair.sender.pushes == LAYERS and pair.sender.bytes_pushed == data.nbytes
    assert pair.landing.entries.counters["landed"] == 1


def test_an_unsealed_landing_is_never_readable(pair) -> None:
    """Partial layer sets are never used: before PushEnd the entry exists but cannot be read."""
    pair.fill(2)
    pair.src.create("t2", LAYERS, BLOCKS)
    sums = pair.stage("t2", 0)
    pair.sender.submit(PushJob("t2", pair.target, [0], 0, BLOCKS, sums))
    assert pair.sender.flush(5)
    assert pair.dst.contains("t2") and not pair.dst.is_sealed("t2")
    with pytest.raises(TransferError) as exc:
        pair.landing.entries.wait("t2", time.monotonic() + 0.3, time.monotonic() + 0.3)
    assert exc.value.cause is FailureCause.TIMEOUT
    # PushEnd with layers 1..3 missing: refused as incomplete, the partial entry is dropped
    pair.src.release("t2")
    pair.sender.submit(PushJob("t2", pair.target, end=True))
    assert pair.sender.flush(5)
    with pytest.raises(TransferError) as exc:
        pair.landing.entries.wait("t2", time.monotonic() + 1, time.monotonic() + 1)
    assert exc.value.cause is FailureCause.PROTOCOL and "never written" in str(exc.value)
    assert not pair.dst.contains("t2")


def test_bad_checksum_is_refused_and_the_connection_keeps_serving(pair) -> None:
    pair.stage_and_push("bad", corrupt_sums=True)
    data = pair.stage_and_push("good", seed=3)
    assert pair.sender.flush(5)
    with pytest.raises(TransferError) as exc:
        pair.landing.entries.wait("bad", time.monotonic() + 2, time.monotonic() + 2)
    assert exc.value.cause is FailureCause.CHECKSUM_MISMATCH
    assert pair.done["bad"].cause is FailureCause.CHECKSUM_MISMATCH
    assert np.array_equal(landed(pair, "good"), data)
    assert not pair.dst.contains("bad")


def test_layout_mismatch_is_refused_before_any_byte_lands() -> None:
    p = Pair(landing_fp="other-layout")
    try:
        p.stage_and_push("t")
        assert p.sender.flush(5)
        assert p.done["t"].cause is FailureCause.LAYOUT_MISMATCH
        assert p.dst.usage()["entries"] == 0
        # refused in step: the producer keeps its staged copy, so the consumer can still pull it
        assert p.src.contains("t")
    finally:
        p.close()


def test_landing_store_full_fails_typed_and_keeps_nothing() -> None:
    p = Pair(landing_dram_slots=LAYERS * BLOCKS - 1)
    try:
        p.stage_and_push("big")
        assert p.sender.flush(5)
        assert p.done["big"].cause is FailureCause.STORE_FULL
        with pytest.raises(TransferError) as exc:
            p.landing.entries.wait("big", time.monotonic() + 1, time.monotonic() + 1)
        assert exc.value.cause is FailureCause.STORE_FULL
        assert p.dst.usage()["entries"] == 0
    finally:
        p.close()


def test_producer_disconnect_mid_stream_fails_the_landing_at_once() -> None:
    p = Pair(faults=FaultPlan.from_config([{"action": "truncate", "on": "push", "nth": 2}]))
    try:
        p.stage_and_push("t", group=1)
        assert p.sender.flush(5)
        assert p.done["t"].cause in (FailureCause.PEER_UNREACHABLE, FailureCause.TIMEOUT)
        t0 = time.monotonic()
        with pytest.raises(TransferError) as exc:
            p.landing.entries.wait("t", time.monotonic() + 10, time.monotonic() + 10)
        assert exc.value.cause is FailureCause.PEER_UNREACHABLE
        assert time.monotonic() - t0 < 2, "the landing side must not wait for its deadline"
        deadline = time.monotonic() + 5
        while p.dst.usage()["entries"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert p.dst.usage()["entries"] == 0, "the partial landing must be dropped"
    finally:
        p.close()


def test_corrupted_in_flight_push_is_caught() -> None:
    p = Pair(faults=FaultPlan.from_config([{"action": "corrupt", "on": "push", "nth": 1}]))
    try:
        p.stage_and_push("t")
        assert p.sender.flush(5)
        assert p.done["t"].cause is FailureCause.CHECKSUM_MISMATCH
    finally:
        p.close()


def test_abort_reaches_the_landing_side_with_its_cause(pair) -> None:
    pair.sender.submit(PushJob("gone", pair.target, abort=TransferError(FailureCause.STORE_FULL, "producer full")))
    assert pair.sender.flush(5)
    with pytest.raises(TransferError) as exc:
        pair.landing.entries.wait("gone", time.monotonic() + 1, time.monotonic() + 1)
    assert exc.value.cause is FailureCause.STORE_FULL and "producer full" in str(exc.value)
    assert "gone" not in pair.done  # the producer's own abort is not reported back as a push failure


def test_a_transfer_nobody_pushed_is_reported_after_the_grace(pair) -> None:
    t0 = time.monotonic()
    with pytest.raises(TransferError) as exc:
        pair.landing.entries.wait("never", time.monotonic() + 10, time.monotonic() + 0.2)
    assert exc.value.cause is FailureCause.UNKNOWN_TRANSFER and time.monotonic() - t0 < 2


def test_landed_entry_expires_when_its_consumer_never_comes() -> None:
    p = Pair(ttl=0.3)
    try:
        p.stage_and_push("t")
        assert p.sender.flush(5) and p.done["t"] is None
        time.sleep(0.5)
        assert p.dst.expire_now() == ["t"]
        with pytest.raises(TransferError) as exc:
            p.landing.entries.wait("t", time.monotonic() + 1, time.monotonic() + 1)
        assert exc.value.cause is FailureCause.LEASE_EXPIRED
    finally:
        p.close()


def test_a_server_without_landing_refuses_pushes_clearly() -> None:
    store = TieredStore(StoreConfig(slot_bytes=SLOT, dram_bytes=16 * SLOT))
    srv = StoreServer(store, "127.0.0.1", 0, fingerprint=FP, num_layers=LAYERS, compat=COMPAT)
    try:
        with StoreClient("127.0.0.1", srv.port, compat=COMPAT) as c:
            with pytest.raises(TransferError) as exc:
                c.push_end("x", time.monotonic() + 2)
            assert "does not accept pushes" in str(exc.value)
            assert c.status(time.monotonic() + 2).entries == 0  # and the connection still serves
    finally:
        srv.close()
        store.close()


@pytest.mark.parametrize("value, ok", [("127.0.0.1:7000", ("127.0.0.1", 7000)), ("[::1]:80", ("::1", 80)),
                                       ("host", None), ("h:0", None), ("h:x", None), (7, None)])
def test_parse_target(value, ok) -> None:
    if ok is None:
        with pytest.raises(ValueError, match="push_target"):
            parse_target(value)
    else:
        assert parse_target(value) == ok


@pytest.mark.skipif(nixl_import_error() is not None, reason=f"NIXL not importable: {nixl_import_error()}")
def test_nixl_push_lands_byte_exact() -> None:
    p = Pair(nixl=True)
    try:
        data = p.stage_and_push("n1")
        assert np.array_equal(landed(p, "n1"), data)
        assert p.sender.flush(5) and p.done == {"n1": None}
        status = store_status("127.0.0.1", p.dst_server.port)
        assert status.entries == 1
    finally:
        p.close()


def test_locate_reports_the_tiers_holding_an_entry(pair) -> None:
    token = "locate-token-0123456789abcdefghi"
    pair.stage_and_push("t", token=token)
    landed(pair, "t")
    with StoreClient("127.0.0.1", pair.dst_server.port, compat=COMPAT) as c:
        where = c.locate("t", time.monotonic() + 2, token=token)  # the ticket's token (issue 34)
        assert (where.found, where.dram_slots, where.nvme_slots) == (True, LAYERS * BLOCKS, 0)
        assert not c.locate("nope", time.monotonic() + 2).found


def test_pushing_slots_staged_on_nvme_goes_inline_from_disk(tmp_path) -> None:
    """A producer whose DRAM is short staged the entry straight to NVMe: the push reads it back
    from disk (not pinnable in the arena) and it still lands byte-exact."""
    p = Pair()
    try:
        p.use_store(TieredStore(StoreConfig(slot_bytes=SLOT, dram_bytes=4 * SLOT, nvme_dirs=[str(tmp_path)],
                                            nvme_bytes=64 * SLOT)))
        data = p.stage_and_push("disk")  # the Stager lands these rows in a bounce buffer, then on disk
        assert p.src.stats.bytes_written_nvme == (LAYERS * BLOCKS - 4) * SLOT
        assert np.array_equal(landed(p, "disk"), data)
        assert p.sender.flush(5) and p.done == {"disk": None}
    finally:
        p.close()


def test_the_last_group_can_seal_the_landing_copy_itself(pair) -> None:
    """No separate PushEnd round trip: the last Push carries seal=True."""
    data, sums = _stage_only(pair, "s", 5)
    pair.sender.submit(PushJob("s", pair.target, [0, 1], 0, BLOCKS, _sums(sums, [0, 1])))
    pair.sender.submit(PushJob("s", pair.target, [2, 3], 0, BLOCKS, _sums(sums, [2, 3]), end=True))
    assert np.array_equal(landed(pair, "s"), data)
    assert pair.sender.flush(5) and pair.done == {"s": None} and pair.sender.pushes == 2


def _stage_only(p: Pair, tid: str, seed: int) -> tuple[np.ndarray, dict[int, list[int]]]:
    """Every layer of a prompt staged by the Stager (not sealed, not pushed): its bytes and each
    layer's checksums."""
    data = p.fill(seed)
    p.src.create(tid, LAYERS, BLOCKS)
    return data, {layer: p.stage(tid, layer) for layer in range(LAYERS)}


def _sums(sums: dict[int, list[int]], layers: list[int]) -> list[int]:
    return [s for layer in layers for s in sums[layer]]


def test_a_broken_connection_loses_only_the_transfer_whose_bytes_broke() -> None:
    """A and B interleave on one connection; A's second push breaks it. B was open on it too, so
    the landing side fails B, but B's next push is refused in step: B's producer copy is kept
    (the consumer pulls it), only A counts as lost on the wire."""
    p = Pair(faults=FaultPlan.from_config([{"action": "truncate", "on": "push", "nth": 3}]))
    try:
        (_, a), (_, b) = _stage_only(p, "A", 1), _stage_only(p, "B", 2)
        p.sender.submit(PushJob("A", p.target, [0, 1], 0, BLOCKS, _sums(a, [0, 1])))
        p.sender.submit(PushJob("B", p.target, [0, 1], 0, BLOCKS, _sums(b, [0, 1])))
        p.sender.submit(PushJob("A", p.target, [2, 3], 0, BLOCKS, _sums(a, [2, 3]), end=True))  # 3rd: breaks
        p.sender.submit(PushJob("B", p.target, [2, 3], 0, BLOCKS, _sums(b, [2, 3]), end=True))
        assert p.sender.flush(5)
        assert not getattr(p.done["A"], "refused", False), p.done
        assert p.done["B"] is not None and p.done["B"].refused, p.done
        assert p.dst.usage()["entries"] == 0
    finally:
        p.close()


def test_an_abort_after_a_local_failure_still_reaches_the_landing_side(pair) -> None:
    _, sums = _stage_only(pair, "gone", 3)
    pair.sender.submit(PushJob("gone", pair.target, [0, 1], 0, BLOCKS, _sums(sums, [0, 1])))
    assert pair.sender.flush(5)
    pair.src.release("gone")  # e.g. the request was aborted: the next group cannot be read
    pair.sender.submit(PushJob("gone", pair.target, [2, 3], 0, BLOCKS, _sums(sums, [2, 3])))
    pair.sender.submit(PushJob("gone", pair.target, abort=TransferError(FailureCause.UNKNOWN_TRANSFER, "aborted")))
    assert pair.sender.flush(5)
    with pytest.raises(TransferError) as exc:
        pair.landing.entries.wait("gone", time.monotonic() + 1, time.monotonic() + 1)
    assert "aborted" in str(exc.value)
    assert not pair.dst.contains("gone")


def test_a_target_that_cannot_be_reached_keeps_the_producer_copy(pair) -> None:
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = ("127.0.0.1", s.getsockname()[1])
    _, sums = _stage_only(pair, "x", 4)
    pair.sender.submit(PushJob("x", dead, [0, 1, 2, 3], 0, BLOCKS, _sums(sums, [0, 1, 2, 3]), end=True))
    assert pair.sender.flush(10)
    assert pair.done["x"].cause is FailureCause.PEER_UNREACHABLE and pair.done["x"].refused


def test_a_consumer_that_gave_up_refuses_what_still_comes(pair) -> None:
    """After abandon() (the consumer pulls instead), a late push is refused in step and nothing lands."""
    pair.landing.entries.abandon("late", TransferError(FailureCause.TIMEOUT, "waited long enough"))
    pair.stage_and_push("late")
    assert pair.sender.flush(5)
    assert pair.done["late"].refused and pair.dst.usage()["entries"] == 0
    assert pair.src.contains("late"), "the producer must keep its copy for the consumer's pull"


def test_a_stalled_nixl_producer_holds_the_landing_side_for_a_bounded_time() -> None:
    """The landing side READs nixl pushes through one bounce buffer: a producer that stops answering
    must not hold it for a minute. Each READ's deadline follows its size (a floor of a few seconds),
    and the READ that runs out fails that transfer alone."""
    from kvconnectors.transport.paths import nixl as landing_mod  # the nixl landing path's READ bounds
    from kvconnectors.transport.landed_entries import ConnectionState

    deadlines: list[float] = []

    class StalledSink:  # the producer never completes the READ: wait out the deadline, as NixlSink does
        def register_regions(self, regions) -> None:
            pass

        def read(self, key, meta, remote, local, length, deadline) -> int:
            deadlines.append(deadline - time.monotonic())
            raise TransferError(FailureCause.TIMEOUT, f"NIXL READ of {len(local)} blocks: deadline passed")

        def close(self) -> None:
            pass

    store = TieredStore(StoreConfig(slot_bytes=SLOT, dram_bytes=64 * SLOT, lease_ttl_s=30))
    landing = Landing(store, fingerprint=FP, num_layers=LAYERS, paths=[TCP_PUSH, NixlPush(sink_factory=StalledSink)])
    try:
        msg = wire.Push(transfer_id="stalled", num_layers=LAYERS, total_blocks=BLOCKS, fingerprint=FP, layers=[0, 1],
                        first_block=0, num_blocks=BLOCKS, data_path="nixl", offsets=list(range(2 * BLOCKS)),
                        nixl_agent_meta=b"meta", nixl_base_address=1 << 20)
        conn = ConnectionState("producer")
        landing.entries.claim(msg, conn)
        with pytest.raises(TransferError) as exc:
            with landing.receiver.paths["nixl"].receive(None, msg, landing.receiver.row_bytes(msg), conn.bounce):
                pass
        assert exc.value.cause is FailureCause.TIMEOUT
        (left,) = deadlines
        assert landing_mod.NIXL_READ_FLOOR_S - 1 < left <= landing_mod.NIXL_READ_FLOOR_S + 0.01  # 48 KiB: the floor
        big = 30 * landing_mod.NIXL_READ_MIN_BYTES_PER_S
        assert landing_mod.read_deadline(int(big)) - time.monotonic() == pytest.approx(
            landing_mod.NIXL_READ_FLOOR_S + 30, abs=1)
        assert landing_mod.read_deadline(1 << 40) - time.monotonic() <= 60
    finally:
        landing.close()
        store.close()


def test_a_group_larger_than_one_push_goes_as_several_block_ranges(pair) -> None:
    """Each Push carries at most max_push_bytes (the landing side lends every Push a buffer from a
    capped pool): a larger layer group is split by blocks, checksums sliced to match, and the last
    part seals; it lands byte-exact and counts as one group pushed."""
    pair.sender.max_push_bytes = 2 * 2 * SLOT  # 2 layers x 2 blocks: 3 parts per group of 6 blocks
    data, sums = _stage_only(pair, "split", 7)
    pair.sender.submit(PushJob("split", pair.target, [0, 1], 0, BLOCKS, _sums(sums, [0, 1])))
    pair.sender.submit(PushJob("split", pair.target, [2, 3], 0, BLOCKS, _sums(sums, [2, 3]), end=True))
    assert np.array_equal(landed(pair, "split"), data)
    assert pair.sender.flush(5) and pair.done == {"split": None}
    assert pair.sender.pushes == 2 and pair.sender.bytes_pushed == data.nbytes
    assert pair.landing.entries.counters["pushes"] == 6
    # a wrong checksum in a later part fails the transfer there, typed
    _, sums = _stage_only(pair, "split2", 8)
    bad = _sums(sums, [0, 1])
    bad[BLOCKS - 1] ^= 1  # layer 0, last block: the third part
    pair.sender.submit(PushJob("split2", pair.target, [0, 1], 0, BLOCKS, bad))
    assert pair.sender.flush(5)
    assert pair.done["split2"].cause is FailureCause.CHECKSUM_MISMATCH and pair.done["split2"].refused
    assert not pair.dst.contains("split2")


def test_a_request_dropped_while_its_push_is_landing_frees_the_landing_copy(pair) -> None:
    """The decode drops a request whose push is still landing (forget, then release, as the worker's
    drop does): the partial landing copy goes now (only the landing side may end it while it is
    landing), and the producer's next group is refused in step, so it keeps its copy."""
    _, sums = _stage_only(pair, "dropped", 9)
    pair.sender.submit(PushJob("dropped", pair.target, [0, 1], 0, BLOCKS, _sums(sums, [0, 1])))
    assert pair.sender.flush(5) and pair.dst.contains("dropped")
    pair.landing.entries.forget("dropped")
    try:
        pair.dst.release("dropped")
    except TransferError:
        pass
    assert not pair.dst.contains("dropped") and pair.dst.usage()["entries"] == 0
    pair.sender.submit(PushJob("dropped", pair.target, [2, 3], 0, BLOCKS, _sums(sums, [2, 3]), end=True))
    assert pair.sender.flush(5)
    assert pair.done["dropped"].refused and pair.src.contains("dropped")


def test_pushes_carry_the_tickets_token_and_the_landed_copy_answers_only_to_it(pair) -> None:
    token = "push-token-0123456789abcdefghij"
    data = pair.stage_and_push("tok", token=token)
    assert np.array_equal(landed(pair, "tok"), data)
    with StoreClient("127.0.0.1", pair.dst_server.port, compat=COMPAT, connect_timeout_s=2) as c:
        assert not c.locate("tok", time.monotonic() + 5).found
        assert not c.locate("tok", time.monotonic() + 5, token="another-token-0123456789abcdefg").found
        assert c.locate("tok", time.monotonic() + 5, token=token).found
