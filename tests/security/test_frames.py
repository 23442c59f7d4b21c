"""Finding 7 (uncaught exceptions on the store server side): every malformed frame gets a typed
refusal or a clean close, no connection thread dies with an exception, and the server keeps
serving. Property-based (Hypothesis) over every wire message, with wrong types, unknown fields,
deep nesting and random bytes, on reused connections, against a real StoreServer on 127.0.0.1.

Seen to fail on f51b62c: a frame whose unknown field nests 100 000 arrays deep raised
RecursionError out of recv_msg and killed its connection thread unanswered (thread_errors held
it); so did the landing side's IndexError on a second Push with another total_blocks.
"""

from __future__ import annotations

import socket
import struct
import time
import types
import typing

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvconnectors.errors import FailureCause, TransferError
from kvconnectors.transport import wire
from kvconnectors.transport.client import StoreClient

from sec_helpers import COMPAT, FP, LAYERS, SECRET, stage

REPLY_WAIT_S = 3.0
CAUSES = {c.value for c in FailureCause}
TIDS = ("staged", "granted", "nope", "")
TOKEN = "granted-token-0123456789abcdef"
MESSAGES = typing.get_args(wire.Message)
SETTINGS = settings(max_examples=60, deadline=None, database=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


# ---------------------------------------------------------------- strategies
_scalars = (st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats()
            | st.text(max_size=12) | st.binary(max_size=12))
any_value = st.recursive(_scalars, lambda kids: st.lists(kids, max_size=4)
                         | st.dictionaries(st.text(max_size=6), kids, max_size=4), max_leaves=16)


def _for_type(tp, name: str):
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return st.one_of(*[_for_type(a, name) for a in args])
    if tp is type(None):
        return st.none()
    if tp is bool:
        return st.booleans()
    if tp is int:
        return st.integers(-2, 12) | st.integers(-2**63, 2**64 - 1)
    if tp is float:
        return st.floats()
    if tp is bytes:
        return st.binary(max_size=48)
    if tp is str:
        known = {"transfer_id": TIDS, "fingerprint": (FP, "other"), "data_path": ("inline", "shm", "nixl", "x"),
                 "token": (TOKEN, "")}.get(name, ("",))
        return st.sampled_from(known) | st.text(max_size=24)
    if origin is list:
        inner = args[0]
        return st.lists(st.sampled_from(TIDS) if inner is str else _for_type(inner, name), max_size=6)
    if origin is dict:
        return st.dictionaries(st.text(max_size=8), _for_type(args[1], name), max_size=4)
    return any_value


def _message(cls):
    fields = msgspec.structs.fields(cls)
    return st.fixed_dictionaries({f.name: _for_type(f.type, f.name) for f in fields}).map(
        lambda kw: {"type": cls.__name__, **kw})


@st.composite
def frames(draw) -> bytes:
    """One control frame's body (msgpack): a message of any kind with typed, mistyped, missing and
    unknown fields, an unknown tag, deep nesting, or bytes that are not msgpack at all."""
    kind = draw(st.sampled_from(["typed", "typed", "typed", "mistyped", "unknown", "deep", "raw"]))
    if kind == "raw":
        return draw(st.binary(max_size=64))
    if kind == "deep":
        depth = draw(st.sampled_from([2_000, 100_000]))
        tag = draw(st.sampled_from([m.__name__ for m in MESSAGES]))
        nest = draw(st.sampled_from([b"\x91", b"\x81\xa1k"]))  # arrays or maps, 1 element each
        return b"\x82" + msgspec.msgpack.encode("type") + msgspec.msgpack.encode(tag) + \
            msgspec.msgpack.encode("x-deep") + nest * depth + b"\xc0"
    body = draw(st.sampled_from(MESSAGES).flatmap(_message))
    if kind == "mistyped" and len(body) > 1:
        key = draw(st.sampled_from(sorted(k for k in body if k != "type")))
        body[key] = draw(any_value)
    elif kind == "unknown":
        body[draw(st.sampled_from(["type", "extra"]))] = draw(any_value)
    if draw(st.booleans()) and len(body) > 1:
        body.pop(draw(st.sampled_from(sorted(k for k in body if k != "type"))))
    try:
        return msgspec.msgpack.encode(body)
    except (OverflowError, TypeError, msgspec.EncodeError):
        return msgspec.msgpack.encode({"type": body["type"]})


# ---------------------------------------------------------------- harness
class Peer:
    """An authenticated connection, reopened whenever the server closes it."""

    def __init__(self, port: int, secret: bytes | None):
        self.port, self.secret, self.client = port, secret, None
        self.closes = 0

    def sock(self) -> socket.socket:
        if self.client is None:
            self.client = StoreClient("127.0.0.1", self.port, compat=COMPAT, secret=self.secret)
        return self.client.sock

    def drop(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
            self.closes += 1

    def exchange(self, body: bytes) -> object:
        """Send one frame; return the decoded reply, or "closed". A silent open connection fails."""
        s = self.sock()
        try:
            s.sendall(struct.pack("!I", len(body)) + body)
            reply = wire.recv_msg(s, time.monotonic() + REPLY_WAIT_S, max_bytes=wire.MAX_CONTROL_BYTES * 2)
        except OSError:
            self.drop()
            return "closed"
        except TransferError as exc:
            assert exc.cause is not FailureCause.TIMEOUT, f"no answer and no close within {REPLY_WAIT_S} s"
            self.drop()
            return "closed"
        if isinstance(reply, wire.ReadReply) and reply.ok:
            if reply.nbytes:  # a read that is served streams its bytes: take them, stay in step
                wire.recv_exact(s, memoryview(bytearray(reply.nbytes)), time.monotonic() + REPLY_WAIT_S)
            elif reply.offsets is not None:
                wire.send_msg(s, wire.Ack(ok=False, cause="protocol", message="fuzz"))
        return reply


def check_reply(reply: object) -> None:
    if reply == "closed":
        return
    assert isinstance(reply, (wire.Ack, wire.ReadReply, wire.RenewReply, wire.LocateReply, wire.StatusReply,
                              wire.Welcome)), reply
    if isinstance(reply, (wire.Ack, wire.ReadReply)) and not reply.ok:
        assert reply.cause in CAUSES, reply  # typed
        assert len(reply.message) <= wire.MAX_MESSAGE + 3


def still_serving(port: int, secret: bytes | None) -> None:
    with StoreClient("127.0.0.1", port, compat=COMPAT, secret=secret) as c:
        assert c.status(time.monotonic() + 5).entries >= 0


@pytest.fixture
def target(make_server):
    srv = make_server(secret=SECRET, seal_wait_s=0.2)
    stage(srv.store, "staged")
    stage(srv.store, "granted")
    if hasattr(srv, "grant"):
        srv.grant("granted", TOKEN)
    return srv


# ---------------------------------------------------------------- tests
def test_a_deeply_nested_frame_is_refused_and_the_server_keeps_serving(target, thread_errors) -> None:
    body = b"\x82" + msgspec.msgpack.encode("type") + msgspec.msgpack.encode("Status") + \
        msgspec.msgpack.encode("x") + b"\x91" * 100_000 + b"\xc0"
    peer = Peer(target.port, SECRET)
    reply = peer.exchange(body)
    check_reply(reply)
    assert isinstance(reply, wire.Ack) and reply.cause == "protocol" and "nested" in reply.message, reply
    time.sleep(0.1)
    assert not thread_errors, thread_errors
    still_serving(target.port, SECRET)
    peer.drop()


@SETTINGS
@given(st.lists(frames(), min_size=1, max_size=6))
def test_every_frame_on_a_reused_connection_is_answered_typed_or_closed(target, thread_errors, batch) -> None:
    peer = Peer(target.port, SECRET)
    try:
        for body in batch:
            check_reply(peer.exchange(body))
        check_reply(peer.exchange(msgspec.msgpack.encode(wire.Status())))  # in step after the batch
    finally:
        peer.drop()
    assert not thread_errors, thread_errors
    still_serving(target.port, SECRET)


@settings(max_examples=40, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frames())
def test_every_first_frame_before_the_handshake_is_refused_or_closed(target, thread_errors, body) -> None:
    with socket.create_connection(("127.0.0.1", target.port), timeout=5) as s:
        s.sendall(struct.pack("!I", len(body)) + body)
        try:
            reply = wire.recv_msg(s, time.monotonic() + 2 + REPLY_WAIT_S)
        except TransferError as exc:
            assert exc.cause is not FailureCause.TIMEOUT, "no answer and no close"
            reply = "closed"
        except OSError:
            reply = "closed"
    if reply != "closed":
        # a Hello may be admitted (Welcome ok, then the server waits for the proof); anything else is refused
        assert isinstance(reply, (wire.Welcome, wire.Ack)), reply
        assert not isinstance(reply, wire.Welcome) or reply.ok or COMPAT not in reply.error
    assert not thread_errors, thread_errors


def test_a_landing_bug_closes_its_connection_and_the_server_keeps_serving(thread_errors) -> None:
    """A second Push of one transfer with another total_blocks raised IndexError in landing.py and
    killed the thread; whatever the landing side does with it, the server answers or closes and
    keeps serving."""
    from kvconnectors.store import StoreConfig, TieredStore
    from kvconnectors.transport.landing import Landing
    from kvconnectors.transport.server import StoreServer

    dst = TieredStore(StoreConfig(slot_bytes=4096, dram_bytes=64 * 4096, lease_ttl_s=30))
    srv = StoreServer(dst, "127.0.0.1", 0, fingerprint=FP, num_layers=LAYERS, compat=COMPAT,
                      landing=Landing(dst, fingerprint=FP, num_layers=LAYERS))
    peer = Peer(srv.port, None)
    try:
        for total in (2, 9):
            push = wire.Push(transfer_id="p", num_layers=LAYERS, total_blocks=total, fingerprint=FP, layers=[0],
                             first_block=total - 1, num_blocks=1, nbytes=4096)
            s = peer.sock()
            try:
                wire.send_msg(s, push)
                s.sendall(bytes(4096))
                reply = wire.recv_msg(s, time.monotonic() + REPLY_WAIT_S)
            except (OSError, TransferError):
                peer.drop()
                reply = "closed"
            check_reply(reply)
        peer.drop()
        time.sleep(0.1)
        assert not thread_errors, thread_errors
        still_serving(srv.port, None)
    finally:
        peer.drop()
        srv.close()
        dst.close()
