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

Per-transfer capabilities (grants.py): the worker `grant`s each staged transfer the token of its
ticket; Read, Renew, Release and Locate of a granted transfer must present that token, and a wrong
or missing one is answered exactly like an unknown id. With `require_grants` (a producer's server)
an id never granted is unknown too. Refusals sent to a peer that has not authenticated name
neither this server's compat hash nor its layout fingerprint; failed authentications are counted
(ServerCounters.auth_failures, StatusReply.auth_failures) and logged at most once per
`log_interval_s` with the count of those not logged (handshake.py). Peers of the previous protocol
version are admitted too (wire.ACCEPTED_VERSIONS) when `compat` names it and the server holds no
secret: v3 authenticates one way only, so a secret holder never admits it (nor does its client speak it).

wire_protection (`protection`): "aead" seals every frame and KV byte after the handshake
(sealed.py); it needs the secret, admits only v4 peers that run "aead" too (the refusal names both
values), and offers no nixl path (NIXL moves the bytes outside the sealed socket). A sealed record
that fails its tag is counted (ServerCounters.integrity_failures, StatusReply.integrity_failures),
answered with a typed auth refusal in the other direction, and its connection closed; the server
keeps serving the others.

The parts, each constructed here once and owning its state (calls flow from this module down):
    server_settings.ServerSettings  every value the server is started with, checked
    admission.Admission             connection caps (accept thread, connection threads)
    handshake.Handshake             Hello and the secret's proofs -> a Session
    grants.Grants                   per-transfer tokens (asks the landing table of pushed entries)
    pull_service.PullService        Read, Renew, Release, Locate, Status
    landing.Landing                 push mode: its receiver takes Push and PushEnd (consumer side)
    server_counters.ServerCounters  what every part counts
This module accepts, hands each connection to its thread, and dispatches each request to its part.
Fault plans (faults.py, tests and chaos runs) are asked here per request, before anything else, and
stay replaceable on a running server (`faults`).
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvconnectors.errors import ConfigError, FailureCause, TransferError
from kvconnectors.logs import LogLimiter, get_logger
from kvconnectors.store import TieredStore
from kvconnectors.transport import wire
from kvconnectors.transport.admission import Admission, Seat, peer_key
from kvconnectors.transport.auth import Session
from kvconnectors.transport.faults import FaultPlan, FaultRule
from kvconnectors.transport.grants import Grants
from kvconnectors.transport.handshake import Handshake
from kvconnectors.transport.landed_entries import ConnectionState
from kvconnectors.transport.landing import Landing
from kvconnectors.transport.nixl import NixlSource
from kvconnectors.transport.paths import SHM_PULL, TCP_PULL, NixlPull, PullPath, TcpHeadsPull
from kvconnectors.transport.protocol import peer_name, trailing_bytes
from kvconnectors.transport.pull_service import PullService
from kvconnectors.transport.server_counters import ServerCounters
from kvconnectors.transport.server_settings import FIELDS as SETTINGS_FIELDS
from kvconnectors.transport.server_settings import SERVER_LOGGER, ServerSettings

__all__ = ["ServerSettings", "StoreServer"]  # ServerSettings: what callers construct a server with

logger = get_logger(SERVER_LOGGER)


class StoreServer:
    """Serves `store` on (host, port); port 0 picks a free one (see `.port`)."""

    def __init__(self, store: TieredStore, host: str, port: int, settings: ServerSettings | None = None, *,
                 landing: Landing | None = None, paths: Sequence[PullPath] | None = None,
                 row_layout: Any = None, staging_failure: Callable[[str], TransferError | None] | None = None,
                 faults: FaultPlan | None = None, **fields: Any):
        """`settings`, or its fields as keywords (ServerSettings documents each). The collaborators:
        `landing` (push mode: producers stream KV into this store, consumer side); `paths`: the
        pull data paths offered (default: tcp, shm when the store has an arena, nixl when
        `settings.nixl`, tcp of some KV heads per row when `row_layout`, a mover.reslice.RowLayout,
        says how to slice the rows); `staging_failure(transfer_id)`: why its staging failed, or
        None; `faults`: a fault plan (tests and chaos runs)."""
        if settings is None:
            settings = ServerSettings(**fields)
        elif fields:
            raise TypeError(f"StoreServer takes settings or their fields, not both: {sorted(fields)}")
        if settings.protection == wire.AEAD and (
                settings.nixl or (paths is not None and any(p.name == NixlPull.name for p in paths))):
            raise ConfigError("wire_protection", settings.protection, (
                "cannot seal transport 'nixl': NIXL moves the KV bytes itself, outside the sealed connection; "
                "use transport tcp (or shm on one host) with aead"))
        self.settings, self.store, self._landing, self.faults = settings, store, landing, faults
        self.counters = ServerCounters()
        self.admission = Admission(settings.caps, on_evict=self.counters.reject)
        self.log = LogLimiter(logger, settings.log_interval_s)
        self.capabilities = Grants(store, max_grants=settings.max_grants, require_grants=settings.require_grants,
                                   log=self.log, landed_token=landing.entries.token_of if landing is not None else None)
        self.handshake = Handshake(settings, self.admission, self.counters, self.log)
        self._closed = False
        if paths is None:
            # nixl: one agent for the server's life, the whole arena registered once (TransferError if
            # NIXL cannot start); consumers READ from it, this server only progresses it during reads.
            paths = [TCP_PULL] + ([SHM_PULL] if store.shm_path is not None else []) + (
                [NixlPull(source=NixlSource(store.arena_base_address, store.arena_bytes,
                                            tag=store.config.instance_name))] if settings.nixl else []) + (
                [TcpHeadsPull(row_layout)] if row_layout is not None else [])
        self.paths: dict[str, PullPath] = {p.name: p for p in paths}  # the pull service's: one dict
        self.pulls = PullService(store, settings, self.capabilities, self.paths, self.counters,
                                 active_connections=self.admission.__len__, staging_failure=staging_failure)
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


    @property
    def landing(self) -> Landing | None:
        """The landing receiver (push mode). Fixed at construction: the grants consult its table."""
        return self._landing

    def __setattr__(self, name: str, value: object) -> None:
        # The settings are read once by the parts at construction (handshake, grants, pull service):
        # assigning one later would silently change nothing, so it is refused (security ones fail open).
        if name in SETTINGS_FIELDS:
            raise AttributeError(f"StoreServer.{name} is a setting, fixed at construction (ServerSettings)")
        super().__setattr__(name, value)
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
        self.counters.count_connection()
        for other in evicted:  # its thread wakes, sees the seat gone, and ends
            try:
                other.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        return seat

    # ------------------------------------------------------------------ for the worker and operators
    def grant(self, transfer_id: str, token: str) -> None:
        """From now on, `transfer_id` answers only to `token` (grants.py)."""
        self.capabilities.grant(transfer_id, token)

    def revoke(self, transfer_id: str) -> None:
        self.capabilities.revoke(transfer_id)

    @property
    def grants(self) -> int:
        """How many grants are remembered."""
        return len(self.capabilities)

    def notify_sealed(self) -> None:
        self.pulls.notify_sealed()

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

    handshake_timeout_s = property(lambda self: self.settings.handshake_timeout_s)

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
            deadline = (accepted_at or time.monotonic()) + self.settings.handshake_timeout_s
            session = self._handshake(sock, deadline, seat)
            if session is None:
                return  # refused, or closed to make room before it was admitted
            # landing.py binds the transfers a connection creates to conn.owner: the session's id (from
            # the authenticated transcript under a secret, else random; unique per connection either way)
            conn.session = session
            conn.owner = ("session", session.id)
            io = self._seal(sock, session) if session.protection == wire.AEAD else sock
            while True:
                try:
                    msg = wire.recv_msg(io, deadline=time.monotonic() + self.settings.idle_timeout_s)
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
                    self.landing.receiver.connection_closed(conn)
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
        self.counters.count_integrity_failure()
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
        """The peer's session once admitted, else None (handshake.py)."""
        return self.handshake.run(sock, deadline, seat)

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
                self.pulls.read(sock, msg, fault, session)
            elif isinstance(msg, wire.Renew):
                self.pulls.renew(sock, msg)
            elif isinstance(msg, wire.Release):
                self.pulls.release(sock, msg)
            elif isinstance(msg, wire.Status):
                self.pulls.status(sock)
            elif isinstance(msg, wire.Locate):
                self.pulls.locate(sock, msg)
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
                    self.landing.receiver.handle_push(sock, msg, conn, fault)
                else:
                    self.landing.receiver.handle_end(sock, msg, conn)
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


_SEALED_PATHS = ("inline", "inline_heads", "shm")  # aead: on the sealed socket, or same-host memory (never the network)


def _close_now(sock: socket.socket) -> None:
    """Close a refused connection at once, with a reset (no TIME_WAIT, no read)."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()
