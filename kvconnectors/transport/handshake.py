"""The store server's handshake: Hello, then (with the secret) both proofs, within one deadline.

A peer is admitted when its Hello names an accepted protocol version and compat hash
(wire.ACCEPTED_VERSIONS: peers of the previous version too when `compat` names it and the server
holds no secret: v3 authenticates one way only, so a secret holder never admits it) and its
wire_protection matches this server's ("aead" admits only v4 peers running "aead"; the refusal
names both values). With a secret, the server proves itself first, then checks the peer's proof
(either accepted secret during a rotation); a failure is counted (ServerCounters.auth_failures) and
logged at most once per `log_interval_s` with the count of those not logged. Refusals sent to a peer
that has not authenticated name neither this server's compat hash nor its layout fingerprint.

The connection leaves admission's handshake budget before its last answer (`_seated`): a
connection closed to make room before then is never told "admitted".
"""

from __future__ import annotations

import socket

from kvconnectors.errors import FailureCause, TransferError
from kvconnectors.logs import LogLimiter
from kvconnectors.transport import auth, wire
from kvconnectors.transport.admission import Admission, Seat
from kvconnectors.transport.auth import Session
from kvconnectors.transport.protocol import peer_name
from kvconnectors.transport.server_counters import ServerCounters
from kvconnectors.transport.server_settings import ServerSettings


class Handshake:
    """Runs the handshake of each accepted connection (`run`), from its connection's thread."""

    def __init__(self, settings: ServerSettings, admission: Admission, counters: ServerCounters, log: LogLimiter):
        self.secret, self.protection = settings.secret, settings.protection
        self.compat_hashes = settings.compat_hashes
        self.admission, self.counters, self.log = admission, counters, log

    def run(self, sock: socket.socket, deadline: float, seat: Seat | None = None) -> Session | None:
        """The peer's session once it is admitted; None when refused, or when its `seat` was given to
        another connection before the last answer (which is then not sent: the peer sees the close
        before anything was done, and may connect again). `deadline` bounds every step together."""
        peer = peer_name(sock)
        try:
            hello = wire.recv_msg(sock, deadline=deadline)
        except TransferError as exc:
            self.counters.reject("handshake_timeout" if exc.cause is FailureCause.TIMEOUT else "protocol")
            return None
        if not isinstance(hello, wire.Hello):
            self.counters.reject("protocol")
            self._welcome_refusal(sock, f"expected Hello, got {type(hello).__name__}")
            return None
        refused = wire.check_hello(hello, self.compat_hashes)
        if refused:
            self.counters.reject("protocol")
            ours = max(self.compat_hashes)
            self.log.warning("hello", "refused peer %s: %s; this server speaks v%d compat %s", peer, refused,
                             ours, self.compat_hashes[ours])
            self._welcome_refusal(sock, refused)
            return None
        if hello.version < 4 and self.protection == wire.AEAD:
            self.counters.reject("protection_mismatch")
            self._welcome_refusal(sock, (
                f"{wire.PROTECTION_MISMATCH}: this server runs {wire.AEAD!r}, which needs protocol v4; the peer "
                f"speaks v{hello.version} (upgrade it, or run wire_protection {wire.HANDSHAKE!r} until the pool is)"))
            return None
        if hello.version < 4 and self.secret is not None:
            # v3 authenticates one way and binds nothing to the connection: a secret holder admits only v4
            self.counters.reject("previous_wire")
            self._welcome_refusal(sock, (
                f"its protocol v{hello.version} authenticates one way only; this server holds the shared secret "
                "and admits previous-version peers only in a pool without one (upgrade the peer)"))
            return None
        if hello.version < 4:
            if not self._seated(seat, authenticated=False):
                return None
            wire.send_msg(sock, wire.Welcome(ok=True))
            return Session(id=auth.session_id(None), version=hello.version, authenticated=False, mutual=False,
                           peer=peer, peer_name=hello.peer)
        if not isinstance(hello.nonce, bytes) or len(hello.nonce) != auth.NONCE_BYTES:
            self.counters.reject("protocol")
            self._welcome_refusal(sock, f"a v{hello.version} Hello carries a {auth.NONCE_BYTES}-byte nonce")
            return None
        if hello.protection != self.protection:
            self.counters.reject("protection_mismatch")
            self.log.warning("hello", "refused peer %s: its wire_protection %r differs from this server's %r", peer,
                             hello.protection[:32], self.protection)
            self._welcome_refusal(sock, wire.protection_mismatch(self.protection, hello.protection))
            return None
        if self.secret is None:
            if not self._seated(seat, authenticated=False):
                return None
            wire.send_msg(sock, wire.Welcome(ok=True))
            return Session(id=auth.session_id(None), version=hello.version, authenticated=False, mutual=False,
                           peer=peer, peer_name=hello.peer)
        nonce = auth.new_nonce()
        th = auth.transcript(hello.version, hello.compat_hash, hello.peer, hello.nonce, nonce, self.protection)
        wire.send_msg(sock, wire.Welcome(ok=True, nonce=nonce, proof=auth.prove_role(self.secret, auth.ROLE_SERVER, th),
                                         protection=self.protection))
        try:
            proof = wire.recv_msg(sock, deadline=deadline)
        except TransferError:
            proof = None
        # during a rotation the client may prove with either accepted secret; the key is derived from that one
        matched = auth.verify_any(self.secret, auth.ROLE_CLIENT, th, proof.mac) if isinstance(proof, wire.Proof) \
            else None
        if matched is None:
            self._auth_failed(sock, peer, proof)
            return None
        if not self._seated(seat, authenticated=True):
            return None
        wire.send_msg(sock, wire.Ack(ok=True))
        return Session(id=auth.session_id(th), version=hello.version, authenticated=True, mutual=True, peer=peer,
                       peer_name=hello.peer, key=auth.session_key(matched, th), protection=self.protection)

    def _seated(self, seat: Seat | None, authenticated: bool) -> bool:
        """The connection leaves the handshake budget before its last answer: from then on only an
        idle connection may be closed to make room, never a half-admitted one. False: it was already
        closed to make room."""
        return seat is None or self.admission.handshake_done(seat, authenticated)

    def _welcome_refusal(self, sock: socket.socket, error: str) -> None:
        try:
            wire.send_msg(sock, wire.Welcome(ok=False, error=error[:wire.MAX_MESSAGE]))
        except OSError:
            pass

    def _auth_failed(self, sock: socket.socket, peer: str, proof: object) -> None:
        self.counters.count_auth_failure()
        self.counters.reject("auth")
        why = ("no proof before the deadline" if proof is None else
               "a wrong proof" if isinstance(proof, wire.Proof) else f"{type(proof).__name__} instead of a proof")
        self.log.warning("auth", "refused an unauthenticated peer %s (%s; %d failed authentications so far)",
                         peer, why, self.counters.auth_failures)
        try:
            wire.send_msg(sock, wire.Ack(ok=False, cause=FailureCause.AUTH.value,
                                         message="shared-secret authentication failed"))
        except OSError:
            pass
