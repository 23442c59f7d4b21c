"""The store server: serves staged KV to consumers over the control protocol.

One thread per connection, blocking sockets: an idle server costs no CPU. Every request is
validated before it touches the store; a bad request gets a typed error reply and the
connection (and the server) keep serving. The data paths it offers (paths.py) move the bytes;
peers of the previous protocol version are admitted too (wire.ACCEPTED_VERSIONS).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from kvconnectors.errors import FailureCause, TransferError
from kvconnectors.logs import get_logger
from kvconnectors.store import TieredStore
from kvconnectors.transport import auth, wire
from kvconnectors.transport.faults import FaultPlan, FaultRule, with_fault
from kvconnectors.transport.landing import ConnectionState, Landing
from kvconnectors.transport.nixl import NixlSource
from kvconnectors.transport.paths import (PULL_UNOFFERED, SHM_PULL, TCP_PULL, NixlPull, PullPath, offered,
                                         trailing_bytes)

logger = get_logger(__name__)
MAX_RENEW = 4096  # transfer ids per Renew message


@dataclass
class ServerCounters:
    connections: int = 0
    active_connections: int = 0
    auth_failures: int = 0
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
                 landing: Landing | None = None, paths: Sequence[PullPath] | None = None):
        """`compat`: the hash peers must present, or one per admitted protocol version
        (wire.compat_hashes: peers of the previous version too). `paths`: the pull data paths
        offered (default: tcp, shm when the store has an arena, nixl when `nixl`)."""
        self.store, self.fingerprint, self.num_layers = store, fingerprint, num_layers
        self.compat = dict(compat) if isinstance(compat, Mapping) else {wire.PROTOCOL_VERSION: compat}
        self.secret = secret
        self.idle_timeout_s, self.seal_wait_s = idle_timeout_s, seal_wait_s
        self.staging_failure = staging_failure or (lambda tid: None)
        self.counters = ServerCounters()
        self.faults = faults
        self.landing = landing  # push mode: producers stream KV into this store (consumer side)
        self.max_connections = max_connections
        self._lock = threading.Lock()
        self._sealed = threading.Condition()
        self._conns: set[socket.socket] = set()
        self._closed = False
        if paths is None:
            # nixl: one agent for the server's life, the whole arena registered once (TransferError if
            # NIXL cannot start); consumers READ from it, this server only progresses it during reads.
            paths = [TCP_PULL] + ([SHM_PULL] if store.shm_path is not None else []) + (
                [NixlPull(source=NixlSource(store.arena_base_address, store.arena_bytes,
                                            tag=store.config.instance_name))] if nixl else [])
        self.paths: dict[str, PullPath] = {p.name: p for p in paths}
        self._listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._listener.bind((host, port))
        except OSError as exc:
            self._listener.close()
            self._close_paths()
            raise OSError(exc.errno, f"kvconnectors store server cannot bind {host}:{port}: {exc.strerror}") from None
        self._listener.listen(128)
        self.host, self.port = self._listener.getsockname()[:2]
        # A blocking accept() in its own thread: no polling while idle; close() wakes it.
        self._thread = threading.Thread(target=self._accept_loop, name="kvc-store-server", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return  # listener shut down
            if self.active_connections >= self.max_connections:
                # One thread per connection: bound them, or a flood of idle peers exhausts the worker.
                self.counters.reject("too_many_connections")
                sock.close()
                continue
            try:
                threading.Thread(target=self._serve_connection, args=(sock,), name="kvc-store-conn",
                                 daemon=True).start()
            except RuntimeError:  # cannot start a thread: refuse this peer, keep accepting
                self.counters.reject("too_many_connections")
                sock.close()

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
        with self._lock:
            conns = list(self._conns)
        for c in conns:  # unblock handler threads stuck in recv
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

    @property
    def active_connections(self) -> int:
        with self._lock:
            return len(self._conns)

    # ------------------------------------------------------------------ per connection
    def _serve_connection(self, sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._lock:
            self._conns.add(sock)
            self.counters.connections += 1
        conn = ConnectionState(_peer(sock))
        try:
            version = self._handshake(sock)
            if version is None:
                return
            while True:
                try:
                    msg = wire.recv_msg(sock, deadline=time.monotonic() + self.idle_timeout_s)
                except TransferError as exc:
                    if exc.cause is FailureCause.PROTOCOL:
                        self.counters.reject("protocol")
                        wire.send_refusal(sock, exc)
                    return  # peer closed, idle or sent garbage: drop the connection only
                self._dispatch(sock, msg, conn, version)
        except OSError:
            pass
        finally:
            if self.landing is not None and conn.open:
                self.landing.connection_closed(conn)
            with self._lock:
                self._conns.discard(sock)
            sock.close()

    def _handshake(self, sock: socket.socket) -> int | None:
        """The peer's protocol version once it is admitted; None when refused."""
        try:
            hello = wire.recv_msg(sock, deadline=time.monotonic() + 10)
        except TransferError:
            self.counters.reject("protocol")
            return None
        if not isinstance(hello, wire.Hello):
            self.counters.reject("protocol")
            wire.send_msg(sock, wire.Welcome(ok=False, error=f"expected Hello, got {type(hello).__name__}"))
            return None
        refused = wire.check_hello(hello, self.compat)
        if refused:
            self.counters.reject("protocol")
            wire.send_msg(sock, wire.Welcome(ok=False, error=refused))
            return None
        if self.secret is None:
            wire.send_msg(sock, wire.Welcome(ok=True))
            return hello.version
        nonce = auth.new_nonce()
        wire.send_msg(sock, wire.Welcome(ok=True, nonce=nonce))
        try:
            proof = wire.recv_msg(sock, deadline=time.monotonic() + 10)
        except TransferError:
            proof = None
        if not isinstance(proof, wire.Proof) or not auth.verify(self.secret, nonce, proof.mac):
            self.counters.auth_failures += 1
            self.counters.reject("auth")
            logger.warning("refused an unauthenticated peer %s", _peer(sock))
            wire.send_msg(sock, wire.Ack(ok=False, cause=FailureCause.AUTH.value,
                                         message="shared-secret authentication failed"))
            return None
        wire.send_msg(sock, wire.Ack(ok=True))
        return hello.version

    def _dispatch(self, sock: socket.socket, msg: wire.Message, conn: ConnectionState,
                  version: int = wire.PROTOCOL_VERSION) -> None:
        fault = self._fault(msg)
        if fault is not None and fault.action in ("drop", "disconnect"):
            if fault.action == "disconnect":
                sock.shutdown(socket.SHUT_RDWR)
            return  # drop: never answer; the peer's deadline must catch it
        try:
            try:
                wire.check_since(msg, version)  # an older peer: only what its version had
            except TransferError as exc:
                if isinstance(msg, wire.Push) and trailing_bytes(msg):
                    self.counters.reject(exc.cause.value)
                    wire.send_refusal(sock, exc)
                    sock.shutdown(socket.SHUT_RDWR)  # the pushed bytes are not read
                    return
                raise
            if isinstance(msg, wire.Read):
                self._read(sock, msg, fault)
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
                        return
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
    def _validate_read(self, msg: wire.Read) -> PullPath:
        wire.check_transfer_id(msg.transfer_id)
        wire.check_fingerprint(msg.fingerprint, self.fingerprint, peer="consumer", us="producer")
        wire.check_layers(msg.layers, self.num_layers)
        if msg.first_block < 0 or msg.num_blocks < 1:
            raise TransferError(FailureCause.PROTOCOL,
                                f"bad block range first_block={msg.first_block} num_blocks={msg.num_blocks}")
        return offered(self.paths, msg.data_path, PULL_UNOFFERED, "data_path")

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

    def _read(self, sock: socket.socket, msg: wire.Read, fault: FaultRule | None = None) -> None:
        path = with_fault(self._validate_read(msg), fault)
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
        path.serve(self, sock, msg, info.nvme_slots, ttl, checksums)

    # ------------------------------------------------------------------ for the data paths
    def count_read(self, nbytes: int) -> None:
        with self._lock:
            self.counters.bytes_sent += nbytes
            self.counters.reads += 1

    def log_failed_read(self, msg: wire.Read, sent: int, nbytes: int, exc: TransferError) -> None:
        logger.warning("read of %s failed after %d of %d bytes: %s", msg.transfer_id, sent, nbytes, exc)

    def log_unreleased(self, msg: wire.Read, path: str, sock: socket.socket, exc: TransferError) -> None:
        logger.info("%s read of %s by %s ended without a release: %s", path, msg.transfer_id, _peer(sock), exc)

    def finish_offset_read(self, sock: socket.socket, msg: wire.Read, path: str, done: wire.Message,
                           nbytes: int) -> None:
        """The consumer's answer to a read it fetched itself from offsets: Release (done: count it,
        release the entry), Ack(ok=False) (its fetch failed: the entry stays for a retry), or
        anything else, out of protocol while a read is open (dispatching it here would nest pins
        without bound): drop the connection."""
        if isinstance(done, wire.Release):
            self.count_read(nbytes)
            self._release(sock, done)
        elif isinstance(done, wire.Ack) and not done.ok:
            logger.info("consumer %s failed its %s read of %s: [%s] %s", _peer(sock), path,
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
        for tid in msg.transfer_ids:
            try:
                remaining[tid] = self.store.renew(tid)
            except TransferError as exc:
                missing[tid] = exc.cause.value
        wire.send_msg(sock, wire.RenewReply(remaining=remaining, missing=missing))

    def _status(self, sock: socket.socket) -> None:
        usage = self.store.usage()
        counters = {k: int(v) for k, v in self.store.stats.snapshot().items() if isinstance(v, (int, float))}
        wire.send_msg(sock, wire.StatusReply(
            entries=usage["entries"], dram_used_bytes=usage["dram"]["used_bytes"],
            nvme_used_bytes=usage["nvme"]["used_bytes"], pinned=usage["pinned"],
            active_connections=self.active_connections - 1, counters=counters,  # minus this one
            rejected=dict(self.counters.rejected)))

    def _locate(self, sock: socket.socket, msg: wire.Locate) -> None:
        try:
            info = self.store.info(msg.transfer_id)
        except TransferError:
            wire.send_msg(sock, wire.LocateReply(found=False))
            return
        wire.send_msg(sock, wire.LocateReply(found=True, dram_slots=info.dram_slots, nvme_slots=info.nvme_slots))

    def _release(self, sock: socket.socket, msg: wire.Release) -> None:
        self.store.release(msg.transfer_id)  # no-op for an entry that already ended
        wire.send_msg(sock, wire.Ack(ok=True))


def _peer(sock: socket.socket) -> str:
    try:
        return "%s:%s" % sock.getpeername()[:2]
    except OSError:
        return "?"
