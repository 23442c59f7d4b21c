"""Issue 16, finding 7 (the landing part): a second Push with a different total_blocks raised
IndexError and a ValueError in landing.py escaped too; each killed the connection's thread with no
reply. Every such path now answers a typed refusal in step and the connection keeps serving."""

from __future__ import annotations

import time

import pytest

from kvconnectors.errors import FailureCause, TransferError
from kvconnectors.store import StoreConfig, TieredStore
from kvconnectors.transport.client import StoreClient
from kvconnectors.transport.landing import Landing
from kvconnectors.transport.paths import TCP_PUSH, NixlPush
from kvconnectors.transport.server import StoreServer

from landing_kit import COMPAT, FP, LAYERS, RPC_S, LandingServer, push, push_msg, refused, still_serves


@pytest.fixture
def srv():
    s = LandingServer()
    yield s
    s.close()


def test_a_second_push_with_another_geometry_is_refused_typed(srv) -> None:
    c = srv.client()
    push(c, "g", [0], 0, 4, 4)
    exc = refused(push, c, "g", [1], 4, 4, 8)  # total_blocks 8 now: blocks 4..7 do not exist here
    assert exc.cause is FailureCause.PROTOCOL and "total_blocks" in str(exc)
    still_serves(c)
    # the owner's inconsistent stream failed its own transfer, nobody else's
    push(c, "h", [0], 0, 4, 4)
    with pytest.raises(TransferError) as failed:
        srv.landing.entries.wait("g", time.monotonic() + 1, time.monotonic() + 1)
    assert failed.value.cause is FailureCause.PROTOCOL
    assert srv.store.contains("h")


def test_pushes_after_the_owners_seal_are_refused_typed(srv) -> None:
    c = srv.client()
    push(c, "s", [0], 0, 4, 4)
    push(c, "s", [1], 0, 4, 4, seal=True)
    refused(push, c, "s", [1], 0, 4, 4)  # store.write on a sealed entry raised ValueError
    refused(c.push_end, "s", time.monotonic() + RPC_S)  # store.seal of a sealed entry: ValueError
    still_serves(c)
    assert srv.store.is_sealed("s")


class _NoSink:
    def register_regions(self, regions) -> None:
        pass

    def read(self, *args) -> int:
        raise AssertionError("never READ: the push must be refused first")

    def close(self) -> None:
        pass


def test_a_nixl_push_with_negative_offsets_is_refused_typed() -> None:
    """numpy refuses negative uint64 offsets (OverflowError) deep in the data path: refuse first."""
    store = TieredStore(StoreConfig(slot_bytes=4096, dram_bytes=64 * 4096))
    landing = Landing(store, fingerprint=FP, num_layers=LAYERS, paths=[TCP_PUSH, NixlPush(sink_factory=_NoSink)])
    server = StoreServer(store, "127.0.0.1", 0, fingerprint=FP, num_layers=LAYERS, compat=COMPAT, landing=landing)
    try:
        with StoreClient("127.0.0.1", server.port, compat=COMPAT, connect_timeout_s=RPC_S) as c:
            msg = push_msg("n", [0], 0, 2, 2, None, data_path="nixl", nbytes=0, offsets=[-4096, 0],
                           nixl_agent_meta=b"meta", nixl_base_address=1 << 20)
            exc = refused(c.push, msg, (), time.monotonic() + RPC_S)
            assert exc.cause is FailureCause.PROTOCOL
            still_serves(c)
    finally:
        server.close()
        store.close()


def test_an_unexpected_error_while_landing_is_answered_and_the_server_goes_on(srv, monkeypatch) -> None:
    """Whatever a bug raises while landing, the peer gets a typed answer (or a clean close), the
    transfer fails, and the server serves the next connection."""
    c = srv.client()

    def boom(*args, **kw):
        raise RuntimeError("a bug")

    monkeypatch.setattr(srv.store, "begin_write", boom)  # every landing path writes through it
    exc = refused(push, c, "b", [0], 0, 2, 2)
    assert exc.cause is FailureCause.PROTOCOL
    monkeypatch.undo()
    with pytest.raises(TransferError):
        srv.landing.entries.wait("b", time.monotonic() + 1, time.monotonic() + 1)
    still_serves(c)
    still_serves(srv.client())
    assert srv.used_slots() == 0
