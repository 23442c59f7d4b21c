"""Receiving side of push mode: the decode instance's store server lands pushed layer groups in its
own store, under its own lease, and seals them at PushEnd.

    producer (PushSender)                       consumer store server (Landing)
    Push(layers 0-3, blocks, checksums) + bytes  ─▶ create entry at the first Push, check layout,
                                                 receive, verify checksums, write, renew lease
                                            ◀── Ack
    ... one Push per layer group, while the producer's later layers still compute ...
    PushEnd(ok)                                 ─▶ seal: every (layer, block) must have arrived
                                            ◀── Ack                        (consumer's load wakes)

A transfer that cannot land (layout mismatch, store full, bad checksum, producer gone mid-stream,
PushEnd(ok=False)) is dropped at once and its cause remembered, so the consumer's load fails (or
falls back to pulling) with that cause instead of waiting for its deadline. Partial layer sets are
never readable: only sealed entries are.
"""

from __future__ import annotations

import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

import numpy as np
import xxhash

from kvconnectors.errors import FailureCause, StoreFullError, TransferError
from kvconnectors.logs import get_logger
from kvconnectors.store import TieredStore
from kvconnectors.transport import tamper, wire
from kvconnectors.transport.client import _cause  # a peer's cause string, unknown ones as protocol
from kvconnectors.transport.faults import FaultRule, corrupted

logger = get_logger(__name__)
MAX_FAILURES = 10_000              # remembered landing failures (oldest forgotten first)
NIXL_BOUNCE_BYTES = 64 << 20       # registered once; larger pushes are READ in pieces
# A NIXL READ holds the landing side's one bounce buffer, so a stalled producer blocks every other
# producer's nixl pushes into this store: bound each READ by its size at a rate far below any link's.
NIXL_READ_FLOOR_S = 5.0
NIXL_READ_MIN_BYTES_PER_S = 50e6


class ConnectionState:
    """What one producer connection has open on this landing store."""

    def __init__(self, peer: str):
        self.peer = peer
        self.open: set[str] = set()     # transfers this connection created and has not ended
        self.buffer = np.empty((0,), dtype=np.uint8)

    def bounce(self, nbytes: int) -> np.ndarray:
        if self.buffer.size < nbytes:
            self.buffer = np.empty((nbytes,), dtype=np.uint8)
        return self.buffer[:nbytes]


