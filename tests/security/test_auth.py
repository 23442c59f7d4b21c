"""Finding 2 (one-way authentication), the handshake itself: both sides prove the secret over a
transcript of both nonces and the Hello, with distinct role labels; both derive the same session
id and key; a proof is good for its own connection and role only.

Seen to fail on f51b62c: the client signed whatever nonce it was handed and the server proved
nothing (no auth.transcript; a server without the secret was accepted by a client holding one).
"""

from __future__ import annotations

import os
import socket
import time

import pytest

from kvconnectors.errors import FailureCause, TransferError
from kvconnectors.transport import auth, wire
from kvconnectors.transport.client import StoreClient

from sec_helpers import COMPAT, SECRET


def test_proofs_are_bound_to_role_and_transcript() -> None:
    nc, ns = os.urandom(32), os.urandom(32)
    th = auth.transcript(4, COMPAT, "peer", nc, ns)
    server, client = auth.prove_role(SECRET, auth.ROLE_SERVER, th), auth.prove_role(SECRET, auth.ROLE_CLIENT, th)
    assert server != client
    assert auth.verify_role(SECRET, auth.ROLE_SERVER, th, server)
    assert not auth.verify_role(SECRET, auth.ROLE_SERVER, th, client)  # no reflection
    assert not auth.verify_role(SECRET, auth.ROLE_CLIENT, th, server)
    for other in (auth.transcript(4, COMPAT, "peer", os.urandom(32), ns),  # another connection's nonce
                  auth.transcript(4, COMPAT, "peer", nc, os.urandom(32)),
                  auth.transcript(4, COMPAT, "other-peer", nc, ns),          # another name
                  auth.transcript(3, COMPAT, "peer", nc, ns)):                # another version
        assert not auth.verify_role(SECRET, auth.ROLE_SERVER, other, server)
    assert not auth.verify_role(b"another-secret-another", auth.ROLE_SERVER, th, server)
    # length-prefixed parts: moving bytes between fields changes the transcript
    assert auth.transcript(4, "ab", "c", nc, ns) != auth.transcript(4, "a", "bc", nc, ns)
    assert len(auth.session_key(SECRET, th)) == 32 and auth.session_key(SECRET, th) != server


def test_both_ends_agree_on_the_session(make_server) -> None:
    srv = make_server(secret=SECRET)
    seen = []
    real = srv._handshake
    srv._handshake = lambda sock, deadline, *seat: seen.append(real(sock, deadline, *seat)) or seen[-1]
    with StoreClient("127.0.0.1", srv.port, compat=COMPAT, secret=SECRET, peer_name="decode-0") as c:
        c.status(time.monotonic() + 5)
        mine = c.session
    theirs = seen[0]
    assert mine.mutual and theirs.mutual and theirs.authenticated
    assert (mine.id, mine.key, mine.peer_name) == (theirs.id, theirs.key, theirs.peer_name) == \
        (mine.id, mine.key, "decode-0")
    assert mine.key is not None and len(mine.id) == 32


def test_a_consumer_with_another_secret_refuses_the_server_first_and_the_server_counts_it(make_server) -> None:
    srv = make_server(secret=SECRET)
    with pytest.raises(TransferError) as exc:
        StoreClient("127.0.0.1", srv.port, compat=COMPAT, secret=b"another-secret-another")
    assert exc.value.cause is FailureCause.AUTH and "did not prove" in exc.value.detail, exc.value
    # the client told the server and waited for it to close: the count is settled already
    assert srv.counters.auth_failures == 1 and srv.counters.rejected.get("auth") == 1


def test_a_consumer_without_the_secret_is_refused(make_server) -> None:
    srv = make_server(secret=SECRET)
    with pytest.raises(TransferError) as exc:
        StoreClient("127.0.0.1", srv.port, compat=COMPAT, secret=None)
    assert exc.value.cause is FailureCause.AUTH and "requires a shared secret" in exc.value.detail


def test_a_hello_without_a_nonce_is_refused(make_server) -> None:
    """A v4 peer must contribute its nonce: without one the transcript would be the server's alone."""
    srv = make_server(secret=SECRET)
    with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as s:
        wire.send_msg(s, wire.Hello(version=wire.PROTOCOL_VERSION, compat_hash=COMPAT, peer="x"))
        welcome = wire.recv_msg(s, time.monotonic() + 5)
    assert not welcome.ok and "nonce" in welcome.error and welcome.proof is None, welcome


def test_a_rotation_keeps_neighbouring_steps_talking_and_both_sides_agree_on_the_key(make_server) -> None:
    """Issue 34, row 7: two secrets during a roll (auth.py, Rotation). Each step of the roll
    ("OLD\\nNEW" -> "NEW\\nOLD" -> "NEW") handshakes with its neighbours through the real server and
    client, and both ends derive the same session key. A server still on step 1 proves OLD, which a
    client on step 3 no longer accepts: hence the whole pool reaches step 2 before any goes on."""
    old, new = b"old-secret-0123456789abcdef", b"new-secret-fedcba9876543210"
    steps = [auth.Secrets(old, new), auth.Secrets(new, old), auth.Secrets(new)]
    for s_i, c_i in [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2), (2, 1), (2, 2), (2, 0)]:
        srv = make_server(secret=steps[s_i])
        seen = []
        real = srv._handshake
        srv._handshake = lambda sock, deadline, *seat, real=real: seen.append(real(sock, deadline, *seat)) or seen[-1]
        with StoreClient("127.0.0.1", srv.port, compat=COMPAT, secret=steps[c_i]) as c:
            assert c.status(time.monotonic() + 5).entries == 0, (s_i, c_i)
            assert c.session.key == seen[0].key and c.session.mutual, (s_i, c_i)
    srv = make_server(secret=steps[0])
    with pytest.raises(TransferError) as exc:
        StoreClient("127.0.0.1", srv.port, compat=COMPAT, secret=steps[2])
    assert exc.value.cause is FailureCause.AUTH and "did not prove" in exc.value.detail, exc.value
