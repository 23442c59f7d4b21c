"""Failures are data: TransferError's fields, its refusal copy, and what each FailureCause means.

Negative controls, each run once by hand and seen failing: moving PROTOCOL out of `transient` (or
adding a cause without a row here) fails the pinned table; `refusal()` setting `refused` on the
original fails the copy test; without `__reduce__` the pickle test fails; `send_refusal` sending `str(exc)` (cause prefix and all) fails the
wire test. (The old `str(exc).split("] ", 1)[-1]` read the same bytes: this change is about reading
a field instead of a message, not about what travels.)"""

from __future__ import annotations

import pickle
import socket

import pytest

from kvconnectors.errors import (FailureCause, LeaseExpiredError, StoreFullError, TransferError,
                                 UnknownTransferError)
from kvconnectors.transport import wire

C = FailureCause
# cause -> (transient, push_lost, breaks_stream, nothing_to_release); a change here is a deliberate one
PINNED = {
    C.PEER_UNREACHABLE:  (True, True, True, False),
    C.LEASE_EXPIRED:     (False, False, False, True),
    C.CHECKSUM_MISMATCH: (True, False, False, False),
    C.LAYOUT_MISMATCH:   (False, False, False, False),
    C.STORE_FULL:        (False, False, False, False),
    C.TIMEOUT:           (True, True, True, False),
    C.UNKNOWN_TRANSFER:  (False, False, False, True),
    C.PROTOCOL:          (True, False, True, False),
    C.AUTH:              (False, False, False, True),
    C.BAD_PARAMS:        (False, False, False, False),
}


def test_every_cause_property_is_pinned() -> None:
    assert set(PINNED) == set(FailureCause), "a new cause needs its row in PINNED"
    got = {c: (c.transient, c.push_lost, c.breaks_stream, c.nothing_to_release) for c in FailureCause}
    assert got == PINNED


def test_fields_and_str() -> None:
    exc = TransferError(FailureCause.TIMEOUT, "peer a:1: [checksum_mismatch] no answer")
    assert exc.cause is FailureCause.TIMEOUT and exc.refused is False
    assert exc.detail == "peer a:1: [checksum_mismatch] no answer"  # kept whole, whatever it contains
    assert str(exc) == "[timeout] peer a:1: [checksum_mismatch] no answer"  # logs read as before
    assert TransferError("auth", "x").cause is FailureCause.AUTH
    assert TransferError(FailureCause.AUTH, "x", refused=True).refused
    with pytest.raises(ValueError, match="nope"):
        TransferError("nope", "x")


@pytest.mark.parametrize("cls, cause", [(StoreFullError, C.STORE_FULL), (LeaseExpiredError, C.LEASE_EXPIRED),
                                        (UnknownTransferError, C.UNKNOWN_TRANSFER)])
def test_subclasses_keep_their_one_argument_constructor(cls: type, cause: FailureCause) -> None:
    exc = cls("transfer 't' is gone")
    assert exc.cause is cause and exc.detail == "transfer 't' is gone" and not exc.refused
    assert str(exc) == f"[{cause.value}] transfer 't' is gone"


def test_refusal_is_a_marked_copy_of_the_same_class() -> None:
    exc = StoreFullError("landing store: 3 GiB short")
    twin = exc.refusal()
    assert twin is not exc and type(twin) is StoreFullError and twin.refused
    assert (twin.cause, twin.detail, str(twin)) == (exc.cause, exc.detail, str(exc))
    assert exc.refused is False, "refusal() changed the original"


@pytest.mark.parametrize("exc", [TransferError(C.PROTOCOL, "bad frame", refused=True), StoreFullError("full")])
def test_pickle_keeps_class_and_fields(exc: TransferError) -> None:
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is type(exc)
    assert (back.cause, back.detail, back.refused, str(back)) == (exc.cause, exc.detail, exc.refused, str(exc))


def test_a_wire_refusal_carries_the_detail_next_to_its_cause() -> None:
    a, b = socket.socketpair()
    with a, b:
        wire.send_refusal(a, TransferError(C.TIMEOUT, "peer x: [timeout] waited 2 s"))
        msg = wire.recv_msg(b, deadline=None)
        assert isinstance(msg, wire.Ack) and not msg.ok
        assert (msg.cause, msg.message) == ("timeout", "peer x: [timeout] waited 2 s")