class Landing:
    def __init__(self, store: TieredStore, *, fingerprint: str, num_layers: int,
                 nixl_sink_factory: Callable[[], object] | None = None, seen_grace_s: float = 5.0,
                 test_hooks: bool = False):
        self.store, self.fingerprint, self.num_layers = store, fingerprint, num_layers
        self.test_hooks = test_hooks  # honour per-transfer corruption marks (tamper.py): tests only
        self._sink_factory = nixl_sink_factory
        self._sink = None
        self._nixl_lock = threading.Lock()
        self._nixl_bounce: np.ndarray | None = None
        self._cond = threading.Condition()
        self._failed: OrderedDict[str, TransferError] = OrderedDict()
        self._seen: OrderedDict[str, float] = OrderedDict()  # transfer id -> first chunk arrival
        # transfer id -> bytes landed per data path (bounded like _seen: a request may never come)
        self._path_bytes: OrderedDict[str, dict[str, int]] = OrderedDict()
        self.counters = {"pushes": 0, "push_bytes": 0, "landed": 0, "failed": 0}

    # ------------------------------------------------------------------ consumer side
    def wait(self, transfer_id: str, deadline: float, first_chunk_by: float) -> None:
        """Return once `transfer_id` is sealed here; raise its landing failure, TIMEOUT at
        `deadline`, or UNKNOWN_TRANSFER when not one chunk of it arrived by `first_chunk_by`
        (the producer never reached us: the caller may pull instead)."""
        with self._cond:
            while True:
                failure = self._failed.get(transfer_id)
                if failure is not None:
                    raise failure
                present = self.store.contains(transfer_id)
                if present and self.store.is_sealed(transfer_id):
                    return
                if not present and transfer_id in self._seen:
                    raise TransferError(FailureCause.LEASE_EXPIRED, (
                        f"pushed transfer {transfer_id!r} landed here but its landing lease ended"))
                now = time.monotonic()
                if transfer_id not in self._seen and now >= first_chunk_by:
                    raise TransferError(FailureCause.UNKNOWN_TRANSFER,
                                        f"no pushed data for transfer {transfer_id!r} arrived here")
                if now >= deadline:
                    raise TransferError(FailureCause.TIMEOUT,
                                        f"pushed transfer {transfer_id!r} did not finish landing in time")
                limit = deadline if transfer_id in self._seen else min(deadline, first_chunk_by)
                self._cond.wait(max(0.0, limit - now))

    def forget(self, transfer_id: str) -> None:
        with self._cond:
            self._failed.pop(transfer_id, None)
            self._seen.pop(transfer_id, None)
            self._path_bytes.pop(transfer_id, None)

    def landed_bytes(self, transfer_id: str) -> dict[str, int]:
        """Bytes of `transfer_id` that landed here over each push data path ("push_tcp", "push_nixl")."""
        with self._cond:
            return dict(self._path_bytes.get(transfer_id, {}))

    # ------------------------------------------------------------------ producer connections
    def handle_push(self, sock: socket.socket, msg: wire.Push, conn: ConnectionState,
                    fault: FaultRule | None) -> None:
        """Land one Push and answer it. Bytes that follow an inline Push are always consumed
        (refusals are answered in step, so other transfers on this connection go on) unless the
        header itself is unusable or the stream broke; then the connection is closed."""
        inline = msg.data_path == "inline"
        try:
            self._check_shape(msg)
        except TransferError as exc:
            self._fail(msg.transfer_id, exc, conn)
            wire.send_refusal(sock, exc)
            if inline and msg.nbytes:
                _hang_up(sock)  # sizes we cannot trust: the unread bytes would be taken for a frame
            return
        if fault is not None and fault.action == "truncate":
            _hang_up(sock)
            return
        slot = self.store.slot_bytes
        rows = len(msg.layers) * msg.num_blocks
        try:
            self._check_state(msg)
            self._ensure_entry(msg, conn)  # before the bytes: the consumer sees it is on its way
        except TransferError as exc:
            if inline and not self._drain(sock, msg.nbytes, conn):
                return
            self._fail(msg.transfer_id, exc, conn)
            wire.send_refusal(sock, exc)
            return
        try:
            if inline:
                buf = conn.bounce(rows * slot).reshape(rows, slot)
                try:
                    wire.recv_exact(sock, memoryview(buf.reshape(-1)), time.monotonic() + 60)
                except TransferError as exc:  # the stream itself broke
                    self._fail(msg.transfer_id, exc, conn)
                    _hang_up(sock)
                    return
                self._land(msg, buf, fault, "push_tcp")
            else:
                self._land_nixl(msg, conn)
        except TransferError as exc:
            self._fail(msg.transfer_id, exc, conn)
            wire.send_refusal(sock, exc)
            return
        with self._cond:
            self.counters["pushes"] += 1
            self.counters["push_bytes"] += rows * slot
        if msg.seal:
            self.handle_end(sock, wire.PushEnd(transfer_id=msg.transfer_id), conn)
            return
        wire.send_msg(sock, wire.Ack(ok=True))

    def abandon(self, transfer_id: str, why: TransferError) -> None:
        """The consumer gave up waiting and pulls instead: refuse what still comes (in step, so the
        producer keeps its copy for that pull) and drop what already landed."""
        with self._cond:
            self._failed[transfer_id] = TransferError(why.cause, f"the consumer stopped waiting for it: {why}")
            self._seen.pop(transfer_id, None)
            self._path_bytes.pop(transfer_id, None)
        try:
            self.store.release(transfer_id)
        except TransferError:
            pass

    def _drain(self, sock: socket.socket, nbytes: int, conn: ConnectionState) -> bool:
        """Read and discard a refused Push's bytes (sizes already checked); False if the stream broke."""
        left = nbytes
        deadline = time.monotonic() + 60
        while left:
            chunk = conn.bounce(min(left, 8 << 20))
            try:
                wire.recv_exact(sock, memoryview(chunk), deadline)
            except TransferError:
                _hang_up(sock)
                return False
            left -= chunk.size
        return True

    def handle_end(self, sock: socket.socket, msg: wire.PushEnd, conn: ConnectionState) -> None:
        tid = msg.transfer_id
        conn.open.discard(tid)
        if not msg.ok:
            cause = _cause(msg.cause)
            self._fail(tid, TransferError(cause, f"producer {conn.peer} gave up pushing: {msg.message}"), conn)
            wire.send_msg(sock, wire.Ack(ok=True))
            return
        try:
            self.store.seal(tid)
            self.store.renew(tid)  # the lease runs from the seal: the request is about to arrive
        except (TransferError, ValueError) as exc:
            err = exc if isinstance(exc, TransferError) else TransferError(
                FailureCause.PROTOCOL, f"pushed transfer {tid!r} is incomplete: {exc}")
            self._fail(tid, err, conn)
            wire.send_refusal(sock, err)
            return
        with self._cond:
            self.counters["landed"] += 1
            self._cond.notify_all()
        wire.send_msg(sock, wire.Ack(ok=True))

    def connection_closed(self, conn: ConnectionState) -> None:
        """The producer's connection ended with transfers still open: they will never complete."""
        for tid in list(conn.open):
            self._fail(tid, TransferError(FailureCause.PEER_UNREACHABLE, (
                f"producer {conn.peer} disconnected before it finished pushing transfer {tid!r}")), conn)

    # ------------------------------------------------------------------ internals
    def _check_shape(self, msg: wire.Push) -> None:
        if not msg.transfer_id or len(msg.transfer_id) > 512:
            raise TransferError(FailureCause.PROTOCOL, f"bad transfer_id {msg.transfer_id[:64]!r}")
        if msg.fingerprint != self.fingerprint:
            raise TransferError(FailureCause.LAYOUT_MISMATCH, (
                f"producer KV layout {msg.fingerprint} differs from this consumer's {self.fingerprint}"))
        if msg.num_layers != self.num_layers:
            raise TransferError(FailureCause.LAYOUT_MISMATCH,
                                f"producer pushes {msg.num_layers} layers, this consumer has {self.num_layers}")
        if not 0 < msg.total_blocks <= 1 << 22:
            raise TransferError(FailureCause.PROTOCOL, f"bad total_blocks {msg.total_blocks}")
        if (not msg.layers or len(set(msg.layers)) != len(msg.layers)
                or any(not 0 <= layer < self.num_layers for layer in msg.layers)):
            raise TransferError(FailureCause.PROTOCOL, f"layers {msg.layers[:8]}: need distinct layers "
                                                       f"in [0, {self.num_layers})")
        if msg.first_block < 0 or msg.num_blocks < 1 or msg.first_block + msg.num_blocks > msg.total_blocks:
            raise TransferError(FailureCause.PROTOCOL, (
                f"bad block range [{msg.first_block}, {msg.first_block + msg.num_blocks}) of {msg.total_blocks}"))
        rows = len(msg.layers) * msg.num_blocks
        if msg.checksums is not None and len(msg.checksums) != rows:
            raise TransferError(FailureCause.PROTOCOL, f"{len(msg.checksums)} checksums for {rows} blocks")
        if msg.data_path == "inline":
            if msg.nbytes != rows * self.store.slot_bytes:
                raise TransferError(FailureCause.LAYOUT_MISMATCH, (
                    f"push of {msg.nbytes} bytes for {rows} blocks of {self.store.slot_bytes} B"))
        elif msg.data_path == "nixl":
            if self._sink_factory is None:
                raise TransferError(FailureCause.PROTOCOL, "push data_path 'nixl' sent to a consumer that was "
                                                           "not started with transport 'nixl'")
            if not msg.offsets or len(msg.offsets) != rows or msg.nixl_base_address <= 0:
                raise TransferError(FailureCause.PROTOCOL, "nixl push without one offset per block")
        else:
            raise TransferError(FailureCause.PROTOCOL, f"unknown push data_path {msg.data_path!r}")

    def _check_state(self, msg: wire.Push) -> None:
        with self._cond:
            if msg.transfer_id in self._failed:  # it failed earlier (maybe on another connection)
                raise self._failed[msg.transfer_id]

    def _ensure_entry(self, msg: wire.Push, conn: ConnectionState) -> None:
        tid = msg.transfer_id
        if tid in conn.open:
            self.store.renew(tid)  # arriving data keeps the landing lease alive
            return
        try:
            self.store.create(tid, msg.num_layers, msg.total_blocks)
        except ValueError:
            raise TransferError(FailureCause.PROTOCOL, f"transfer {tid!r} was already pushed here") from None
        except StoreFullError as exc:
            raise TransferError(FailureCause.STORE_FULL, f"landing store: {exc}") from None
        conn.open.add(tid)
        with self._cond:
            self._seen[tid] = time.monotonic()
            while len(self._seen) > MAX_FAILURES:
                self._seen.popitem(last=False)
            self._cond.notify_all()

    def _land(self, msg: wire.Push, buf: np.ndarray, fault: FaultRule | None, path: str) -> None:
        """Verify and write one group that arrived over `path` (bytes counted per path)."""
        if fault is not None and fault.action == "corrupt":
            buf[0] = np.frombuffer(corrupted(memoryview(buf[0])), dtype=np.uint8)
        silent = tamper.kind_of(msg.transfer_id, self.test_hooks) == "corrupt"
        if silent:  # test hook: corrupt where the push delivered the bytes, unnoticed by checksums
            tamper.corrupt(buf)
        if msg.checksums is not None and not silent:
            for i, want in enumerate(msg.checksums):
                got = xxhash.xxh3_64_intdigest(buf[i])
                if got != want:
                    layer, block = msg.layers[i // msg.num_blocks], msg.first_block + i % msg.num_blocks
                    raise TransferError(FailureCause.CHECKSUM_MISMATCH, (
                        f"pushed transfer {msg.transfer_id!r}: layer {layer} block {block} has checksum "
                        f"{got:016x}, producer staged {want:016x}"))
        try:
            self.store.write(msg.transfer_id, msg.layers, msg.first_block, buf)  # the group in one call
        except OSError as exc:
            raise TransferError(FailureCause.STORE_FULL, f"landing store write failed: {exc}") from None
        with self._cond:
            paths = self._path_bytes.setdefault(msg.transfer_id, {})
            paths[path] = paths.get(path, 0) + buf.nbytes
            while len(self._path_bytes) > MAX_FAILURES:
                self._path_bytes.popitem(last=False)

    def _land_nixl(self, msg: wire.Push, conn: ConnectionState) -> None:
        """READ the blocks from the producer's arena into one registered bounce buffer (in pieces
        when larger), verify, write into the store: one registration for the server's life."""
        slot = self.store.slot_bytes
        offsets = np.asarray(msg.offsets, dtype=np.uint64)
        with self._nixl_lock:
            sink = self._nixl_sink()
            bounce = self._nixl_bounce
            assert bounce is not None
            piece = max(1, bounce.size // slot)
            rows = len(offsets)
            out = np.empty((rows, slot), dtype=np.uint8) if rows > piece else None
            for start in range(0, rows, piece):
                n = min(piece, rows - start)
                dst = bounce[:n * slot].reshape(n, slot)
                local = np.uint64(bounce.ctypes.data) + np.arange(n, dtype=np.uint64) * np.uint64(slot)
                # keyed by the producer agent, not the connection: a reconnect reuses the loaded agent
                meta = msg.nixl_agent_meta or b""
                sink.read(f"push-{xxhash.xxh3_64_hexdigest(meta)}", meta,
                          np.uint64(msg.nixl_base_address) + offsets[start:start + n], local, slot,
                          read_deadline(n * slot))
                if out is None:
                    self._land(msg, dst, None, "push_nixl")
                    return
                out[start:start + n] = dst
        self._land(msg, out, None, "push_nixl")

    def _nixl_sink(self):
        if self._sink is None:
            assert self._sink_factory is not None
            sink = self._sink_factory()
            bounce = np.empty((NIXL_BOUNCE_BYTES,), dtype=np.uint8)
            sink.register_regions([(int(bounce.ctypes.data), bounce.nbytes)])
            self._sink, self._nixl_bounce = sink, bounce
        return self._sink

    def _fail(self, tid: str, exc: TransferError, conn: ConnectionState) -> None:
        conn.open.discard(tid)
        try:
            self.store.release(tid)
        except TransferError:
            pass
        logger.warning("pushed transfer %s from %s failed to land: %s", tid, conn.peer, exc)
        with self._cond:
            self.counters["failed"] += 1
            self._path_bytes.pop(tid, None)
            self._failed[tid] = exc
            while len(self._failed) > MAX_FAILURES:
                self._failed.popitem(last=False)
            self._cond.notify_all()

    def close(self) -> None:
        if self._sink is not None:
            self._sink.close()
            self._sink = None


def read_deadline(nbytes: int) -> float:
    """When a NIXL READ of `nbytes` into the bounce buffer must have finished."""
    return time.monotonic() + min(60.0, NIXL_READ_FLOOR_S + nbytes / NIXL_READ_MIN_BYTES_PER_S)


def _hang_up(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
