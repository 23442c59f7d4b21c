"""Issue 34, row 8: what unauthenticated peers were told, and inline_heads under aead.

- A landing store answered an unauthenticated pusher's refusals with its layer count, its slot
  size and its occupancy ("this consumer has 2 layers", "DRAM 0B free, 3 entries"). Now a peer
  that has not proved the shared secret gets the cause and a generic line (the details go to this
  side's log); a peer that proved it still gets them (the positive control).
- `inline_heads` (a producer sending only some KV heads of each row) streams on the connection
  itself, yet aead refused it with a message blaming NIXL. Now it is served sealed.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvconnectors.errors import FailureCause
from kvconnectors.transport import wire
from kvconnectors.transport.client import StoreClient

from landing_kit import LAYERS, RPC_S, SLOT, LandingServer, push, refused
from sec_helpers import COMPAT, FP, SECRET, stage

DETAILS = ("has 2", "layers, this", "free", "entries", str(SLOT), "slot")


def _refusals(srv: LandingServer) -> list[str]:
    """The messages of two refusals a pusher provokes: a layout that differs, and a store too full."""
    c = srv.client()
    layout = refused(push, c, "wrong-layers", [0], 0, 2, 2, num_layers=LAYERS + 1)
    assert layout.cause is FailureCause.LAYOUT_MISMATCH, layout
    push(srv.client(), "fill", [0], 0, 4, 4, seed=1)  # half the 8-slot store; a 4-block transfer needs all 8
    full = refused(push, srv.client(), "too-much", [0], 0, 4, 4, seed=9)
    assert full.cause is FailureCause.STORE_FULL, full
    return [layout.detail, full.detail]


def test_an_unauthenticated_pusher_is_told_the_cause_and_nothing_of_the_store() -> None:
    srv = LandingServer(dram_slots=8)
    try:
        for message in _refusals(srv):
            leaked = [d for d in DETAILS if d in message]
            assert not leaked, f"told an unauthenticated peer {leaked}: {message!r}"
            assert "log" in message, message
    finally:
        srv.close()


def test_an_authenticated_pusher_is_still_told_why() -> None:
    """The positive control: a producer that proved the secret reads the details it needs."""
    srv = LandingServer(dram_slots=8, secret=SECRET)
    try:
        layout, full = _refusals(srv)
        assert f"this consumer has {LAYERS}" in layout, layout
        assert "free" in full, full
    finally:
        srv.close()


def test_inline_heads_is_served_sealed_under_aead(make_server) -> None:
    from kvconnectors.mover.heads import HeadRange
    from kvconnectors.mover.reslice import RowLayout, pack_heads
    from kvconnectors.transport.paths import TCP_HEADS_PULL

    rl = RowLayout(dims=(("H", 2), ("N", 16), ("C", SLOT // 32)), layout="LBHNC", dtype="uint8", backend="test",
                   mla=False)
    srv = make_server(secret=SECRET, protection=wire.AEAD, row_layout=rl)
    data = stage(srv.store, "sliced", seed=3)
    half = rl.row_bytes // 2
    got = np.zeros((LAYERS * data.shape[1], half), np.uint8)
    with StoreClient("127.0.0.1", srv.port, compat=COMPAT, secret=SECRET, protection=wire.AEAD,
                     connect_timeout_s=RPC_S) as c:
        c.read("sliced", range(LAYERS), 0, [memoryview(r) for r in got], fingerprint=FP,
               deadline=time.monotonic() + RPC_S, path=TCP_HEADS_PULL, heads=[1, 2])
    want = pack_heads(data.reshape(-1, SLOT), rl, HeadRange(1, 2))
    assert np.array_equal(got, want)


def test_what_a_pusher_provokes_is_logged_at_a_bounded_rate(caplog) -> None:
    """Review follow-up: the details kept from an unauthenticated pusher go to the landing side's log,
    which the pusher must not be able to flood: 50 refused pushes, at most one line per kind."""
    import logging

    srv = LandingServer(dram_slots=8)
    try:
        with caplog.at_level(logging.INFO, logger="kvconnectors"):
            for i in range(50):  # a refused header ends its connection (its byte count is not trusted)
                refused(push, srv.client(), f"bad{i}", [0], 0, 2, 2, num_layers=LAYERS + 1)
        lines = [r for r in caplog.records if "refused a push message from unauthenticated" in r.getMessage()]
        failed = [r for r in caplog.records if "failed to land" in r.getMessage()]
        assert len(lines) == 1 and len(failed) == 1, (len(lines), len(failed))
    finally:
        srv.close()
