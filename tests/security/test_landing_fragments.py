"""Head fragments on the landing side (issue 20, decode TP < prefill TP): a Push with `heads`
carries rows of only those of the receiving rank's KV heads, under the fragment's own id. It must
present the fingerprint of such rows, come inline, and its rows land in the first bytes of whole
slots (DRAM and NVMe); anything else is refused typed, and the server keeps serving."""

from __future__ import annotations

import time

import numpy as np
import pytest
import xxhash

from kvconnectors.errors import FailureCause
from kvconnectors.store import StoreConfig, TieredStore
from kvconnectors.transport import wire
from kvconnectors.transport.landing import Landing
from kvconnectors.transport.server import StoreServer

from landing_kit import COMPAT, FP, LAYERS, RPC_S, SLOT, LandingServer, push_all, refused, still_serves

FRAGMENT_FP = "fp-one-head-rows"
SECRET = b"landing-fragments-s3cret"
HEADS = 4                 # this rank's KV heads; a fragment of k heads has rows of k / HEADS of a slot


def fragment_rows(start: int, stop: int) -> tuple[str, int]:
    if not 0 <= start < stop <= HEADS or stop - start == HEADS:
        raise ValueError(f"not a part of this rank's {HEADS} KV heads")
    return f"{FRAGMENT_FP}-{stop - start}", SLOT // HEADS * (stop - start)


@pytest.fixture
def srv():
    s = LandingServer(fragment_rows=fragment_rows, secret=SECRET)  # authenticated: refusals say why
    yield s
    s.close()


def fragment(c, tid: str, layer: int, n: int, heads: list[int], *, seed: int = 0, seal: bool = False,
             flip: bool = False, **over) -> np.ndarray:
    """Push one layer's n fragment rows of `heads` (TransferError if refused); returns the rows."""
    row = SLOT // HEADS * (heads[1] - heads[0])
    data = np.random.default_rng(seed).integers(0, 256, (n, row), dtype=np.uint8)
    sums = [xxhash.xxh3_64_intdigest(r) for r in data]
    if flip:
        data[-1, -1] ^= 0xFF  # after the checksums: the landing side must notice
    fields = dict(transfer_id=tid, num_layers=LAYERS, total_blocks=n,
                  fingerprint=f"{FRAGMENT_FP}-{heads[1] - heads[0]}",
                  layers=[layer], first_block=0, num_blocks=n, checksums=sums, nbytes=data.nbytes, heads=heads,
                  seal=seal)
    fields.update(over)
    c.push(wire.Push(**fields), [memoryview(data.reshape(-1))], time.monotonic() + RPC_S)
    return data


def landed_prefix(store: TieredStore, tid: str, n: int, row: int) -> np.ndarray:
    out = np.empty((LAYERS * n, SLOT), np.uint8)
    store.read_into(tid, list(range(LAYERS)), 0, out)
    return out[:, :row]


