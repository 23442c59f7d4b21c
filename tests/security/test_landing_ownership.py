"""Issue 16, finding 3: landing entries were deleted on anyone's word. A peer's PushEnd(ok=False),
a malformed Push or a duplicate Push for a transfer id deleted the landed (even sealed) or
in-flight entry of another producer. Now an entry belongs to the producer connection that created
it: only that owner (or lease expiry) fails, aborts or continues it, a sealed entry is never
deleted by a push message, and everyone else is refused in step with the entry untouched."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvconnectors.errors import FailureCause, TransferError

from landing_kit import (LAYERS, RPC_S, LandingServer, push, push_all, push_msg, refused, refused_header,
                         still_serves)

BLOCKS = 4


@pytest.fixture
def srv():
    s = LandingServer()
    yield s
    s.close()


def abort(c, tid: str) -> None:
    c.push_end(tid, time.monotonic() + RPC_S, TransferError(FailureCause.STORE_FULL, "attacker says so"))


def test_another_connections_abort_leaves_an_in_flight_entry_alone(srv) -> None:
    owner, attacker = srv.client(), srv.client()
    first = push(owner, "t", [0], 0, BLOCKS, BLOCKS, seed=1)
    exc = refused(abort, attacker, "t")
    assert exc.cause is FailureCause.PROTOCOL
    refused(attacker.push_end, "t", time.monotonic() + RPC_S)  # nor is it the attacker's to seal
    last = push(owner, "t", [1], 0, BLOCKS, BLOCKS, seed=2, seal=True)
    assert np.array_equal(srv.landed("t", BLOCKS), np.stack([first, last]))
    still_serves(attacker)


def test_nobody_deletes_a_sealed_entry_with_a_push_message(srv) -> None:
    owner, attacker = srv.client(), srv.client()
    data = push_all(owner, "s", BLOCKS, seed=3)
    for c in (attacker, owner):  # not even its owner: the seal handed it to the consumer
        refused(abort, c, "s")
        exc = refused(push, c, "s", [0], 0, BLOCKS, BLOCKS, seed=9)  # a duplicate Push
        assert "sealed" in str(exc)
        refused_header(srv, push_msg("s", [0], 0, BLOCKS, BLOCKS, None, fingerprint="other"))  # a malformed one
        refused(c.push_end, "s", time.monotonic() + RPC_S)
        still_serves(c)
    assert srv.store.is_sealed("s")
    assert np.array_equal(srv.landed("s", BLOCKS), data), "the landed bytes must be the owner's"


def test_a_duplicate_or_malformed_push_from_another_connection_leaves_the_entry_alone(srv) -> None:
    owner, attacker = srv.client(), srv.client()
    first = push(owner, "d", [0], 0, BLOCKS, BLOCKS, seed=4)
    exc = refused(push, attacker, "d", [1], 0, BLOCKS, BLOCKS, seed=99)  # well-formed, someone else's id
    assert exc.cause is FailureCause.PROTOCOL
    refused(push, attacker, "d", [1], 0, BLOCKS, BLOCKS, seed=99, seal=True)
    # malformed in every way the header can be: each refused, the entry untouched
    for bad in (dict(fingerprint="not-ours"), dict(num_layers=LAYERS + 1), dict(total_blocks=0),
                dict(layers=[0, 0]), dict(first_block=BLOCKS), dict(checksums=[1])):
        refused_header(srv, push_msg("d", [1], 0, BLOCKS, BLOCKS, None, **bad))
    assert srv.store.contains("d") and not srv.store.is_sealed("d")
    last = push(owner, "d", [1], 0, BLOCKS, BLOCKS, seed=5, seal=True)
    assert np.array_equal(srv.landed("d", BLOCKS), np.stack([first, last]))
    still_serves(attacker)


def test_a_strangers_release_does_not_end_an_in_flight_entry(srv) -> None:
    """Release names an entry by id only; while the entry is still landing it is its producer's,
    and a Release from anyone else is answered as for an unknown id."""
    owner, stranger = srv.client(), srv.client()
    first = push(owner, "r", [0], 0, BLOCKS, BLOCKS, seed=6)
    exc = refused(stranger.release, "r", time.monotonic() + RPC_S)
    assert exc.cause is FailureCause.UNKNOWN_TRANSFER
    last = push(owner, "r", [1], 0, BLOCKS, BLOCKS, seed=7, seal=True)
    assert np.array_equal(srv.landed("r", BLOCKS), np.stack([first, last]))


def test_the_owner_still_ends_its_own_transfers(srv) -> None:
    """What the owner may do is unchanged: its abort fails its in-flight entry with its cause."""
    owner = srv.client()
    push(owner, "own", [0], 0, BLOCKS, BLOCKS)
    abort(owner, "own")
    with pytest.raises(TransferError) as exc:
        srv.landing.entries.wait("own", time.monotonic() + 1, time.monotonic() + 1)
    assert exc.value.cause is FailureCause.STORE_FULL and not srv.store.contains("own")


# ---------------------------------------------------------------- issue 34, row 2: landed entries are owned
LANDED_TOKEN = "landed-token-0123456789abcdefgh"


def _push_all_with(c, tid: str, token: str, seed: int = 0) -> np.ndarray:
    return np.stack([push(c, tid, [layer], 0, BLOCKS, BLOCKS, seed=seed + layer, seal=layer == LAYERS - 1,
                          token=token) for layer in range(LAYERS)])


def _refused_everything(c, tid: str, token: str) -> None:
    """Read, Renew, Locate and Release of `tid` with `token` are each answered as for an unknown id."""
    from sec_helpers import dest_views

    _, dest = dest_views()
    exc = refused(c.read, tid, range(LAYERS), 0, dest[:LAYERS * BLOCKS], fingerprint="fp-landing-security",
                  deadline=time.monotonic() + RPC_S, token=token)
    assert exc.cause is FailureCause.UNKNOWN_TRANSFER, exc
    reply = c.renew([tid], time.monotonic() + RPC_S, tokens=[token])
    assert tid in reply.missing and tid not in reply.remaining, reply
    assert not c.locate(tid, time.monotonic() + RPC_S, token=token).found
    exc = refused(c.release, tid, time.monotonic() + RPC_S, token=token)
    assert exc.cause is FailureCause.UNKNOWN_TRANSFER, exc


@pytest.mark.parametrize("secret", [None, b"landing-owned-s3cret-s3cret"], ids=["no-secret", "secret"])
def test_a_landed_entry_answers_only_to_its_transfers_token(secret) -> None:
    srv = LandingServer(secret=secret)
    try:
        owner, stranger = srv.client(), srv.client()
        data = _push_all_with(owner, "L", LANDED_TOKEN, seed=11)
        for token in ("", "not-the-token-0123456789abcdefgh"):
            _refused_everything(stranger, "L", token)
        assert srv.store.contains("L") and np.array_equal(srv.landed("L", BLOCKS), data)
        # the token's holder (the consumer's lease keeper, a rank reading it) is served
        assert stranger.locate("L", time.monotonic() + RPC_S, token=LANDED_TOKEN).found
        assert "L" in stranger.renew(["L"], time.monotonic() + RPC_S, tokens=[LANDED_TOKEN]).remaining
        stranger.release("L", time.monotonic() + RPC_S, token=LANDED_TOKEN)
        assert not srv.store.contains("L")
    finally:
        srv.close()


def test_an_entry_landed_without_a_token_answers_nobody_on_the_wire(srv) -> None:
    """A producer that sent no token (an older one) leaves an entry only its consumer reads, locally."""
    owner, stranger = srv.client(), srv.client()
    data = push_all(owner, "N", BLOCKS, seed=12)
    for c in (stranger, owner):
        _refused_everything(c, "N", "")
    assert np.array_equal(srv.landed("N", BLOCKS), data)


def test_a_landed_entry_whose_token_was_forgotten_answers_nobody(srv) -> None:
    """The landing side's token table is bounded (and drops a token just before its entry goes): a
    live landed entry it no longer knows a token for must answer nobody, never anybody."""
    owner, stranger = srv.client(), srv.client()
    _push_all_with(owner, "F", LANDED_TOKEN, seed=13)
    with srv.landing.entries._cond:
        srv.landing.entries._tokens.pop("F")
    for token in ("", LANDED_TOKEN):
        _refused_everything(stranger, "F", token)
    assert srv.store.contains("F")
