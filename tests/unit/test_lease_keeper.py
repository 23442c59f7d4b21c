"""The consumer's lease keeper against real store servers (two tensor-parallel ranks)."""

from __future__ import annotations

import socket
import time

import numpy as np

from kvconnectors.store import StoreConfig, TieredStore
from kvconnectors.tiered.lease_keeper import LeaseKeeper
from kvconnectors.transport import wire
from kvconnectors.transport.client import StoreClient
from kvconnectors.transport.server import StoreServer

SLOT = 4096
COMPAT = wire.compat_hash("tiered")


def _rank(ttl: float):
    store = TieredStore(StoreConfig(slot_bytes=SLOT, dram_bytes=16 * SLOT, lease_ttl_s=ttl))
    store.create("t", 1, 2)
    store.write("t", 0, 0, np.zeros((2, SLOT), np.uint8))
    store.seal("t")
    return store, StoreServer(store, "127.0.0.1", 0, fingerprint="f", num_layers=1, compat=COMPAT)


def _client(addr):
    return StoreClient(addr[0], addr[1], compat=COMPAT)


def test_keeper_renews_every_rank_and_releases_them_on_abort() -> None:
    ranks = [_rank(ttl=1.0) for _ in range(2)]
    addrs = [("127.0.0.1", srv.port) for _, srv in ranks]
    keeper = LeaseKeeper(0.3, _client)
    try:
        keeper.track("req-1", addrs, "t")
        time.sleep(2.0)  # twice the TTL: only renewals keep the entries alive
        assert all(store.contains("t") for store, _ in ranks), "a rank's lease lapsed while tracked"
        assert keeper.renewals >= 2 * 4
        keeper.release("req-1", addrs, "t")
        deadline = time.monotonic() + 5
        while any(store.contains("t") for store, _ in ranks) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(store.contains("t") for store, _ in ranks), "abort did not release every rank"
        assert keeper.releases == 2
    finally:
        keeper.close()
        for store, srv in ranks:
            srv.close()
            store.close()


def test_keeper_survives_a_dead_peer_and_keeps_renewing_the_live_one() -> None:
    store, srv = _rank(ttl=1.0)
    keeper = LeaseKeeper(0.3, _client, rpc_timeout_s=0.5)
    try:
        keeper.track("dead", [("127.0.0.1", 9)], "x")   # nothing listens on port 9
        keeper.track("live", [("127.0.0.1", srv.port)], "t")
        time.sleep(2.0)
        assert store.contains("t")
        assert keeper._thread.is_alive()
    finally:
        keeper.close()
        srv.close()
        store.close()


def test_a_hung_peer_does_not_hold_back_the_renewals_of_the_others() -> None:
    """A producer that accepts the connection and never answers (its call ends only at the 3 s
    deadline) must not delay the renewal of a live producer's 1 s lease, in any order."""
    hung = socket.create_server(("127.0.0.1", 0))  # the kernel completes connects; nobody answers
    store, srv = _rank(ttl=1.0)
    keeper = LeaseKeeper(0.3, _client, rpc_timeout_s=3.0)
    try:
        keeper.track("hung", [("127.0.0.1", hung.getsockname()[1])], "x")
        keeper.track("live", [("127.0.0.1", srv.port)], "t")
        time.sleep(2.5)
        assert store.contains("t"), "the live producer's lease lapsed while a hung one was called"
        assert keeper.renewals >= 4
    finally:
        keeper.close()
        hung.close()
        srv.close()
        store.close()


def test_maybe_addresses_are_renewed_and_their_absence_is_not_a_lost_lease() -> None:
    """A pushed request: its landed copy (here) and the producer's copy (there, already let go)."""
    held, held_srv = _rank(ttl=1.0)
    gone, gone_srv = _rank(ttl=1.0)
    gone.release("t")
    keeper = LeaseKeeper(0.3, _client)
    try:
        keeper.track("pushed", [], "t", maybe_addrs=[("127.0.0.1", held_srv.port), ("127.0.0.1", gone_srv.port)])
        time.sleep(2.0)
        assert held.contains("t"), "the held copy's lease lapsed while tracked"
        assert keeper.renewals >= 4 and keeper.lost == 0
        keeper.track("pulled", [("127.0.0.1", gone_srv.port)], "t")  # a required copy that is gone is lost
        deadline = time.monotonic() + 5
        while keeper.lost == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert keeper.lost >= 1
    finally:
        keeper.close()
        for store, srv in ((held, held_srv), (gone, gone_srv)):
            srv.close()
            store.close()


def test_head_fragments_of_a_pushed_request_are_renewed_where_they_landed() -> None:
    """Decode TP < prefill TP: the producer ranks' fragments land under their own ids beside the
    transfer's; they outlive a wait longer than their TTL, and one that is not there is not lost."""
    store, srv = _rank(ttl=1.0)
    store.create("t/from-rank1", 1, 2)
    store.write("t/from-rank1", 0, 0, np.zeros((2, SLOT), np.uint8))
    store.seal("t/from-rank1")
    keeper = LeaseKeeper(0.3, _client)
    try:
        keeper.track("pushed", [], "x", maybe_addrs=[("127.0.0.1", srv.port)],
                     maybe_ids=["t/from-rank0", "t/from-rank1"])
        time.sleep(2.0)
        assert store.contains("t/from-rank1"), "a landed fragment's lease lapsed while tracked"
        assert keeper.lost == 0
    finally:
        keeper.close()
        srv.close()
        store.close()
