"""ClientPool: pulls keep their connection for the next pull to the same producer, and only a
good one (transport/client_pool.py), against a real StoreServer on 127.0.0.1.

Seen to fail: with `_give_back` keeping a connection whatever happened on it (the except branch of
`client` made to fall through), test_a_connection_that_saw_an_error_is_not_kept fails; with
`_still_open` always True, test_a_connection_the_producer_closed_is_not_used fails (the read
meets a closed connection: peer_unreachable); with `_close_expired` a no-op,
test_an_idle_connection_past_max_idle_s_is_not_used and
test_idle_connections_to_a_producer_not_asked_again_are_closed_when_they_expire fail.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvconnectors.errors import FailureCause, TransferError
from kvconnectors.store import StoreConfig, TieredStore
from kvconnectors.transport.client import StoreClient
from kvconnectors.transport.client_pool import MAX_IDLE_PER_PEER, ClientPool
from kvconnectors.transport.paths import SHM_PULL
from kvconnectors.transport.server import StoreServer

from tests.unit.test_transport import BLOCKS, COMPAT, FP, LAYERS, SLOT, dest_views, stage


@pytest.fixture
def server():
    shm = f"kvc_pool_{time.monotonic_ns() % 10**9}"
    store = TieredStore(StoreConfig(slot_bytes=SLOT, dram_bytes=64 * SLOT, shm_name=shm, lease_ttl_s=30))
    srv = StoreServer(store, "127.0.0.1", 0, fingerprint=FP, num_layers=LAYERS, compat=COMPAT)
    yield srv
    srv.close()
    store.close()


@pytest.fixture
def pool():
    made: list[StoreClient] = []

    def connect(host: str, port: int) -> StoreClient:
        made.append(StoreClient(host, port, compat=COMPAT))
        return made[-1]
    p = ClientPool(connect)
    p.made = made
    yield p
    p.close()


def _pull(pool: ClientPool, server: StoreServer, tid: str, seed: int = 0) -> StoreClient:
    data = stage(server.store, tid, seed)
    cache, dest = dest_views(BLOCKS)
    with pool.client("127.0.0.1", server.port) as c:
        c.read(tid, range(LAYERS), 0, dest, fingerprint=FP, deadline=time.monotonic() + 5, path=SHM_PULL)
    for layer in range(LAYERS):
        assert np.array_equal(cache[layer, [9, 2, 14, 5, 11]], data[layer])
    return c


def _server_connections(server: StoreServer, want: int) -> int:
    deadline = time.monotonic() + 5
    while server.active_connections != want and time.monotonic() < deadline:
        time.sleep(0.01)
    return server.active_connections


def test_pulls_to_one_producer_reuse_one_connection(pool, server):
    first = _pull(pool, server, "t1")
    for i in range(2, 6):
        assert _pull(pool, server, f"t{i}", seed=i) is first
    assert len(pool.made) == 1 and pool.idle() == 1
    assert _server_connections(server, 1) == 1
    assert server.store.usage()["dram"]["used_bytes"] == 0  # every pull released its entry
    pool.close()
    assert _server_connections(server, 0) == 0


def test_a_connection_that_saw_an_error_is_not_kept(pool, server):
    stage(server.store, "t1")
    _, dest = dest_views(BLOCKS)
    with pytest.raises(TransferError) as exc:
        with pool.client("127.0.0.1", server.port) as c:
            c.read("t1", range(LAYERS), 0, dest, fingerprint="another-model", deadline=time.monotonic() + 5,
                   path=SHM_PULL)
    assert exc.value.cause is FailureCause.LAYOUT_MISMATCH
    assert pool.idle() == 0 and c.sock.fileno() == -1  # closed, not kept
    assert _pull(pool, server, "t2") is not c and len(pool.made) == 2


def test_a_connection_the_producer_closed_is_not_used(pool):
    """The producer hangs up on an idle connection (its idle timeout, here 0.3 s; or it restarted):
    the next pull gets a new connection instead of a read on a closed one."""
    shm = f"kvc_pool_idle_{time.monotonic_ns() % 10**9}"
    store = TieredStore(StoreConfig(slot_bytes=SLOT, dram_bytes=64 * SLOT, shm_name=shm, lease_ttl_s=30))
    srv = StoreServer(store, "127.0.0.1", 0, fingerprint=FP, num_layers=LAYERS, compat=COMPAT, idle_timeout_s=0.3)
    try:
        first = _pull(pool, srv, "t1")
        assert _server_connections(srv, 0) == 0  # the producer timed it out; the pool still holds it
        assert pool.idle() == 1
        assert _pull(pool, srv, "t2") is not first and first.sock.fileno() == -1
    finally:
        srv.close()
        store.close()


def test_at_most_max_idle_per_peer_are_kept(pool, server):
    held = [pool.client("127.0.0.1", server.port) for _ in range(MAX_IDLE_PER_PEER + 2)]
    clients = [h.__enter__() for h in held]
    assert len({id(c) for c in clients}) == MAX_IDLE_PER_PEER + 2
    for h in held:
        h.__exit__(None, None, None)
    assert pool.idle() == MAX_IDLE_PER_PEER
    assert sum(c.sock.fileno() == -1 for c in clients) == 2  # the rest were closed
    assert _server_connections(server, MAX_IDLE_PER_PEER) == MAX_IDLE_PER_PEER


def test_an_idle_connection_past_max_idle_s_is_not_used(server):
    made: list[StoreClient] = []
    pool = ClientPool(lambda h, p: made.append(StoreClient(h, p, compat=COMPAT)) or made[-1], max_idle_s=0.2)
    try:
        first = _pull(pool, server, "t1")
        time.sleep(0.3)
        assert _pull(pool, server, "t2") is not first and first.sock.fileno() == -1
    finally:
        pool.close()


def test_idle_connections_to_a_producer_not_asked_again_are_closed_when_they_expire(server):
    """A producer whose address is never pulled from again (it moved, or went away) does not keep
    sockets in the pool: any later use of the pool closes connections past max_idle_s."""
    shm = f"kvc_pool_other_{time.monotonic_ns() % 10**9}"
    store = TieredStore(StoreConfig(slot_bytes=SLOT, dram_bytes=64 * SLOT, shm_name=shm, lease_ttl_s=30))
    other = StoreServer(store, "127.0.0.1", 0, fingerprint=FP, num_layers=LAYERS, compat=COMPAT)
    made: list[StoreClient] = []
    pool = ClientPool(lambda h, p: made.append(StoreClient(h, p, compat=COMPAT)) or made[-1], max_idle_s=0.2)
    try:
        gone = _pull(pool, other, "t1")
        time.sleep(0.3)
        _pull(pool, server, "t2")  # another producer
        assert gone.sock.fileno() == -1 and pool.idle() == 1
        assert _server_connections(other, 0) == 0
    finally:
        pool.close()
        other.close()
        store.close()


def test_a_client_closed_in_the_block_is_not_kept(pool, server):
    with pool.client("127.0.0.1", server.port) as c:
        c.close()  # what the worker does when a release after a good pull failed
    assert pool.idle() == 0


def test_close_closes_idle_connections_and_keeps_nothing_after(pool, server):
    c = _pull(pool, server, "t1")
    pool.close()
    assert c.sock.fileno() == -1 and pool.idle() == 0
    late = _pull(pool, server, "t2")  # a pull still running at shutdown: closed when its block ends
    assert pool.idle() == 0 and late.sock.fileno() == -1
