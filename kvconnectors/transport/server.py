"""The store server: serves staged KV to consumers over the control protocol.

One thread per connection, blocking sockets: an idle server costs no CPU. Threads are bounded
before they start: the accept thread admits a connection only within the caps of admission.py
(all connections, per address, and before the handshake per address, per prefix and in all),
making room by closing the connection waiting longest for its handshake, or idle longest, and
refusing the newcomer at once (no thread, no read) only when nothing may be closed.

A connection must finish its handshake (Hello, and the shared-secret proofs when the server holds
one) within `handshake_timeout_s` of being accepted, all steps together; an authenticated one is
closed after `idle_timeout_s` without a request. So sockets that never authenticate, from one
address or several, hold at most max_pending threads for at most handshake_timeout_s each, and a
peer that authenticates is served beside them (tests/security/test_dos.py).

Every request is validated before it touches the store; a bad request gets a typed error reply and
the connection (and the server) keep serving; a request that raises anything else (a bug) is logged,
counted ("internal") and its connection closed, never the thread left to die unanswered.

Per-transfer capabilities: the worker `grant`s each staged transfer the token of its ticket;
Read, Renew, Release and Locate of a granted transfer must present that token, and a wrong or
missing one is answered exactly like an unknown id. With `require_grants` (a producer's server)
an id never granted is unknown too. Refusals sent to a peer that has not authenticated name
neither this server's compat hash nor its layout fingerprint; failed authentications are counted
(ServerCounters.auth_failures, StatusReply.auth_failures) and logged at most once per
`log_interval_s` with the count of those not logged. Peers of the previous protocol version are
admitted too (wire.ACCEPTED_VERSIONS) when `compat` names it and the server holds no secret: v3
authenticates one way only, so a secret holder never admits it (nor does its client speak it).

wire_protection (`protection`): "aead" seals every frame and KV byte after the handshake
(sealed.py); it needs the secret, admits only v4 peers that run "aead" too (the refusal names both
values), and offers no nixl path (NIXL moves the bytes outside the sealed socket). A sealed record
that fails its tag is counted (ServerCounters.integrity_failures, StatusReply.integrity_failures),
answered with a typed auth refusal in the other direction, and its connection closed; the server
keeps serving the others.
"""

from __future__ import annotations

import hmac
import socket
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvconnectors.errors import ConfigError, FailureCause, TransferError, UnknownTransferError
from kvconnectors.logs import LogLimiter, get_logger
from kvconnectors.store import TieredStore
from kvconnectors.transport import auth, wire
from kvconnectors.transport.admission import Admission, Caps, Seat, peer_key
from kvconnectors.transport.auth import Session
from kvconnectors.transport.faults import FaultPlan, FaultRule, with_fault
from kvconnectors.transport.landing import ConnectionState, Landing
from kvconnectors.transport.nixl import NixlSource
from kvconnectors.transport.paths import (PULL_UNOFFERED, SHM_PULL, TCP_PULL, NixlPull, PullPath, ReadContext, TcpHeadsPull,
                                         offered)
from kvconnectors.transport.protocol import check_protection, peer_name, trailing_bytes

logger = get_logger(__name__)
MAX_RENEW = wire.MAX_RENEW  # transfer ids per Renew message
HANDSHAKE_TIMEOUT_S = 2.0   # accept to authenticated, every step together
MAX_GRANTS = 1 << 16        # remembered transfer tokens beyond which those of ended transfers are forgotten


@dataclass
class ServerCounters:
    connections: int = 0
    active_connections: int = 0
    auth_failures: int = 0
    integrity_failures: int = 0
    rejected: dict[str, int] = field(default_factory=dict)  # cause -> count
    bytes_sent: int = 0
    reads: int = 0

    def reject(self, cause: str) -> None:
        self.rejected[cause] = self.rejected.get(cause, 0) + 1


