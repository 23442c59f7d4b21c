"""Finding 2 (relayable, one-way authentication): a fake server between a secret-holding consumer
and the real store server.

- nonce hand-off (the finding): the fake opens its own connection to the real server and hands the
  consumer the real server's Welcome. Before the fix the consumer signed the real server's nonce,
  the fake forwarded the answer and, authenticated, read and released another request's entry
  (seen to fail on f51b62c: "the fake got a session"). Now the server's proof is over the
  consumer's own nonce, which the fake's connection did not carry: the consumer refuses the fake
  and never sends a proof.
- downgrade: the fake claims to admit only the previous version. Before issue 34 the consumer fell
  back to the one-way v3 challenge and the fake relayed its answer (bounded: the fake's v3 session
  reached no entry granted a token). Now a consumer holding the secret never falls back, with or
  without the previous version's hash (test_downgrade.py has the fake that proves nothing).
- transparent relay (a TCP proxy that also injects frames): no handshake alone can stop it (the
  frames after it carry no MAC; see the README's threat model). Bounded: the injected Read and
  Release of another request's entry are refused as an unknown id, because the fake does not hold
  that entry's token.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest

from kvconnectors.errors import FailureCause, TransferError
from kvconnectors.transport import wire
from kvconnectors.transport.client import StoreClient

from sec_helpers import COMPAT, FP, LAYERS, SECRET, BLOCKS, dest_views, stage

VICTIM_TOKEN = "victim-token-0123456789abcdef"  # not known to the fake
MY_TOKEN = "consumer-token-0123456789abcdef"


class FakeServer:
    """One connection's worth of a man in the middle, on 127.0.0.1; `mode` picks the attack."""

    def __init__(self, real_port: int, mode: str):
        self.real_port, self.mode = real_port, mode
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(5)
        self.port = self.listener.getsockname()[1]
        self.got_proof = False       # the consumer sent a Proof to the fake
        self.session = False         # the fake's connection to the real server authenticated
        self.stolen: list[object] = []  # replies to the fake's own Read / Release of the victim
        self.socks: list[socket.socket] = [self.listener]
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.thread.join(timeout=10)
        for s in self.socks:
            s.close()

    def _accept(self) -> socket.socket:
        c, _ = self.listener.accept()
        self.socks.append(c)
        return c

    def _real(self) -> socket.socket:
        s = socket.create_connection(("127.0.0.1", self.real_port), timeout=5)
        self.socks.append(s)
        return s

    def _run(self) -> None:
        try:
            getattr(self, "_" + self.mode)()
        except (OSError, TransferError):
            pass

    def _steal(self, real: socket.socket) -> None:
        """Authenticated to the real server: read and release the victim's entry."""
        deadline = time.monotonic() + 5
        wire.send_msg(real, wire.Read(transfer_id="victim", layers=list(range(LAYERS)), first_block=0,
                                      num_blocks=BLOCKS, fingerprint=FP))
        self.stolen.append(wire.recv_msg(real, deadline))
        reply = self.stolen[-1]
        if getattr(reply, "ok", False) and getattr(reply, "nbytes", 0):
            view = memoryview(bytearray(reply.nbytes))
            wire.recv_exact(real, view, deadline)
        wire.send_msg(real, wire.Release(transfer_id="victim"))
        self.stolen.append(wire.recv_msg(real, deadline))

    def _relay_auth(self, client: socket.socket, real: socket.socket) -> None:
        """Pass the real server's Welcome to the consumer and the consumer's answer back."""
        deadline = time.monotonic() + 5
        wire.send_msg(client, wire.recv_msg(real, deadline))
        try:
            answer = wire.recv_msg(client, deadline)
        except TransferError:
            return  # the consumer hung up: it refused us
        self.got_proof = isinstance(answer, wire.Proof)
        if not self.got_proof:
            return
        wire.send_msg(real, answer)
        ack = wire.recv_msg(real, deadline)
        wire.send_msg(client, ack)
        self.session = isinstance(ack, wire.Ack) and ack.ok
        if self.session:
            self._steal(real)

    def _nonce_handoff(self) -> None:
        client = self._accept()
        hello = wire.recv_msg(client, time.monotonic() + 5)
        real = self._real()
        own = {"version": hello.version, "compat_hash": hello.compat_hash, "peer": "fake"}
        if getattr(hello, "nonce", None) is not None:
            own["nonce"] = bytes(32)  # the fake's own nonce, not the consumer's
        wire.send_msg(real, wire.Hello(**own))
        self._relay_auth(client, real)

    def _downgrade(self) -> None:
        client = self._accept()
        hello = wire.recv_msg(client, time.monotonic() + 5)
        prev = wire.PROTOCOL_VERSION - 1
        wire.send_msg(client, wire.Welcome(ok=False, error=(
            f"incompatible peer: its protocol v{hello.version} compat {hello.compat_hash}, this server v{prev} "
            f"compat 0000000000000000 (admits v{prev - 1}, v{prev})")))
        client.close()
        self.listener.settimeout(1.5)
        try:
            client = self._accept()  # the consumer's second try, in the previous version
        except OSError:
            return
        hello = wire.recv_msg(client, time.monotonic() + 5)
        real = self._real()
        wire.send_msg(real, wire.Hello(version=hello.version, compat_hash=hello.compat_hash, peer="fake"))
        self._relay_auth(client, real)

    def _transparent(self) -> None:
        client = self._accept()
        real = self._real()
        deadline = time.monotonic() + 5
        wire.send_msg(real, wire.recv_msg(client, deadline))   # the consumer's own Hello, verbatim
        wire.send_msg(client, wire.recv_msg(real, deadline))   # Welcome
        wire.send_msg(real, wire.recv_msg(client, deadline))   # Proof
        ack = wire.recv_msg(real, deadline)
        wire.send_msg(client, ack)
        self.session = isinstance(ack, wire.Ack) and ack.ok
        if self.session:
            self._steal(real)  # injected into the consumer's session
            # then carry the consumer's own request (its Read of its entry, with its token)
            wire.send_msg(real, wire.recv_msg(client, deadline))
            reply = wire.recv_msg(real, deadline)
            wire.send_msg(client, reply)
            if reply.ok and reply.nbytes:
                view = memoryview(bytearray(reply.nbytes))
                wire.recv_exact(real, view, deadline)
                client.sendall(view)