def test_a_fragment_lands_its_short_rows_in_whole_slots_and_is_sealed(srv) -> None:
    c = srv.client()
    push_all(c, "old", 3, seed=99)  # whole rows of another transfer, then its slots are free again
    srv.store.release("old")
    sent = [fragment(c, "t/from-rank1", layer, 3, [1, 3], seed=layer, seal=layer == LAYERS - 1)
            for layer in range(LAYERS)]
    srv.landing.entries.wait("t/from-rank1", time.monotonic() + RPC_S, time.monotonic() + RPC_S)
    assert np.array_equal(landed_prefix(srv.store, "t/from-rank1", 3, SLOT // 2), np.concatenate(sent))
    tails = landed_prefix(srv.store, "t/from-rank1", 3, SLOT)[:, SLOT // 2:]
    assert not tails.any(), "a fragment's slot tails keep another transfer's bytes"
    assert srv.landing.entries.heads_of("t/from-rank1") == (1, 3)
    assert srv.landing.entries.landed_bytes("t/from-rank1") == {"push_tcp": LAYERS * 3 * SLOT // 2}
    assert srv.landing.entries.counters["push_bytes"] == LAYERS * 3 * SLOT + LAYERS * 3 * SLOT // 2  # "old", then this


def test_fragment_rows_bound_for_nvme_land_there_too(tmp_path) -> None:
    """DRAM for 2 slots: most rows go through the lent buffer to the disk tier."""
    store = TieredStore(StoreConfig(slot_bytes=SLOT, dram_bytes=2 * SLOT, lease_ttl_s=30,
                                    nvme_dirs=[str(tmp_path)], nvme_bytes=64 * SLOT))
    landing = Landing(store, fingerprint=FP, num_layers=LAYERS, fragment_rows=fragment_rows)
    server = StoreServer(store, "127.0.0.1", 0, fingerprint=FP, num_layers=LAYERS, compat=COMPAT, landing=landing)
    from kvconnectors.transport.client import StoreClient

    c = StoreClient("127.0.0.1", server.port, compat=COMPAT, connect_timeout_s=RPC_S)
    try:
        sent = [fragment(c, "d/from-rank0", layer, 5, [0, 1], seed=10 + layer, seal=layer == LAYERS - 1)
                for layer in range(LAYERS)]
        landing.entries.wait("d/from-rank0", time.monotonic() + RPC_S, time.monotonic() + RPC_S)
        assert store.usage()["nvme"]["used_bytes"] > 0
        assert np.array_equal(landed_prefix(store, "d/from-rank0", 5, SLOT // 4), np.concatenate(sent))
        assert not landed_prefix(store, "d/from-rank0", 5, SLOT)[:, SLOT // 4:].any()
    finally:
        c.close()
        server.close()
        store.close()


def header(tid: str, **over) -> wire.Push:
    """A one-head fragment header of 2 blocks of layer 0; `over` replaces any field."""
    fields = dict(transfer_id=tid, num_layers=LAYERS, total_blocks=2, fingerprint=f"{FRAGMENT_FP}-1", layers=[0],
                  first_block=0, num_blocks=2, heads=[0, 1], nbytes=2 * SLOT // HEADS)
    fields.update(over)
    return wire.Push(**fields)


@pytest.mark.parametrize("over, cause, said", [
    (dict(fingerprint=FP), FailureCause.LAYOUT_MISMATCH, "producer KV layout"),   # whole rows' fingerprint
    (dict(heads=[0, 4], fingerprint=f"{FRAGMENT_FP}-4"), FailureCause.LAYOUT_MISMATCH,
     "not a part of this rank's 4 KV heads"),
    (dict(heads=[2, 1]), FailureCause.LAYOUT_MISMATCH, "push heads [2, 1]"),
    (dict(heads=[0, 1, 2]), FailureCause.PROTOCOL, "need [start, stop)"),
    (dict(nbytes=2 * SLOT), FailureCause.LAYOUT_MISMATCH, "push of 8192 bytes for 2 blocks of 1024 B"),
    (dict(data_path="nixl"), FailureCause.PROTOCOL, "inline only"),
], ids=["whole-rows-fingerprint", "all-heads", "reversed", "three-numbers", "slot-sized-bytes", "nixl"])
def test_a_malformed_fragment_is_refused_typed_naming_what_is_wrong(srv, over, cause, said) -> None:
    """A header the landing side cannot take is answered, and its connection then closed (its byte
    count cannot be trusted); nothing is created and the server serves the next connection."""
    from landing_kit import refused_header

    reply = refused_header(srv, header("m/from-rank0", **over))
    assert reply.cause == cause.value and said in reply.message, reply
    assert not srv.store.contains("m/from-rank0")
    still_serves(srv.client())


def test_a_fragment_whose_pushes_name_other_heads_is_refused(srv) -> None:
    c = srv.client()
    fragment(c, "h/from-rank0", 0, 2, [0, 2])
    exc = refused(fragment, c, "h/from-rank0", 1, 2, [2, 4], seal=True)
    assert exc.cause is FailureCause.PROTOCOL and "changed heads" in str(exc), exc
    assert not srv.store.contains("h/from-rank0")


def test_an_unauthenticated_producer_is_not_told_why_a_fragment_does_not_fit() -> None:
    """Without a secret no producer is authenticated: the refusal must not say this rank's heads."""
    from landing_kit import refused_header

    s = LandingServer(fragment_rows=fragment_rows)
    try:
        reply = refused_header(s, header("u/from-rank0", heads=[0, 4], fingerprint=f"{FRAGMENT_FP}-4"))
        assert reply.cause == FailureCause.LAYOUT_MISMATCH.value, reply
        assert "KV heads" not in reply.message and "not shown to an unauthenticated peer" in reply.message, reply
    finally:
        s.close()


def test_a_corrupted_fragment_row_fails_its_checksum_and_nothing_of_it_stays(srv) -> None:
    c = srv.client()
    exc = refused(fragment, c, "x/from-rank0", 0, 3, [0, 2], flip=True)
    assert exc.cause is FailureCause.CHECKSUM_MISMATCH and "layer 0 block 2" in str(exc), exc
    still_serves(c)
    assert not srv.store.contains("x/from-rank0") and srv.used_slots() == 0


def test_a_landing_store_that_takes_no_fragments_refuses_them() -> None:
    from landing_kit import refused_header

    s = LandingServer(secret=SECRET)
    try:
        reply = refused_header(s, header("n/from-rank0"))
        assert reply.cause == FailureCause.LAYOUT_MISMATCH.value and "takes no head fragments" in reply.message, reply
        still_serves(s.client())
    finally:
        s.close()
