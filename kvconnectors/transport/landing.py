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
from collections.abc import Sequence

import numpy as np
import xxhash

from kvconnectors.errors import FailureCause, StoreFullError, TransferError
from kvconnectors.logs import get_logger
from kvconnectors.store import TieredStore
from kvconnectors.transport import tamper, wire
from kvconnectors.transport.faults import FaultRule, with_fault
from kvconnectors.transport.paths import (PUSH_UNOFFERED, TCP_PUSH, HungUp, PushPath, hang_up, offered,
                                         trailing_bytes)

logger = get_logger(__name__)
MAX_FAILURES = 10_000              # remembered landing failures (oldest forgotten first)


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
                 paths: Sequence[PushPath] = (TCP_PUSH,), seen_grace_s: float = 5.0, test_hooks: bool = False):
        """`paths`: the push data paths accepted (tcp; NixlPush(sink_factory=...) for transport nixl)."""
        self.store, self.fingerprint, self.num_layers = store, fingerprint, num_layers
        self.test_hooks = test_hooks  # honour per-transfer corruption marks (tamper.py): tests only
        self.paths: dict[str, PushPath] = {p.name: p for p in paths}
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
        """Bytes of `transfer_id` that landed here over each push data path, by its label
        ("push_tcp", "push_nixl")."""
        with self._cond:
            return dict(self._path_bytes.get(transfer_id, {}))

    # ------------------------------------------------------------------ producer connections
    def handle_push(self, sock: socket.socket, msg: wire.Push, conn: ConnectionState,
                    fault: FaultRule | None) -> None:
        """Land one Push and answer it. Bytes that follow a streamed Push are always consumed
        (refusals are answered in step, so other transfers on this connection go on) unless the
        header itself is unusable or the stream broke; then the connection is closed."""
        trailing = trailing_bytes(msg)
        try:
            path = with_fault(self._check_shape(msg), fault)
            path.check(self, msg, len(msg.layers) * msg.num_blocks)
        except HungUp:
            hang_up(sock)  # a fault cut the connection before its data
            return
        except TransferError as exc:
            self._fail(msg.transfer_id, exc, conn)
            wire.send_refusal(sock, exc)
            if trailing:
                hang_up(sock)  # sizes we cannot trust: the unread bytes would be taken for a frame
            return
        try:
            self._check_state(msg)
            self._ensure_entry(msg, conn)  # before the bytes: the consumer sees it is on its way
        except TransferError as exc:
            if trailing and not self._drain(sock, trailing, conn):
                return
            self._fail(msg.transfer_id, exc, conn)
            wire.send_refusal(sock, exc)
            return
        try:
            with path.receive(self, sock, msg, conn) as buf:
                self._land(msg, buf, path.label)
        except HungUp as broken:  # the stream itself broke
            if broken.error is not None:
                self._fail(msg.transfer_id, broken.error, conn)
            hang_up(sock)
            return
        except TransferError as exc:
            self._fail(msg.transfer_id, exc, conn)
            wire.send_refusal(sock, exc)
            return
        with self._cond:
            self.counters["pushes"] += 1
            self.counters["push_bytes"] += buf.nbytes
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
                hang_up(sock)
                return False
            left -= chunk.size
        return True

    def handle_end(self, sock: socket.socket, msg: wire.PushEnd, conn: ConnectionState) -> None:
        tid = msg.transfer_id
        conn.open.discard(tid)
        if not msg.ok:
            cause = wire.failure_cause(msg.cause)
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
    def _check_shape(self, msg: wire.Push) -> PushPath:
        """The path this push lands over, once its header is consistent (the path checks the rest)."""
        wire.check_transfer_id(msg.transfer_id)
        wire.check_fingerprint(msg.fingerprint, self.fingerprint, peer="producer", us="consumer")
        if msg.num_layers != self.num_layers:
            raise TransferError(FailureCause.LAYOUT_MISMATCH,
                                f"producer pushes {msg.num_layers} layers, this consumer has {self.num_layers}")
        if not 0 < msg.total_blocks <= 1 << 22:
            raise TransferError(FailureCause.PROTOCOL, f"bad total_blocks {msg.total_blocks}")
        wire.check_layers(msg.layers, self.num_layers)
        if msg.first_block < 0 or msg.num_blocks < 1 or msg.first_block + msg.num_blocks > msg.total_blocks:
            raise TransferError(FailureCause.PROTOCOL, (
                f"bad block range [{msg.first_block}, {msg.first_block + msg.num_blocks}) of {msg.total_blocks}"))
        rows = len(msg.layers) * msg.num_blocks
        if msg.checksums is not None and len(msg.checksums) != rows:
            raise TransferError(FailureCause.PROTOCOL, f"{len(msg.checksums)} checksums for {rows} blocks")
        return offered(self.paths, msg.data_path, PUSH_UNOFFERED, "push data_path")

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

    def _land(self, msg: wire.Push, buf: np.ndarray, label: str) -> None:
        """Verify and write one group that arrived over the path `label` (bytes counted per path)."""
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
            paths[label] = paths.get(label, 0) + buf.nbytes
            while len(self._path_bytes) > MAX_FAILURES:
                self._path_bytes.popitem(last=False)

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
        for path in self.paths.values():
            path.close()
