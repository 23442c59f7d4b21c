"""Finding 9 (any peer may read, renew or release any entry by id; Locate confirms existence) and
the per-transfer capabilities that close it: a transfer granted a token answers Read, Renew,
Release and Locate only to that token; a missing or wrong one gets, byte for byte, the answer an
id that never existed gets.

Seen to fail on f51b62c: StoreServer has no `grant` (AttributeError), and the same token-less
Read and Release of another request's entry were served and released it.
"""

from __future__ import annotations

import socket
import struct
import time

import msgspec
import pytest

from kvconnectors.errors import FailureCause, TransferError
from kvconnectors.tiered import params as kvparams
from kvconnectors.transport import wire
from kvconnectors.transport.client import StoreClient

from sec_helpers import COMPAT, FP, LAYERS, SECRET, BLOCKS, dest_views, stage


def _answers(port: int, tid: str, token: str, secret: bytes | None) -> list[bytes]:
    """What a peer gets for Read, Renew, Locate and Release of `tid` with `token`: each reply as
    sent (every field), the transfer id replaced by a placeholder so two ids' answers compare."""
    out = []
    with StoreClient("127.0.0.1", port, compat=COMPAT, secret=secret) as c:
        for msg in (wire.Read(transfer_id=tid, layers=list(range(LAYERS)), first_block=0, num_blocks=BLOCKS,
                              fingerprint=FP, token=token),
                    wire.Renew(transfer_ids=[tid], tokens=[token]),
                    wire.Locate(transfer_id=tid, token=token),
                    wire.Release(transfer_id=tid, token=token)):
            wire.send_msg(c.sock, msg)
            (n,) = struct.unpack("!I", _recv(c.sock, 4))
            raw = msgspec.msgpack.decode(_recv(c.sock, n))
            out.append(msgspec.json.encode(raw).replace(tid.encode(), b"<tid>"))
    return out


def _recv(sock: socket.socket, n: int) -> bytes:
    sock.settimeout(5)
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        assert chunk, "the server closed the connection"
        buf += chunk
    return buf


@pytest.mark.parametrize("secret", [None, SECRET], ids=["no-secret", "secret"])
def test_without_its_token_another_requests_entry_reads_as_unknown(make_server, secret) -> None:
    srv = make_server(secret=secret)
    data = stage(srv.store, "victim-entry")
    token = kvparams.new_token()
    srv.grant("victim-entry", token)
    unknown = _answers(srv.port, "nobody-entry", "", secret)  # same length as the victim id
    for presented in ("", kvparams.new_token(), token[:-1] + ("A" if token[-1] != "A" else "B")):
        assert _answers(srv.port, "victim-entry", presented, secret) == unknown, presented
    decoded = [msgspec.json.decode(f) for f in unknown]
    assert decoded[0]["cause"] == "unknown_transfer" and decoded[1]["missing"] == {"<tid>": "unknown_transfer"}
    assert decoded[2]["found"] is False and decoded[3]["cause"] == "unknown_transfer"
    assert srv.store.contains("victim-entry"), "a token-less Release released it"
    # with the token: read byte-exact, renewed, located, released
    cache, dest = dest_views()
    with StoreClient("127.0.0.1", srv.port, compat=COMPAT, secret=secret) as c:
        c.read("victim-entry", range(LAYERS), 0, dest, fingerprint=FP, deadline=time.monotonic() + 5, token=token)
        assert (cache == data).all()
        assert "victim-entry" in c.renew(["victim-entry"], time.monotonic() + 5, tokens=[token]).remaining
        assert c.locate("victim-entry", time.monotonic() + 5, token=token).found
        c.release("victim-entry", time.monotonic() + 5, token=token)
    assert not srv.store.contains("victim-entry")


def test_a_producer_server_refuses_ids_it_never_granted(make_server) -> None:
    """require_grants (a producer's server, where every staged transfer is granted its ticket's
    token when staging starts): an entry staged without a grant is unknown too."""
    srv = make_server(require_grants=True)
    stage(srv.store, "ungranted")
    _, dest = dest_views()
    with StoreClient("127.0.0.1", srv.port, compat=COMPAT) as c:
        with pytest.raises(TransferError) as exc:
            c.read("ungranted", range(LAYERS), 0, dest, fingerprint=FP, deadline=time.monotonic() + 5)
        assert exc.value.cause is FailureCause.UNKNOWN_TRANSFER
        assert not c.locate("ungranted", time.monotonic() + 5).found
    assert srv.store.contains("ungranted")


def test_grants_are_bounded_and_forget_ended_transfers_first(make_server) -> None:
    srv = make_server(require_grants=True, max_grants=8)
    stage(srv.store, "live")
    srv.grant("live", "live-token-0123456789abcdef")
    for i in range(50):  # transfers that ended long ago (never in the store)
        srv.grant(f"gone-{i}", kvparams.new_token())
    assert srv.grants <= 8
    _, dest = dest_views()
    with StoreClient("127.0.0.1", srv.port, compat=COMPAT) as c:  # the live one kept its grant
        c.read("live", range(LAYERS), 0, dest, fingerprint=FP, deadline=time.monotonic() + 5,
               token="live-token-0123456789abcdef")
    srv.revoke("live")
    assert srv.grants <= 7


def test_tickets_carry_a_token_of_at_least_128_bits() -> None:
    tokens = {kvparams.new_token() for _ in range(64)}
    assert len(tokens) == 64
    assert all(len(t) >= 22 for t in tokens)  # >= 16 random bytes, URL-safe base64