class StoreServer:
    """Serves `store` on (host, port); port 0 picks a free one (see `.port`)."""

    def __init__(self, store: TieredStore, host: str, port: int, *, fingerprint: str,
                 num_layers: int, compat: str | Mapping[int, str], secret: bytes | None = None,
                 idle_timeout_s: float = 300.0, seal_wait_s: float = 10.0,
                 staging_failure: Callable[[str], TransferError | None] | None = None,
                 faults: FaultPlan | None = None, max_connections: int = 256, nixl: bool = False,
                 landing: Landing | None = None, paths: Sequence[PullPath] | None = None,
                 handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S, max_pending: int = 64,
                 max_pending_per_peer: int | None = None, max_per_peer: int = 64,
                 max_pending_per_prefix: int | None = None,
                 require_grants: bool = False, max_grants: int = MAX_GRANTS, log_interval_s: float = 10.0,
                 protection: str = wire.HANDSHAKE, rows_fingerprint: str = "", row_layout: Any = None,
                 tp_size: int = 0):
        """`compat`: the hash peers must present, or one per admitted protocol version
        (wire.compat_hashes: peers of the previous version too). `paths`: the pull data paths
        offered (default: tcp, shm when the store has an arena, nixl when `nixl`, tcp of some KV
        heads per row when `row_layout`, a mover.reslice.RowLayout, says how to slice the rows).
        `require_grants`: an id never granted a token is unknown (a producer's server, where every
        transfer is granted when its staging starts). `protection`: the wire_protection setting.
        `rows_fingerprint`: a Read may present it instead of `fingerprint` (a consumer holding a
        previous-version ticket, which carries it). `tp_size`: the TP size of the instance this
        store belongs to, said in StatusReply (a producer pushing to another TP size plans by it)."""
        check_protection(protection, secret)
        if protection == wire.AEAD and (nixl or (paths is not None and any(p.name == NixlPull.name for p in paths))):
            raise ConfigError("wire_protection", protection, (
                "cannot seal transport 'nixl': NIXL moves the KV bytes itself, outside the sealed connection; "
                "use transport tcp (or shm on one host) with aead"))
        self.protection = protection
        self.store, self.fingerprint, self.num_layers = store, fingerprint, num_layers
        self.rows_fingerprint = rows_fingerprint or fingerprint
        self.tp_size = tp_size
        self.compat = dict(compat) if isinstance(compat, Mapping) else {wire.PROTOCOL_VERSION: compat}
        self.secret = secret
        self.idle_timeout_s, self.seal_wait_s = idle_timeout_s, seal_wait_s
        self.handshake_timeout_s = handshake_timeout_s
        self.staging_failure = staging_failure or (lambda tid: None)
        self.counters = ServerCounters()
        self.faults = faults
        self.landing = landing  # push mode: producers stream KV into this store (consumer side)
        caps = Caps(max_connections=max_connections, max_per_peer=max_per_peer, max_pending=max_pending,
                    max_pending_per_peer=max_pending_per_peer, max_pending_per_prefix=max_pending_per_prefix)
        self.admission = Admission(caps, on_evict=self.counters.reject)
        self.require_grants, self.max_grants = require_grants, max_grants
        self.log = LogLimiter(logger, log_interval_s)
        self._lock = threading.Lock()
        self._sealed = threading.Condition()
        self._grants: OrderedDict[str, str] = OrderedDict()
        self._grants_lock = threading.Lock()
        self._closed = False
        if paths is None:
            # nixl: one agent for the server's life, the whole arena registered once (TransferError if
            # NIXL cannot start); consumers READ from it, this server only progresses it during reads.
            paths = [TCP_PULL] + ([SHM_PULL] if store.shm_path is not None else []) + (
                [NixlPull(source=NixlSource(store.arena_base_address, store.arena_bytes,
                                            tag=store.config.instance_name))] if nixl else []) + (
                [TcpHeadsPull(row_layout)] if row_layout is not None else [])
        self.paths: dict[str, PullPath] = {p.name: p for p in paths}
        self._listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._listener.bind((host, port))
        except OSError as exc:
            self._listener.close()
            self._close_paths()
            raise OSError(exc.errno, f"kvconnectors store server cannot bind {host}:{port}: {exc.strerror}") from None
        self._listener.listen(512)
        self.host, self.port = self._listener.getsockname()[:2]
        # A blocking accept() in its own thread: no polling while idle; close() wakes it.
        self._thread = threading.Thread(target=self._accept_loop, name="kvc-store-server", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                sock, addr = self._listener.accept()
            except OSError as exc:
                if self._closed:
                    return  # listener shut down
                # EMFILE / ENFILE / ECONNABORTED: keep accepting once descriptors are free again
                self.log.warning("accept", "store server %s:%s cannot accept a connection: %s", self.host,
                                 self.port, exc)
                time.sleep(0.05)
                continue
            seat = self._admit(sock, addr)
            if isinstance(seat, str):
                self.counters.reject(seat)
                self.log.warning("cap", "refused a connection from %s: %s", peer_key(addr), seat.replace("_", " "))
                _close_now(sock)
                continue
            try:
                threading.Thread(target=self._serve_connection, args=(sock, seat, time.monotonic()),
                                 name="kvc-store-conn", daemon=True).start()
            except RuntimeError:  # cannot start a thread: refuse this peer, keep accepting
                self.admission.leave(seat)
                self.counters.reject("too_many_connections")
                _close_now(sock)

    def _admit(self, sock: socket.socket, addr: tuple) -> Seat | str:
        """Count the connection in (its seat), closing what makes room for it, or say which cap
        refuses it."""
        seat, refused, evicted = self.admission.admit(sock, addr)
        if seat is None:
            return refused
        with self._lock:
            self.counters.connections += 1
        for other in evicted:  # its thread wakes, sees the seat gone, and ends
            try:
                other.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        return seat

    # ------------------------------------------------------------------ capabilities
    def grant(self, transfer_id: str, token: str) -> None:
        """From now on, `transfer_id` answers only to `token` (the ticket's). Bounded: beyond
        max_grants the oldest grants of transfers the store no longer holds are forgotten first."""
        if not token:
            return
        with self._grants_lock:
            self._grants[transfer_id] = token
            self._grants.move_to_end(transfer_id)
            if len(self._grants) > self.max_grants:
                self._prune_grants()

    def revoke(self, transfer_id: str) -> None:
        with self._grants_lock:
            self._grants.pop(transfer_id, None)

    @property
    def grants(self) -> int:
        with self._grants_lock:
            return len(self._grants)

    def _prune_grants(self) -> None:
        """Forget the grants of transfers the store no longer holds, oldest first, down to 3/4 of
        max_grants. A live transfer's grant is never forgotten (on a server without require_grants
        that would open it to any peer): live grants are bounded by the store's live entries, each
        of which holds at least one slot."""
        target = self.max_grants * 3 // 4
        for tid in list(self._grants):
            if len(self._grants) <= target:
                return
            if not self.store.contains(tid):
                del self._grants[tid]
        if len(self._grants) > self.max_grants:
            self.log.warning("grants", "store server: %d live transfers hold tokens (max_grants %d); keeping them",
                             len(self._grants), self.max_grants)

    def _authorized(self, transfer_id: str, token: str) -> bool:
        with self._grants_lock:
            want = self._grants.get(transfer_id)
        if want is None and self.landing is not None:
            want = self.landing.token_of(transfer_id)  # a pushed entry: its pushes' token ("": none)
            if want is None and self.store.contains(transfer_id):
                return False  # landed, its token no longer known (forgotten, or going): it answers nobody
        if want is None:
            return not self.require_grants
        return bool(token) and hmac.compare_digest(want.encode(), token.encode())

    def _check_token(self, transfer_id: str, token: str) -> None:
        if not self._authorized(transfer_id, token):  # worded exactly as the store words an unknown id
            raise UnknownTransferError(f"transfer {transfer_id!r} is not in this store")

    # ------------------------------------------------------------------ lifecycle
    def notify_sealed(self) -> None:
        with self._sealed:
            self._sealed.notify_all()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        except OSError:
            pass
        self._listener.close()
        for c in self.admission.sockets():  # unblock handler threads stuck in recv
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._thread.join(timeout=5)
        self._close_paths()
        if self.landing is not None:
            self.landing.close()

    def _close_paths(self) -> None:
        for path in self.paths.values():
            path.close()

    @property
    def nixl(self) -> NixlSource | None:
        """The agent consumers READ this store's arena through (transport nixl), else None."""
        path = self.paths.get(NixlPull.name)
        return getattr(path, "source", None)

    # the caps, as admission.py holds them (read by operators and the DoS tests)
    max_connections = property(lambda self: self.admission.caps.max_connections)
    max_per_peer = property(lambda self: self.admission.caps.max_per_peer)
    max_pending = property(lambda self: self.admission.caps.max_pending)
    max_pending_per_peer = property(lambda self: self.admission.caps.pending_per_peer)

    @property
    def active_connections(self) -> int:
        return len(self.admission)

    # ------------------------------------------------------------------ per connection
    def _serve_connection(self, sock: socket.socket, seat: Seat, accepted_at: float | None = None) -> None:
        conn = ConnectionState(peer_name(sock))
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            session = self._handshake(sock, (accepted_at or time.monotonic()) + self.handshake_timeout_s, seat)
            if session is None:
                return  # refused, or closed to make room before it was admitted
            # landing.py binds the transfers a connection creates to conn.owner: the session's id (from
            # the authenticated transcript under a secret, else random; unique per connection either way)
            conn.session = session
            conn.owner = ("session", session.id)
            io = self._seal(sock, session) if session.protection == wire.AEAD else sock
            while True:
                try:
                    msg = wire.recv_msg(io, deadline=time.monotonic() + self.idle_timeout_s)
                except TransferError as exc:
                    if exc.cause is FailureCause.PROTOCOL:
                        self.counters.reject("protocol")
                        wire.send_refusal(io, exc)
                    return  # peer closed, idle, sent garbage or a record that failed its tag: drop it only
                if not self.admission.begin(seat):
                    return  # closed to make room just as the request arrived: unanswered, as a dropped line
                try:
                    if not self._dispatch(io, msg, conn, session.version, session) or getattr(io, "broken", None):
                        return
                finally:
                    self.admission.end(seat)
        except OSError:
            pass
        except Exception as exc:  # a bug: close this connection, log it (rate-limited), keep serving
            self.counters.reject("internal")
            self.log.warning("internal", "store server: internal error on the connection from %s: %r",
                             peer_name(sock), exc, exc_info=True)
        finally:
            if self.landing is not None and conn.open:
                try:
                    self.landing.connection_closed(conn)
                except Exception as exc:
                    self.log.warning("internal", "store server: landing cleanup for %s failed: %r",
                                     conn.peer, exc, exc_info=True)
            self.admission.leave(seat)
            sock.close()

    def _seal(self, sock: socket.socket, session: Session):
        from kvconnectors.transport.sealed import SealedSocket, direction_keys

        assert session.key is not None  # aead admits only v4 peers that proved the secret
        send_key, recv_key = direction_keys(session.key, client=False)
        return SealedSocket(sock, send_key=send_key, recv_key=recv_key, peer=f"consumer {session.peer}",
                            on_failure=self._integrity_failed)

    def _integrity_failed(self, sock, error: TransferError) -> None:
        """A sealed record failed its tag: count it, say so in the direction that is intact, hang up."""
        with self._lock:
            self.counters.integrity_failures += 1
        self.counters.reject("integrity")
        self.log.warning("integrity", "store server: %s (%d integrity failures so far)", error.detail,
                         self.counters.integrity_failures)
        wire.send_refusal(sock, TransferError(FailureCause.AUTH, (
            "a sealed record from this side failed its integrity check on the store server "
            "(changed on the way, replayed or reordered); the server closes this connection")))
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _handshake(self, sock: socket.socket, deadline: float, seat: Seat | None = None) -> Session | None:
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
        refused = wire.check_hello(hello, self.compat)
        if refused:
            self.counters.reject("protocol")
            ours = max(self.compat)
            self.log.warning("hello", "refused peer %s: %s; this server speaks v%d compat %s", peer, refused,
                             ours, self.compat[ours])
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
        with self._lock:
            self.counters.auth_failures += 1
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

    def _dispatch(self, sock: socket.socket, msg: wire.Message, conn: ConnectionState,
                  version: int = wire.PROTOCOL_VERSION, session: Session | None = None) -> bool:
        """Answer one request; False when the connection must close."""
        session = session or Session(id="", version=version, authenticated=False, mutual=False, peer=conn.peer)
        fault = self._fault(msg)
        if fault is not None and fault.action in ("drop", "disconnect"):
            if fault.action == "disconnect":
                sock.shutdown(socket.SHUT_RDWR)
            return True  # drop: never answer; the peer's deadline must catch it
        try:
            try:
                wire.check_since(msg, version)  # an older peer: only what its version had
            except TransferError as exc:
                if isinstance(msg, wire.Push) and trailing_bytes(msg):
                    self.counters.reject(exc.cause.value)
                    wire.send_refusal(sock, exc)
                    sock.shutdown(socket.SHUT_RDWR)  # the pushed bytes are not read
                    return True
                raise
            if session.protection == wire.AEAD and getattr(msg, "data_path", "inline") not in _SEALED_PATHS:
                # nothing trails such a frame (its bytes would come through NIXL): the stream stays in step
                raise TransferError(FailureCause.PROTOCOL, (
                    f"data_path {msg.data_path!r} is not sealed under wire_protection 'aead' (NIXL moves the "
                    f"bytes outside this connection); use one of {', '.join(_SEALED_PATHS)}"))
            if isinstance(msg, wire.Read):
                self._read(sock, msg, fault, session)
            elif isinstance(msg, wire.Renew):
                self._renew(sock, msg)
            elif isinstance(msg, wire.Release):
                self._release(sock, msg)
            elif isinstance(msg, wire.Status):
                self._status(sock)
            elif isinstance(msg, wire.Locate):
                self._locate(sock, msg)
            elif isinstance(msg, (wire.Push, wire.PushEnd)):
                if self.landing is None:
                    if isinstance(msg, wire.Push) and trailing_bytes(msg):
                        wire.send_refusal(sock, TransferError(FailureCause.PROTOCOL, (
                            "this store server does not accept pushes (start the consumer with "
                            "transfer_mode 'push')")))
                        sock.shutdown(socket.SHUT_RDWR)  # the pushed bytes are not read
                        return True
                    raise TransferError(FailureCause.PROTOCOL, "this store server does not accept pushes "
                                                               "(start the consumer with transfer_mode 'push')")
                if isinstance(msg, wire.Push):
                    self.landing.handle_push(sock, msg, conn, fault)
                else:
                    self.landing.handle_end(sock, msg, conn)
            else:
                raise TransferError(FailureCause.PROTOCOL, f"unexpected message {type(msg).__name__}")
        except TransferError as exc:
            self.counters.reject(exc.cause.value)
            wire.send_refusal(sock, exc, read=isinstance(msg, wire.Read))
        except OSError:
            raise
        except Exception as exc:
            # A bug (IndexError, ValueError, ...): this request may have half-answered, so the
            # connection is out of step. Say so where nothing streams after the reply, then close.
            self.counters.reject("internal")
            self.log.warning("internal", "store server: internal error on %s from %s: %r", type(msg).__name__,
                             conn.peer, exc, exc_info=True)
            if not isinstance(msg, (wire.Read, wire.Push)):
                wire.send_refusal(sock, TransferError(FailureCause.PROTOCOL, (
                    f"internal error on {type(msg).__name__}; the server closes this connection")))
            return False
        return True

    def _fault(self, msg: wire.Message) -> FaultRule | None:
        if self.faults is None:
            return None
        event = {wire.Read: "read", wire.Renew: "renew", wire.Release: "release", wire.Push: "push",
                 wire.PushEnd: "push_end"}.get(type(msg))
        fault = self.faults.decide(event, getattr(msg, "num_blocks", 0)) if event else None
        if fault is not None:
            logger.warning("fault injection: %s on %s", fault.action, event)
            if fault.action == "delay":
                time.sleep(fault.delay_s)
        return fault

    # ------------------------------------------------------------------ requests
    def _validate_read(self, msg: wire.Read, session: Session | None = None) -> PullPath:
        wire.check_transfer_id(msg.transfer_id)
        ours = self.rows_fingerprint if msg.fingerprint == self.rows_fingerprint else self.fingerprint
        wire.check_fingerprint(msg.fingerprint, ours, peer="consumer", us="producer",
                               reveal=session is not None and session.authenticated)
        wire.check_layers(msg.layers, self.num_layers)
        if not (0 <= msg.first_block < MAX_BLOCKS and 1 <= msg.num_blocks <= MAX_BLOCKS):
            raise TransferError(FailureCause.PROTOCOL,
                                f"bad block range first_block={msg.first_block} num_blocks={msg.num_blocks}")
        path = offered(self.paths, msg.data_path, PULL_UNOFFERED, "data_path")
        self._check_token(msg.transfer_id, msg.token)
        return path

    def _wait_sealed(self, tid: str) -> None:
        deadline = time.monotonic() + self.seal_wait_s
        with self._sealed:
            while True:
                failure = self.staging_failure(tid)
                if failure is not None:
                    raise failure
                if self.store.is_sealed(tid):  # typed LeaseExpired / UnknownTransfer if gone
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransferError(FailureCause.TIMEOUT, f"transfer {tid!r} was not fully staged in time")
                self._sealed.wait(left)

    def _read(self, sock: socket.socket, msg: wire.Read, fault: FaultRule | None = None,
              session: Session | None = None) -> None:
        path = with_fault(self._validate_read(msg, session), fault)
        self._wait_sealed(msg.transfer_id)
        ttl = self.store.renew(msg.transfer_id)  # a consumer pulling keeps the lease alive
        info = self.store.info(msg.transfer_id)
        last = msg.first_block + msg.num_blocks
        if last > info.num_blocks:
            raise TransferError(FailureCause.LAYOUT_MISMATCH, (
                f"asked for blocks [{msg.first_block}, {last}) of a {info.num_blocks}-block transfer"))
        sums = (self.store.checksums(msg.transfer_id) or {}).get("xxh3")
        checksums = None if sums is None else [
            sums[layer * info.num_blocks + b] for layer in msg.layers for b in range(msg.first_block, last)]
        path.serve(self._read_context(), sock, msg, info.nvme_slots, ttl, checksums)

    # ------------------------------------------------------------------ for the data paths
    def _read_context(self) -> ReadContext:
        """What a path's source end is given to serve one read: never this server itself."""
        return ReadContext(store=self.store, idle_timeout_s=self.idle_timeout_s, count_read=self.count_read,
                           reject=self.counters.reject, finish_offset_read=self.finish_offset_read, log=logger)

    def count_read(self, nbytes: int) -> None:
        with self._lock:
            self.counters.bytes_sent += nbytes
            self.counters.reads += 1

    def finish_offset_read(self, sock: socket.socket, msg: wire.Read, path: str, done: wire.Message,
                           nbytes: int) -> None:
        """The consumer's answer to a read it fetched itself from offsets: Release (done: count it,
        release the entry), Ack(ok=True) (done: count it, keep the entry, which other consumer
        ranks read too, until the consumer's lease keeper releases it), Ack(ok=False) (its fetch
        failed: the entry stays for a retry), or anything else, out of protocol while a read is
        open (dispatching it here would nest pins without bound): drop the connection."""
        if isinstance(done, wire.Release):
            self.count_read(nbytes)
            self._release(sock, done)
        elif isinstance(done, wire.Ack) and done.ok:
            self.count_read(nbytes)
        elif isinstance(done, wire.Ack) and not done.ok:
            logger.info("consumer %s failed its %s read of %s: [%s] %s", peer_name(sock), path,
                        msg.transfer_id, done.cause, done.message)
        elif not isinstance(done, wire.Ack):
            self.counters.reject("protocol")
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _renew(self, sock: socket.socket, msg: wire.Renew) -> None:
        remaining: dict[str, float] = {}
        missing: dict[str, str] = {}
        if len(msg.transfer_ids) > MAX_RENEW:
            raise TransferError(FailureCause.PROTOCOL, f"{len(msg.transfer_ids)} transfer ids in one Renew; "
                                                       f"the limit is {MAX_RENEW}")
        if msg.tokens is not None and len(msg.tokens) != len(msg.transfer_ids):
            raise TransferError(FailureCause.PROTOCOL, f"a Renew with {len(msg.tokens)} tokens for "
                                                       f"{len(msg.transfer_ids)} transfer ids")
        size = wire.renew_bytes(msg.transfer_ids, msg.tokens)
        if size > wire.MAX_RENEW_BYTES:  # its reply might not fit a frame
            raise TransferError(FailureCause.PROTOCOL, f"a Renew of {size} bytes of ids and tokens; the limit "
                                                       f"is {wire.MAX_RENEW_BYTES} (split it)")
        for i, tid in enumerate(msg.transfer_ids):
            if not self._authorized(tid, msg.tokens[i] if msg.tokens is not None else ""):
                missing[tid] = FailureCause.UNKNOWN_TRANSFER.value
                continue
            try:
                remaining[tid] = self.store.renew(tid)
            except TransferError as exc:
                missing[tid] = exc.cause.value
        wire.send_msg(sock, wire.RenewReply(remaining=remaining, missing=missing), limit=wire.MAX_CONTROL_BYTES)

    def _status(self, sock: socket.socket) -> None:
        usage = self.store.usage()
        counters = {k: int(v) for k, v in self.store.stats.snapshot().items() if isinstance(v, (int, float))}
        wire.send_msg(sock, wire.StatusReply(
            entries=usage["entries"], dram_used_bytes=usage["dram"]["used_bytes"],
            nvme_used_bytes=usage["nvme"]["used_bytes"], pinned=usage["pinned"],
            active_connections=self.active_connections - 1, counters=counters,  # minus this one
            rejected=dict(self.counters.rejected), auth_failures=self.counters.auth_failures,
            integrity_failures=self.counters.integrity_failures, tp_size=self.tp_size),
            limit=wire.MAX_CONTROL_BYTES)

    def _locate(self, sock: socket.socket, msg: wire.Locate) -> None:
        try:
            self._check_token(msg.transfer_id, msg.token)
            info = self.store.info(msg.transfer_id)
        except TransferError:
            wire.send_msg(sock, wire.LocateReply(found=False))
            return
        wire.send_msg(sock, wire.LocateReply(found=True, dram_slots=info.dram_slots, nvme_slots=info.nvme_slots))

    def _release(self, sock: socket.socket, msg: wire.Release) -> None:
        self._check_token(msg.transfer_id, msg.token)
        self.store.release(msg.transfer_id)  # no-op for an entry that already ended
        wire.send_msg(sock, wire.Ack(ok=True))


_SEALED_PATHS = ("inline", "inline_heads", "shm")  # aead: on the sealed socket, or same-host memory (never the network)
MAX_BLOCKS = 1 << 24  # blocks of one read (a prompt of 16M tokens at block size 1)


def _close_now(sock: socket.socket) -> None:
    """Close a refused connection at once, with a reset (no TIME_WAIT, no read)."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()
