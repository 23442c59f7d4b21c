"""The store server: serves staged KV to consumers over the control protocol.

One thread per connection, blocking sockets: an idle server costs no CPU. Every request is
validated before it touches the store; a bad request gets a typed error reply and the
connection (and the server) keep serving.
"""

from __future__ import annotations

import socket
import threading

import numpy as np
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvconnectors.errors import FailureCause, TransferError
from kvconnectors.logs import get_logger
from kvconnectors.store import TieredStore
from kvconnectors.transport import auth, wire
from kvconnectors.transport.faults import FaultPlan, FaultRule, corrupted
from kvconnectors.transport.landing import ConnectionState, Landing
from kvconnectors.transport.nixl import NixlSource

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
                 num_layers: int, compat: str, secret: bytes | None = None,
                 idle_timeout_s: float = 300.0, seal_wait_s: float = 10.0,
                 staging_failure: Callable[[str], TransferError | None] | None = None,
                 faults: FaultPlan | None = None, max_connections: int = 256, nixl: bool = False,
                 landing: Landing | None = None):
        self.store, self.fingerprint, self.num_layers = store, fingerprint, num_layers
        self.compat, self.secret = compat, secret
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
        # nixl: one agent for the server's life, the whole arena registered once (TransferError if
        # NIXL cannot start); consumers READ from it, this server only progresses it during reads.
        self.nixl: NixlSource | None = (
            NixlSource(store.arena_base_address, store.arena_bytes, tag=store.config.instance_name) if nixl else None)
        self._listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._listener.bind((host, port))
        except OSError as exc:
            self._listener.close()
            if self.nixl is not None:
                self.nixl.close()
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
        if self.nixl is not None:
            self.nixl.close()
        if self.landing is not None:
            self.landing.close()

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
            if not self._handshake(sock):
                return
            while True:
                try:
                    msg = wire.recv_msg(sock, deadline=time.monotonic() + self.idle_timeout_s)
                except TransferError as exc:
                    if exc.cause is FailureCause.PROTOCOL:
                        self.counters.reject("protocol")
                        wire.send_refusal(sock, exc)
                    return  # peer closed, idle or sent garbage: drop the connection only
                self._dispatch(sock, msg, conn)
        except OSError:
            pass
        finally:
            if self.landing is not None and conn.open:
                self.landing.connection_closed(conn)
            with self._lock:
                self._conns.discard(sock)
            sock.close()

    def _handshake(self, sock: socket.socket) -> bool:
        try:
            hello = wire.recv_msg(sock, deadline=time.monotonic() + 10)
        except TransferError:
            self.counters.reject("protocol")
            return False
        if not isinstance(hello, wire.Hello):
            self.counters.reject("protocol")
            wire.send_msg(sock, wire.Welcome(ok=False, error=f"expected Hello, got {type(hello).__name__}"))
            return False
        if hello.version != wire.PROTOCOL_VERSION or hello.compat_hash != self.compat:
            self.counters.reject("protocol")
            wire.send_msg(sock, wire.Welcome(ok=False, error=(
                f"incompatible peer: its protocol v{hello.version} compat {hello.compat_hash}, "
                f"this server v{wire.PROTOCOL_VERSION} compat {self.compat}")))
            return False
        if self.secret is None:
            wire.send_msg(sock, wire.Welcome(ok=True))
            return True
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
            return False
        wire.send_msg(sock, wire.Ack(ok=True))
        return True

    def _dispatch(self, sock: socket.socket, msg: wire.Message, conn: ConnectionState) -> None:
        fault = self._fault(msg)
        if fault is not None and fault.action in ("drop", "disconnect"):
            if fault.action == "disconnect":
                sock.shutdown(socket.SHUT_RDWR)
            return  # drop: never answer; the peer's deadline must catch it
        try:
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
                    if isinstance(msg, wire.Push) and msg.data_path == "inline" and msg.nbytes:
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
    def _validate_read(self, msg: wire.Read) -> None:
        if not msg.transfer_id or len(msg.transfer_id) > 512:
            raise TransferError(FailureCause.PROTOCOL, f"bad transfer_id {msg.transfer_id[:64]!r}")
        if msg.fingerprint != self.fingerprint:
            raise TransferError(FailureCause.LAYOUT_MISMATCH, (
                f"consumer KV layout {msg.fingerprint} differs from this producer's {self.fingerprint}"))
        if (not msg.layers or len(msg.layers) > self.num_layers or len(set(msg.layers)) != len(msg.layers)
                or any(not 0 <= layer < self.num_layers for layer in msg.layers)):
            raise TransferError(FailureCause.PROTOCOL, (
                f"layers {msg.layers[:8]}{'...' if len(msg.layers) > 8 else ''}: need distinct layers "
                f"in [0, {self.num_layers})"))
        if msg.first_block < 0 or msg.num_blocks < 1:
            raise TransferError(FailureCause.PROTOCOL,
                                f"bad block range first_block={msg.first_block} num_blocks={msg.num_blocks}")
        if msg.data_path not in ("inline", "shm", "nixl"):
            raise TransferError(FailureCause.PROTOCOL, f"unknown data_path {msg.data_path!r}")
        if msg.data_path == "shm" and self.store.shm_path is None:
            raise TransferError(FailureCause.PROTOCOL, "data_path 'shm' asked, but this store has no shm arena")
        if msg.data_path == "nixl" and self.nixl is None:
            raise TransferError(FailureCause.PROTOCOL,
                                "data_path 'nixl' asked, but this producer was not started with transport 'nixl'")

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
        self._validate_read(msg)
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
        if msg.data_path == "inline" and info.nvme_slots:
            # Spilled: stream it from the tiers through a bounce buffer rather than promote the
            # whole entry into DRAM first; it is read once and then released.
            self._send_inline(sock, msg, ttl, checksums, fault, self._layers_from_tiers(msg))
            return
        with self.store.pinned_views(msg.transfer_id, msg.layers) as pv:
            if msg.data_path in ("shm", "nixl"):
                self._serve_offsets(sock, msg, pv, checksums, ttl)
                return
            # a few views of contiguous arena runs per layer, not one per block (cheaper to build)
            layers = (pv.run_views(layer, msg.first_block, last) for layer in msg.layers)
            self._send_inline(sock, msg, ttl, checksums, fault, layers)

    def _layers_from_tiers(self, msg: wire.Read):
        slot = self.store.slot_bytes
        buf = np.empty((msg.num_blocks, slot), dtype=np.uint8)
        for layer in msg.layers:
            self.store.read_into(msg.transfer_id, layer, msg.first_block, buf)
            yield [memoryview(buf.reshape(-1))]  # sent before the next layer overwrites buf

    def _send_inline(self, sock: socket.socket, msg: wire.Read, ttl: float, checksums: list[int] | None,
                     fault: FaultRule | None, layers) -> None:
        nbytes = len(msg.layers) * msg.num_blocks * self.store.slot_bytes
        wire.send_msg(sock, wire.ReadReply(ok=True, nbytes=nbytes, checksums=checksums, lease_ttl_s=ttl))
        action = fault.action if fault is not None else None
        slot = self.store.slot_bytes
        sent = 0
        try:
            for blocks in layers:
                if action == "corrupt":  # per block, whatever runs the views span
                    blocks = [memoryview(corrupted(b[i:i + slot])) for b in blocks for i in range(0, len(b), slot)]
                elif action == "truncate" and sent + sum(len(b) for b in blocks) > nbytes // 2:
                    sock.shutdown(socket.SHUT_RDWR)
                    return
                send_all(sock, blocks)
                sent += sum(len(b) for b in blocks)
        except TransferError as exc:
            # The OK reply is out and bytes may have followed: an error frame now would be read as
            # KV bytes. Hang up instead; the consumer sees a short stream (peer_unreachable).
            logger.warning("read of %s failed after %d of %d bytes: %s", msg.transfer_id, sent, nbytes, exc)
            sock.shutdown(socket.SHUT_RDWR)
            return
        with self._lock:
            self.counters.bytes_sent += nbytes
            self.counters.reads += 1

    def _serve_offsets(self, sock: socket.socket, msg: wire.Read, pv, checksums: list[int] | None,
                       ttl: float) -> None:
        """shm / nixl: reply with arena offsets (plus this agent's metadata for nixl); the consumer
        copies or READs the blocks itself. The entry stays pinned (the caller's with-block) until it
        answers Release (done) or Ack(ok=False) (its copy, READ or checksum check failed: the entry
        stays for a retry). For nixl this thread progresses the agent meanwhile, which the READ's
        target must do, and stops when the answer (or EOF) arrives."""
        last = msg.first_block + msg.num_blocks
        offsets = np.concatenate([pv.offsets(layer)[msg.first_block:last] for layer in msg.layers]).tolist()
        nixl = self.nixl if msg.data_path == "nixl" else None
        where = (dict(nixl_agent_meta=nixl.metadata, nixl_base_address=nixl.base_address) if nixl is not None
                 else dict(shm_path=pv.shm_path or ""))
        wire.send_msg(sock, wire.ReadReply(ok=True, checksums=checksums, offsets=offsets, lease_ttl_s=ttl, **where))
        deadline = time.monotonic() + self.idle_timeout_s
        try:
            if nixl is not None:
                nixl.serve_until_readable(sock, deadline)
            done = wire.recv_msg(sock, deadline)
        except TransferError as exc:
            # The consumer vanished or stalled mid-read: the reply stream is out of step, so drop
            # the connection (the with-block unpins; the lease decides the entry's fate).
            self.counters.reject(exc.cause.value)
            logger.info("%s read of %s by %s ended without a release: %s", msg.data_path, msg.transfer_id,
                        _peer(sock), exc)
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            return
        if isinstance(done, wire.Release):
            with self._lock:
                self.counters.bytes_sent += len(offsets) * pv.slot_bytes
                self.counters.reads += 1
            self._release(sock, done)
        elif isinstance(done, wire.Ack) and not done.ok:
            logger.info("consumer %s failed its %s read of %s: [%s] %s", _peer(sock), msg.data_path,
                        msg.transfer_id, done.cause, done.message)
        elif not isinstance(done, wire.Ack):
            # Anything else while a read is open is out of protocol; dispatching it here would
            # nest pins without bound. Drop the connection.
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


def send_all(sock: socket.socket, views: list[memoryview], batch: int = 512) -> None:
    """Gather-send many buffers with few syscalls (sendmsg), resuming after partial sends."""
    i = 0
    while i < len(views):
        chunk = views[i:i + batch]
        sent = sock.sendmsg(chunk)
        for v in chunk:  # advance past fully sent views; trim a partially sent one
            if sent >= len(v):
                sent -= len(v)
                i += 1
            else:
                views[i] = v[sent:]
                break


def _peer(sock: socket.socket) -> str:
    try:
        return "%s:%s" % sock.getpeername()[:2]
    except OSError:
        return "?"
