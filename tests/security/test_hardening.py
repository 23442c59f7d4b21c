"""Finding 9 (hardening gaps, the store server's share): refusals to unauthenticated peers reveal
neither the compat hash nor the layout fingerprint; failed authentications are counted and logged
at a bounded rate; every reply fits the frame limit its reader enforces.

Seen to fail on f51b62c: the Welcome refusal named "this server v3 compat d3dfed9708bc2a9b" and a
layout refusal "this producer's fp-security"; 60 failed authentications logged 60 WARNING lines;
a Renew of 2050 ids of 500 characters (a 1.03 MB frame, within the limit) got a 1.07 MB RenewReply,
which the client refuses ("exceeds the limit").
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import time

import msgspec
import pytest

from kvconnectors.errors import FailureCause, TransferError
from kvconnectors.transport import wire
from kvconnectors.transport.client import StoreClient

from sec_helpers import COMPAT, FP, LAYERS, SECRET, dest_views, stage


def _hello(compat: str) -> wire.Hello:
    fields = {"version": wire.PROTOCOL_VERSION, "compat_hash": compat, "peer": "probe"}
    if "nonce" in wire.Hello.__struct_fields__:
        fields["nonce"] = os.urandom(32)
    return wire.Hello(**fields)


def test_a_refused_hello_names_nothing_about_the_server(make_server) -> None:
    srv = make_server(secret=SECRET)
    with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as s:
        wire.send_msg(s, _hello("0123456789abcdef"))
        welcome = wire.recv_msg(s, time.monotonic() + 5)
    assert isinstance(welcome, wire.Welcome) and not welcome.ok, welcome
    assert "incompatible peer" in welcome.error
    assert COMPAT not in welcome.error and FP not in welcome.error, welcome.error


def test_a_layout_refusal_hides_the_fingerprint_from_an_unauthenticated_peer(make_server) -> None:
    """Without a secret no peer is authenticated: it learns that the layouts differ, not ours.
    With one, an authenticated consumer is told the producer's layout (what it needs to fix it)."""
    for secret in (None, SECRET):
        srv = make_server(secret=secret)
        stage(srv.store, "t")
        _, dest = dest_views()
        with StoreClient("127.0.0.1", srv.port, compat=COMPAT, secret=secret) as c, \
                pytest.raises(TransferError) as exc:
            c.read("t", range(LAYERS), 0, dest, fingerprint="consumer-layout", deadline=time.monotonic() + 5)
        assert exc.value.cause is FailureCause.LAYOUT_MISMATCH
        assert "consumer-layout" in exc.value.detail
        assert (FP in exc.value.detail) is (secret is not None), (secret, exc.value.detail)


def _fail_auth(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        wire.send_msg(s, _hello(COMPAT))
        welcome = wire.recv_msg(s, time.monotonic() + 5)
        assert welcome.ok and welcome.nonce, welcome
        wire.send_msg(s, wire.Proof(mac=bytes(32)))
        ack = wire.recv_msg(s, time.monotonic() + 5)
        assert isinstance(ack, wire.Ack) and not ack.ok and ack.cause == "auth", ack
        assert COMPAT not in ack.message and FP not in ack.message


def test_failed_authentications_are_counted_and_logged_at_a_bounded_rate(make_server, caplog) -> None:
    kw = {"log_interval_s": 1.0} if "log_interval_s" in StoreServerArgs() else {}
    srv = make_server(secret=SECRET, **kw)
    caplog.set_level(logging.WARNING, logger="kvconnectors.transport.server")
    for _ in range(60):
        _fail_auth(srv.port)
    lines = [r for r in caplog.records if "unauthenticated peer" in r.getMessage()]
    assert srv.counters.auth_failures == 60 and srv.counters.rejected.get("auth") == 60
    assert len(lines) <= 2, f"{len(lines)} log lines for 60 failed authentications"
    time.sleep(1.1)  # past the interval: the next line says how many were left out
    _fail_auth(srv.port)
    last = [r.getMessage() for r in caplog.records if "unauthenticated peer" in r.getMessage()][-1]
    assert "more like it" in last and "61 failed authentications" in last, last
    with StoreClient("127.0.0.1", srv.port, compat=COMPAT, secret=SECRET) as c:  # the metric's source
        assert c.status(time.monotonic() + 5).auth_failures == 61


def StoreServerArgs() -> set[str]:
    """The keywords StoreServer takes: its own, and its settings' fields where they are declared apart."""
    import inspect

    from kvconnectors.transport.server import StoreServer

    try:
        from kvconnectors.transport.server_settings import FIELDS
    except ImportError:  # the code before the settings were declared apart
        FIELDS = frozenset()
    return set(inspect.signature(StoreServer).parameters) | FIELDS


def test_a_renewal_of_many_long_ids_gets_replies_within_the_frame_limit(make_server) -> None:
    srv = make_server()
    ids = [f"{i:05d}" + "x" * 495 for i in range(2050)]  # 500 characters each
    request = len(msgspec.msgpack.encode(wire.Renew(transfer_ids=ids)))
    assert request < wire.MAX_CONTROL_BYTES  # a frame the server must accept ...
    with StoreClient("127.0.0.1", srv.port, compat=COMPAT) as c:
        reply = c.renew(ids, time.monotonic() + 10)  # ... and answer within the limit the client reads
        assert set(reply.missing) == set(ids) and not reply.remaining
        # one frame of all of them, by hand: refused typed (or answered within the limit), in step after
        wire.send_msg(c.sock, wire.Renew(transfer_ids=ids))
        (n,) = struct.unpack("!I", wire_recv(c.sock, 4))
        assert n <= wire.MAX_CONTROL_BYTES, f"a {n}-byte reply frame"
        answer = msgspec.msgpack.decode(wire_recv(c.sock, n))
        assert answer.get("cause") == "protocol" or set(answer.get("missing", {})) == set(ids), str(answer)[:200]
        assert c.status(time.monotonic() + 5).entries == 0


def wire_recv(sock: socket.socket, n: int) -> bytes:
    view = memoryview(bytearray(n))
    wire.recv_exact(sock, view, time.monotonic() + 10)
    return bytes(view)


def test_every_reply_the_server_builds_is_checked_against_the_limit() -> None:
    big = wire.RenewReply(remaining={}, missing={"x" * 600 + str(i): "unknown_transfer" for i in range(2000)})
    with pytest.raises(TransferError) as exc:
        wire.encode(big, wire.MAX_CONTROL_BYTES)
    assert exc.value.cause is FailureCause.PROTOCOL and "exceeds" in exc.value.detail