@pytest.fixture
def real(make_server):
    """The producer's store server, given the previous version's hash too (it holds the secret, so it
    admits v4 peers only)."""
    srv = make_server(secret=SECRET, compat=wire.compat_hashes("tiered"))
    stage(srv.store, "victim", seed=1)
    stage(srv.store, "mine", seed=2)
    if hasattr(srv, "grant"):
        srv.grant("victim", VICTIM_TOKEN)
        srv.grant("mine", MY_TOKEN)
    return srv


def test_a_fake_server_handing_over_the_real_servers_nonce_gets_no_session(real) -> None:
    fake = FakeServer(real.port, "nonce_handoff")
    try:
        with pytest.raises(TransferError) as exc:
            StoreClient("127.0.0.1", fake.port, compat=COMPAT, secret=SECRET, connect_timeout_s=3)
        assert exc.value.cause is FailureCause.AUTH, exc.value
    finally:
        fake.close()
    assert not fake.session, f"the fake got a session and read {fake.stolen}"
    assert not fake.got_proof, "the consumer proved itself to a server that had not proved itself"
    assert real.store.contains("victim")


def test_a_fake_that_cannot_prove_the_secret_is_refused_before_the_consumer_proves_anything(make_server) -> None:
    """A server without the secret (a fake, or a misconfigured producer) is refused by a
    secret-holding consumer; before the fix the consumer accepted a server that sent no nonce."""
    plain = make_server()  # holds no secret: it proves nothing
    with pytest.raises(TransferError) as exc:
        StoreClient("127.0.0.1", plain.port, compat=COMPAT, secret=SECRET, connect_timeout_s=3)
    assert exc.value.cause is FailureCause.AUTH and "does not prove" in exc.value.detail, exc.value


def test_a_consumer_holding_the_secret_is_not_downgraded_by_a_relay(real) -> None:
    """The fake claims to admit only v3: a secret holder does not fall back (issue 34), so the fake
    gets no proof and no session, even with the previous version's hash on the consumer's side."""
    fake = FakeServer(real.port, "downgrade")
    try:
        with pytest.raises(TransferError) as exc:
            StoreClient("127.0.0.1", fake.port, compat=wire.compat_hashes("tiered"), secret=SECRET,
                        connect_timeout_s=3)
    finally:
        fake.close()
    assert exc.value.cause is FailureCause.AUTH and "never speaks it" in exc.value.detail, exc.value
    assert not fake.got_proof and not fake.session
    assert real.store.contains("victim")


def test_with_the_window_closed_the_consumer_does_not_fall_back(real) -> None:
    fake = FakeServer(real.port, "downgrade")
    try:
        with pytest.raises(TransferError, match="refused"):
            StoreClient("127.0.0.1", fake.port, compat=COMPAT, secret=SECRET, connect_timeout_s=3)
    finally:
        fake.close()
    assert not fake.got_proof and not fake.session


def test_a_transparent_relay_cannot_read_or_release_another_requests_entry(real) -> None:
    fake = FakeServer(real.port, "transparent")
    try:
        cache, dest = dest_views()
        with StoreClient("127.0.0.1", fake.port, compat=COMPAT, secret=SECRET, connect_timeout_s=3) as c:
            c.read("mine", range(LAYERS), 0, dest, fingerprint=FP, deadline=time.monotonic() + 5, token=MY_TOKEN)
    finally:
        fake.close()
    assert fake.session  # what a relay on the path gets: the consumer's own session ...
    read, release = fake.stolen  # ... but not another request's entry
    assert isinstance(read, wire.ReadReply) and not read.ok and read.cause == "unknown_transfer", read
    assert isinstance(release, wire.Ack) and not release.ok and release.cause == "unknown_transfer", release
    assert real.store.contains("victim")
