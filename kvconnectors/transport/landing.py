"""Receiving side of push mode: the decode instance's store server lands pushed layer groups in its
own store, under its own lease, and seals them at PushEnd.

    producer (PushSender)                       consumer store server (Landing)
    Push(layers 0-3, blocks, checksums) + bytes  ─▶ first Push: bind the transfer to this producer,
                                                 check layout and that it would fit; every Push:
                                                 receive (a buffer lent under the cap), verify
                                                 checksums, reserve the group's slots, write, renew
                                            ◀── Ack
    ... one Push per layer group, while the producer's later layers still compute ...
    PushEnd(ok)                                 ─▶ seal: every (layer, block) must have arrived
                                            ◀── Ack                        (consumer's load wakes)

A transfer that cannot land (layout mismatch, store full, bad checksum, producer gone mid-stream,
PushEnd(ok=False)) is dropped at once and its cause remembered, so the consumer's load fails (or
falls back to pulling) with that cause instead of waiting for its deadline. Partial layer sets are
never readable: only sealed entries are.

Who may do what (the landing side faces any peer that reaches the store port):
- Owner. The first Push of a transfer binds it to the producer that sent it: `ConnectionState.owner`
  (unique to the connection by default; the server may give the authenticated session's id).
  Only that owner continues, fails (PushEnd ok=False or a bad Push of its own) or seals it; its
  connection ending fails what it left open. Anyone else's Push, PushEnd or malformed Push for
  that id is refused in step and touches nothing. A sealed entry is never deleted by a push
  message at all, its owner's included: it belongs to the consumer now (released or expired).
  A failure is remembered for an id nobody holds (a first Push refused, an abort before any data)
  so the consumer learns it at once; a peer that knew an id before its producer's first Push could
  pre-empt it that way (as it could claim it), so transfer ids must stay unguessable.
- Reservation. The first Push checks that the whole transfer would fit in the store's free slots
  now, but reserves nothing. A tcp push lands in place: its bytes are read straight into the
  store's slots a chunk (IN_PLACE_CHUNK_BYTES) at a time, each chunk reserved just before its
  bytes are read and committed once they pass their checksums (a failed chunk gives its slots
  back with the transfer); the decode then copies slot -> blocks, two host copies in all. Other
  paths reserve a group when its bytes have arrived and passed their checksums. So a claim of a
  large transfer holds only what was delivered, plus at most one chunk: a 4 KiB push "of" 128
  blocks holds one chunk. The price: transfers admitted side by side may not all find room for
  their last groups; the one that does not is refused in step with store_full (its producer keeps
  its copy, the consumer pulls it) and gives back what it held. Reservations take free DRAM, then
  free NVMe; landed entries are not spilled to make room for them.
- Lease. Until sealed, the entry's lease is renewed only by its owner's pushes (the store entry
  is created with a writer): a stranger's Renew, or Release, is answered "unknown" and neither
  keeps it alive nor ends it.
- Capability. The first Push's `token` (the ticket's) is the entry's: from then on every Read,
  Renew, Release and Locate of it on the wire must present it (`token_of`, checked by the store
  server), as for a producer's entries; without it the entry reads exactly like an unknown id. An
  entry pushed without a token answers nobody on the wire (its consumer reads it locally). The
  consumer's lease keeper presents the ticket's token.
- Receive buffers. A push borrows from one pool shared by every connection (`ReceiveBuffers`; a
  tcp push one chunk, for its rows bound for NVMe; a fault-wrapped one its whole group): at most
  `max_receive_bytes` in all (default: a
  quarter of the store's DRAM, at least two of the largest Pushes a PushSender sends, 2 x 64 MiB);
  kept for reuse, never per connection. A push that would need more is refused in step with
  store_full (its bytes are read and dropped; the producer keeps its copy, the consumer pulls)
  instead of allocating. NIXL pushes READ through one registered bounce buffer; those larger than
  it (from producers that do not split groups) are gathered in a buffer counted against the cap.
- Head fragments (decode TP < prefill TP, tiered/push_routes.py). A Push with `heads` [start, stop)
  carries rows holding only those of this rank's KV heads, under the fragment's own id: its
  fingerprint must be that of such rows (`fragment_rows`, None: fragments are refused), over tcp
  only. Otherwise it is an ordinary pushed transfer (owner, lease, seal); each row lands in the
  first bytes of a whole slot (the consumer assembles the fragments into its rows).
- Errors. Every refusal is typed and answered in step; a bug while landing fails the transfer, is
  answered as a protocol error, and the connection goes on (or is closed when its stream may be
  out of step).
"""

from __future__ import annotations

import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from itertools import count

import numpy as np
import xxhash

from kvconnectors.errors import FailureCause, StoreFullError, TransferError
from kvconnectors.logs import LogLimiter, get_logger
from kvconnectors.store import StoreClosedError, TieredStore
from kvconnectors.store.buffers import runs
from kvconnectors.store.sizes import format_size
from kvconnectors.store.views import WriteTarget
from kvconnectors.transport import tamper, wire
from kvconnectors.transport.faults import FaultRule, with_fault
from kvconnectors.transport.paths import NIXL_BOUNCE_BYTES, PUSH_UNOFFERED, TCP_PUSH, PushPath, offered
from kvconnectors.transport.protocol import MAX_PUSH_BYTES, HungUp, hang_up, trailing_bytes

logger = get_logger(__name__)
IN_PLACE_CHUNK_BYTES = 1 << 20    # tcp pushes land in the store a chunk at a time (reserved just ahead)
MAX_FAILURES = 10_000              # remembered landing failures (oldest forgotten first)
MAX_MESSAGE = 512                  # characters of a peer's abort message that are kept
MIN_RECEIVE_BYTES = 2 * MAX_PUSH_BYTES  # the default receive-buffer cap is at least this (128 MiB)
DRAIN_BYTES = 1 << 20              # refused pushes' bytes are read into one shared scratch buffer
_owner_ids = count(1)


class ConnectionState:
    """What one producer connection has open on this landing store. `owner`: who the transfers
    this connection creates are bound to (compared with ==); default: unique to this connection."""

    def __init__(self, peer: str, owner: Hashable | None = None):
        self.peer = peer
        self.owner: Hashable = owner if owner is not None else ("connection", next(_owner_ids))
        self.open: set[str] = set()     # transfers this connection created and has not ended
        self.buffer: np.ndarray | None = None  # lent for the push being received (ReceiveBuffers)

    def bounce(self, nbytes: int) -> np.ndarray:
        """The receive buffer lent for the push being received (the tcp push path lands in it)."""
        if self.buffer is None or self.buffer.size < nbytes:
            raise AssertionError("a push is received only into the buffer the landing side lent for it")
        return self.buffer[:nbytes]


class ReceiveBuffers:
    """Push receive buffers of every connection together, at most `cap` bytes. `lend` gives a buffer
    for one push (reusing a free one when it is large enough), `account` counts bytes a data path
    allocates itself; both raise STORE_FULL instead of going past the cap (free buffers are dropped
    first to make room), and `give_back` returns them."""

    def __init__(self, cap: int):
        if cap < 1:
            raise ValueError(f"receive-buffer cap must be >= 1 byte, got {cap}")
        self.cap = int(cap)
        self._lock = threading.Lock()
        self._free: list[np.ndarray] = []
        self._held = 0                 # bytes of free buffers + buffers lent + bytes accounted
        self.refusals = 0

    @property
    def held_bytes(self) -> int:
        with self._lock:
            return self._held

    def lend(self, nbytes: int) -> np.ndarray:
        with self._lock:
            fits = [b for b in self._free if b.size >= nbytes]
            if fits:
                buf = min(fits, key=lambda b: b.size)
                self._free = [b for b in self._free if b is not buf]
                return buf
            size = _rounded(nbytes)
            self._make_room(size if size <= self.cap - self._held + self._free_bytes() else nbytes)
            size = size if self._held + size <= self.cap else nbytes
            self._held += size
        return np.empty((size,), dtype=np.uint8)

    def account(self, nbytes: int) -> None:
        with self._lock:
            self._make_room(nbytes)
            self._held += nbytes

    def give_back(self, buf: np.ndarray | None = None, nbytes: int = 0) -> None:
        with self._lock:
            if buf is not None:
                self._free.append(buf)
            else:
                self._held -= nbytes

    def drop_free(self) -> None:
        """Let go of the buffers no push holds now (their memory goes back)."""
        with self._lock:
            self._held -= self._free_bytes()
            self._free = []

    def _free_bytes(self) -> int:
        return sum(b.size for b in self._free)

    def _make_room(self, nbytes: int) -> None:
        """(lock held) Drop free buffers, largest first, until `nbytes` more fit; else refuse."""
        if self._held - self._free_bytes() + nbytes > self.cap:
            self.refusals += 1
            raise TransferError(FailureCause.STORE_FULL, (
                f"landing receive buffers: a push of {format_size(nbytes)} does not fit the "
                f"{format_size(self.cap)} cap ({format_size(self._held - self._free_bytes())} in use by other pushes)"))
        self._free.sort(key=lambda b: b.size)
        while self._held + nbytes > self.cap:
            self._held -= self._free.pop().size


def _rounded(nbytes: int) -> int:
    """Buffer sizes in steps of an eighth of a power of two: pushes of slightly different sizes
    (prompts of different lengths) reuse a buffer instead of dropping and faulting in a new one."""
    if nbytes <= 1 << 16:
        return 1 << 16
    step = 1 << max(0, nbytes.bit_length() - 4)
    return -(-nbytes // step) * step


@dataclass(eq=False)
class _InFlight:
    """A transfer landing here, not sealed yet: who may continue it, and its geometry."""
    owner: Hashable
    num_layers: int
    total_blocks: int
    conn: ConnectionState
    heads: tuple[int, ...] | None = None  # a head fragment's range (every Push of it must say the same)
    writer: object = field(default_factory=object)  # the store entry's writer: only we renew or release it


class _Foreign(TransferError):
    """A refusal that touches nothing: the transfer is not the sender's to change."""

    def __init__(self, detail: str, cause: FailureCause = FailureCause.PROTOCOL):
        super().__init__(cause, detail, refused=True)


class Landing:
    def __init__(self, store: TieredStore, *, fingerprint: str, num_layers: int,
                 paths: Sequence[PushPath] = (TCP_PUSH,), seen_grace_s: float = 5.0, test_hooks: bool = False,
                 max_receive_bytes: int | None = None,
                 fragment_rows: Callable[[int, int], tuple[str, int]] | None = None):
        """`paths`: the push data paths accepted (tcp; NixlPush(sink_factory=...) for transport nixl).
        `max_receive_bytes`: cap on every connection's push receive buffers together (default: a
        quarter of the store's DRAM, at least MIN_RECEIVE_BYTES). `fragment_rows(start, stop)`:
        the rows fingerprint and bytes per row of a head fragment filling this rank's heads
        [start, stop) (ValueError: not a fragment this rank takes); None: fragments are refused."""
        self.store, self.fingerprint, self.num_layers = store, fingerprint, num_layers
        self._fragment_rows = fragment_rows
        self.test_hooks = test_hooks  # honour per-transfer corruption marks (tamper.py): tests only
        self.paths: dict[str, PushPath] = {p.name: p for p in paths}
        self.receive_buffers = ReceiveBuffers(max_receive_bytes if max_receive_bytes is not None
                                              else max(MIN_RECEIVE_BYTES, store.arena_bytes // 4))
        self._scratch = np.empty((DRAIN_BYTES,), dtype=np.uint8)  # refused bytes land here, unread
        self._cond = threading.Condition()
        self._failed: OrderedDict[str, TransferError] = OrderedDict()
        self._seen: OrderedDict[str, float] = OrderedDict()  # transfer id -> first chunk arrival
        self._inflight: dict[str, _InFlight] = {}
        self._prune_at = MAX_FAILURES
        # transfer id -> bytes landed per data path (bounded like _seen: a request may never come)
        self._path_bytes: OrderedDict[str, dict[str, int]] = OrderedDict()
        self._heads: OrderedDict[str, tuple[int, ...]] = OrderedDict()  # head fragment id -> its heads (bounded too)
        self._tokens: OrderedDict[str, str] = OrderedDict()  # transfer id -> its first Push's token ("": none)
        self.counters = {"pushes": 0, "push_bytes": 0, "landed": 0, "failed": 0, "refused_foreign": 0}
        self.log = LogLimiter(logger)  # what a peer can provoke at will

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
        """The consumer is done with `transfer_id` (loaded, or its request dropped). Still landing:
        as `abandon` (what landed is dropped, what still comes is refused in step)."""
        with self._cond:
            landing = transfer_id in self._inflight
        if landing:
            self.abandon(transfer_id, TransferError(FailureCause.UNKNOWN_TRANSFER, "its request was dropped here"))
            return
        with self._cond:
            self._failed.pop(transfer_id, None)
            self._seen.pop(transfer_id, None)
            self._path_bytes.pop(transfer_id, None)
            self._heads.pop(transfer_id, None)
            self._tokens.pop(transfer_id, None)

    def token_of(self, transfer_id: str) -> str | None:
        """The token a landed (or landing) transfer answers to on the wire ("" : to none); None for an
        id that never landed here."""
        with self._cond:
            return self._tokens.get(transfer_id)

    def heads_of(self, transfer_id: str) -> tuple[int, ...] | None:
        """The head range a fragment landed here says it fills; None: whole rows (or unknown)."""
        with self._cond:
            return self._heads.get(transfer_id)

    def landed_bytes(self, transfer_id: str) -> dict[str, int]:
        """Bytes of `transfer_id` that landed here over each push data path, by its label
        ("push_tcp", "push_nixl")."""
        with self._cond:
            return dict(self._path_bytes.get(transfer_id, {}))

    def abandon(self, transfer_id: str, why: TransferError) -> None:
        """The consumer gave up waiting and pulls instead: refuse what still comes (in step, so the
        producer keeps its copy for that pull) and drop what already landed."""
        with self._cond:
            self._failed[transfer_id] = TransferError(why.cause, f"the consumer stopped waiting for it: {why}")
            self._seen.pop(transfer_id, None)
            self._path_bytes.pop(transfer_id, None)
            self._heads.pop(transfer_id, None)
            self._tokens.pop(transfer_id, None)
            rec = self._inflight.pop(transfer_id, None)
        try:
            self.store.release(transfer_id, writer=rec.writer if rec is not None else None)
        except (TransferError, StoreClosedError):
            pass

    # ------------------------------------------------------------------ producer connections
    def handle_push(self, sock: socket.socket, msg: wire.Push, conn: ConnectionState,
                    fault: FaultRule | None) -> None:
        """Land one Push and answer it. Bytes that follow a streamed Push are always consumed
        (refusals are answered in step, so other transfers on this connection go on) unless the
        header itself is unusable or the stream broke; then the connection is closed."""
        try:
            self._handle_push(sock, msg, conn, fault)
        except Exception as exc:  # a bug: fail this transfer, answer, never kill the connection thread
            logger.exception("landing push of %r from %s failed unexpectedly", msg.transfer_id[:64], conn.peer)
            err = TransferError(FailureCause.PROTOCOL, f"internal error landing this push: {type(exc).__name__}")
            try:
                self._fail_if_mine(msg.transfer_id, err, conn)
            except Exception:  # noqa: BLE001 - the answer below matters more
                pass
            self._refuse(sock, err, conn)
            if trailing_bytes(msg):
                hang_up(sock)  # where its bytes stand is unknown: the stream may be out of step

    def _handle_push(self, sock: socket.socket, msg: wire.Push, conn: ConnectionState,
                     fault: FaultRule | None) -> None:
        trailing = trailing_bytes(msg)
        rows = len(msg.layers) * msg.num_blocks
        try:
            path = with_fault(self._check_shape(msg), fault)
            path.check(msg, rows, self.row_bytes(msg))
        except HungUp:
            hang_up(sock)  # a fault cut the connection before its data
            return
        except TransferError as exc:
            self._refuse_header(msg.transfer_id, exc, conn)
            self._refuse(sock, exc, conn)
            if trailing:
                hang_up(sock)  # sizes we cannot trust: the unread bytes would be taken for a frame
            return
        nbytes = rows * self.store.slot_bytes  # what it takes from the store and receive buffers
        in_place = path is TCP_PUSH  # (a fault wrapper takes the buffered path below)
        try:
            rec = self._claim(msg, conn)  # before the bytes: the consumer sees it is on its way
            # in place, only NVMe rows pass through a buffer: one chunk's worth
            loan = self._borrow(path, min(nbytes, self._chunk_rows * self.store.slot_bytes) if in_place else nbytes)
        except TransferError as exc:
            if trailing and not self._drain(sock, trailing):
                return
            if not isinstance(exc, _Foreign):
                self._fail(msg.transfer_id, exc, conn)
            else:
                self._count_foreign(msg.transfer_id, exc, conn)
            self._refuse(sock, exc, conn)
            return
        conn.buffer = loan if isinstance(loan, np.ndarray) else None
        try:
            if in_place:
                self._land_in_place(sock, msg, conn)
            else:
                with path.receive(sock, msg, self.row_bytes(msg), conn.bounce) as buf:
                    try:
                        self._land(msg, buf, path.label, rec)
                    except TransferError:
                        raise
                    except Exception as exc:  # the bytes are in: answer in step
                        logger.exception("landing %r from %s failed unexpectedly", msg.transfer_id, conn.peer)
                        raise TransferError(FailureCause.PROTOCOL,
                                            f"internal error landing this push: {type(exc).__name__}") from None
        except HungUp as broken:  # the stream itself broke
            if broken.error is not None:
                self._fail(msg.transfer_id, broken.error, conn)
            hang_up(sock)
            return
        except TransferError as exc:
            self._fail(msg.transfer_id, exc, conn)
            self._refuse(sock, exc, conn)
            return
        except (ValueError, IndexError, OverflowError, TypeError) as exc:
            # the data path could not take this push (e.g. offsets numpy refuses) before any byte
            # moved; a streamed path has read its bytes or raised HungUp by now
            err = TransferError(FailureCause.PROTOCOL, f"push {msg.transfer_id!r} cannot be received: {exc}")
            self._fail(msg.transfer_id, err, conn)
            self._refuse(sock, err, conn)
            if trailing:
                hang_up(sock)
            return
        finally:
            conn.buffer = None
            self._repay(loan, nbytes)
        with self._cond:
            self.counters["pushes"] += 1
            self.counters["push_bytes"] += rows * self.row_bytes(msg)
        if msg.seal:
            self.handle_end(sock, wire.PushEnd(transfer_id=msg.transfer_id), conn)
            return
        wire.send_msg(sock, wire.Ack(ok=True))

    def handle_end(self, sock: socket.socket, msg: wire.PushEnd, conn: ConnectionState) -> None:
        """Seal (ok) or fail (not ok) the sender's own transfer and answer; refuse anyone else's."""
        try:
            self._handle_end(sock, msg, conn)
        except Exception as exc:  # a bug: fail this transfer, answer, never kill the connection thread
            logger.exception("ending push of %r from %s failed unexpectedly", msg.transfer_id[:64], conn.peer)
            err = TransferError(FailureCause.PROTOCOL, f"internal error ending this push: {type(exc).__name__}")
            try:
                self._fail_if_mine(msg.transfer_id, err, conn)
            except Exception:  # noqa: BLE001 - the answer below matters more
                pass
            self._refuse(sock, err, conn)

    def _handle_end(self, sock: socket.socket, msg: wire.PushEnd, conn: ConnectionState) -> None:
        tid = msg.transfer_id
        try:
            wire.check_transfer_id(tid)
            rec = self._mine(tid, conn)
        except TransferError as exc:
            self._count_foreign(tid, exc, conn)
            self._refuse(sock, exc, conn)
            return
        if rec is None:  # no entry of its own here
            conn.open.discard(tid)
            with self._cond:
                # an abort for a transfer nothing of which landed: the consumer stops waiting now
                remembered = not msg.ok and tid not in self._inflight and not self.store.contains(tid)
                if remembered:
                    self._remember(tid, self._abort_error(msg, conn), conn)
                earlier = self._failed.get(tid)
            if remembered:
                wire.send_msg(sock, wire.Ack(ok=True))
                return
            exc = earlier.refusal() if earlier is not None else _Foreign(
                f"transfer {tid!r} was sealed here already" if self._sealed(tid)
                else f"nothing of transfer {tid!r} is landing here from this producer",
                FailureCause.PROTOCOL if self.store.contains(tid) else FailureCause.UNKNOWN_TRANSFER)
            self._count_foreign(tid, exc, conn)
            self._refuse(sock, exc, conn)
            return
        conn.open.discard(tid)
        if not msg.ok:
            self._fail(tid, self._abort_error(msg, conn), conn)
            wire.send_msg(sock, wire.Ack(ok=True))
            return
        try:
            self.store.seal(tid)
            self.store.renew(tid)  # the lease runs from the seal: the request is about to arrive
        except (TransferError, ValueError) as exc:
            err = exc if isinstance(exc, TransferError) else TransferError(
                FailureCause.PROTOCOL, f"pushed transfer {tid!r} is incomplete: {exc}")
            self._fail(tid, err, conn)
            self._refuse(sock, err, conn)
            return
        with self._cond:
            if self._inflight.get(tid) is rec:
                del self._inflight[tid]
            self.counters["landed"] += 1
            self._cond.notify_all()
        wire.send_msg(sock, wire.Ack(ok=True))

    def connection_closed(self, conn: ConnectionState) -> None:
        """The producer's connection ended with transfers still open: they will never complete."""
        for tid in list(conn.open):
            try:
                self._fail_if_mine(tid, TransferError(FailureCause.PEER_UNREACHABLE, (
                    f"producer {conn.peer} disconnected before it finished pushing transfer {tid!r}")), conn)
            except StoreClosedError:  # the server is shutting down: nothing left to fail
                break
        conn.open.clear()

    # ------------------------------------------------------------------ internals
    def _check_shape(self, msg: wire.Push) -> PushPath:
        """The path this push lands over, once its header is consistent (the path checks the rest).
        What a refusal says of our layout is told only to authenticated producers (_refuse)."""
        wire.check_transfer_id(msg.transfer_id)
        wire.check_fingerprint(msg.fingerprint, self._expected_fingerprint(msg), peer="producer", us="consumer")
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
        if msg.offsets is not None and any(not 0 <= off < 1 << 63 for off in msg.offsets):
            raise TransferError(FailureCause.PROTOCOL, "push offsets must be in [0, 2**63)")
        if not 0 <= msg.nixl_base_address < 1 << 63:
            raise TransferError(FailureCause.PROTOCOL, f"bad nixl_base_address {msg.nixl_base_address}")
        return offered(self.paths, msg.data_path, PUSH_UNOFFERED, "push data_path")

    def _expected_fingerprint(self, msg: wire.Push) -> str:
        """Whole rows: ours. A head fragment: that of rows holding its heads (checked here)."""
        if msg.heads is None:
            return self.fingerprint
        if msg.data_path != TCP_PUSH.name:
            raise TransferError(FailureCause.PROTOCOL, f"head fragments come inline only, not over {msg.data_path!r}")
        if self._fragment_rows is None:
            raise TransferError(FailureCause.LAYOUT_MISMATCH, "this consumer takes no head fragments "
                                "(its KV heads cannot be sliced, or it is not a decode instance)")
        return self._fragment(msg.heads)[0]

    def _fragment(self, heads: list[int]) -> tuple[str, int]:
        assert self._fragment_rows is not None
        if len(heads) != 2:
            raise TransferError(FailureCause.PROTOCOL, f"push heads {heads[:4]}: need [start, stop)")
        try:
            return self._fragment_rows(heads[0], heads[1])
        except ValueError as exc:
            raise TransferError(FailureCause.LAYOUT_MISMATCH, f"push heads {heads}: {exc}") from None

    def row_bytes(self, msg: wire.Push) -> int:
        """Bytes of one (layer, block) row of this push (after _check_shape): a slot, or a fragment's row."""
        return self.store.slot_bytes if msg.heads is None else self._fragment(msg.heads)[1]

    def _mine(self, tid: str, conn: ConnectionState) -> _InFlight | None:
        """This owner's in-flight record of `tid`; None when nobody has it in flight; _Foreign
        when someone else has."""
        with self._cond:
            rec = self._inflight.get(tid)
        if rec is None:
            return None
        if rec.owner != conn.owner:
            raise _Foreign(f"transfer {tid!r} is being pushed here by another producer")
        return rec

    def _sealed(self, tid: str) -> bool:
        try:
            return self.store.is_sealed(tid)
        except TransferError:
            return False

    def _claim(self, msg: wire.Push, conn: ConnectionState) -> _InFlight:
        """The in-flight record this push continues (its owner's, same geometry, lease renewed) or
        creates (nothing of that id here: bind it to this owner; the store entry reserves nothing
        yet). _Foreign when the transfer is not this owner's; another TransferError fails it."""
        tid = msg.transfer_id
        with self._cond:
            rec = self._mine(tid, conn)
            failed = self._failed.get(tid)
            if failed is not None:  # it failed earlier (maybe on another connection): refuse in step
                conn.open.discard(tid)
                raise _Foreign(failed.detail, failed.cause)
            if rec is None:
                if tid in conn.open:  # ours, but its entry ended under us
                    raise TransferError(FailureCause.LEASE_EXPIRED, (
                        f"pushed transfer {tid!r}: its landing entry ended before the push finished"))
                if self.store.contains(tid):
                    raise _Foreign(f"transfer {tid!r} was sealed here already" if self._sealed(tid)
                                   else f"transfer {tid!r} exists here and is not this producer's")
                heads = tuple(msg.heads) if msg.heads is not None else None
                rec = _InFlight(conn.owner, msg.num_layers, msg.total_blocks, conn, heads)
                try:
                    self.store.create(tid, msg.num_layers, msg.total_blocks, reserve=False, writer=rec.writer)
                except StoreFullError as exc:
                    raise TransferError(FailureCause.STORE_FULL, f"landing store: {exc.detail}") from None
                except ValueError:  # created meanwhile, not through us
                    raise _Foreign(f"transfer {tid!r} exists here and is not this producer's") from None
                self._inflight[tid] = rec
                self._keep_token(tid, msg.token)
                if heads is not None:
                    self._heads[tid] = heads
                    while len(self._heads) > MAX_FAILURES:
                        self._heads.popitem(last=False)
                if len(self._inflight) > self._prune_at:
                    self._prune_locked()
                conn.open.add(tid)
                self._seen[tid] = time.monotonic()
                while len(self._seen) > MAX_FAILURES:
                    self._seen.popitem(last=False)
                self._cond.notify_all()
                return rec
        if (msg.num_layers, msg.total_blocks) != (rec.num_layers, rec.total_blocks):
            raise TransferError(FailureCause.PROTOCOL, (
                f"pushed transfer {tid!r} changed shape: {msg.num_layers} layers x total_blocks {msg.total_blocks}, "
                f"its first push said {rec.num_layers} x {rec.total_blocks}"))
        if (tuple(msg.heads) if msg.heads is not None else None) != rec.heads:
            raise TransferError(FailureCause.PROTOCOL, (
                f"pushed transfer {tid!r} changed heads: {msg.heads}, its first push said "
                f"{list(rec.heads) if rec.heads is not None else None}"))
        conn.open.add(tid)
        self.store.renew(tid, writer=rec.writer)  # arriving data keeps the landing lease alive
        return rec

    def _keep_token(self, tid: str, token: str) -> None:
        """Bind `tid` to `token`. Bounded: beyond MAX_FAILURES, the tokens of entries that ended go
        first, down to 3/4 of it, then the oldest (a live entry whose token is forgotten answers
        nobody on the wire: the store server refuses a landed entry it knows no token for)."""
        self._tokens[tid] = token
        if len(self._tokens) <= MAX_FAILURES:
            return
        live, target = set(self.store.keys()), MAX_FAILURES * 3 // 4
        for ended in [t for t in self._tokens if t not in live][:len(self._tokens) - target]:
            del self._tokens[ended]
        while len(self._tokens) > MAX_FAILURES:
            self._tokens.popitem(last=False)

    def _prune_locked(self) -> None:
        """Forget in-flight records whose store entry ended without a word from its producer (its
        lease ran out while its connection stayed open): they bound nothing any more."""
        live = set(self.store.keys())
        for tid, rec in list(self._inflight.items()):
            if tid not in live:
                del self._inflight[tid]
                rec.conn.open.discard(tid)
        self._prune_at = max(MAX_FAILURES, 2 * len(self._inflight))

    def _borrow(self, path: PushPath, nbytes: int) -> np.ndarray | int:
        """What receiving `nbytes` over `path` takes from the receive-buffer cap: a lent buffer
        (streamed bytes), bytes counted (a NIXL push larger than its bounce buffer is gathered in
        one of its own), or 0."""
        if path.streams:
            return self.receive_buffers.lend(nbytes)
        if nbytes > NIXL_BOUNCE_BYTES:
            self.receive_buffers.account(nbytes)
            return nbytes
        return 0

    def _repay(self, loan: np.ndarray | int, nbytes: int) -> None:
        if isinstance(loan, np.ndarray):
            self.receive_buffers.give_back(loan)
        elif loan:
            self.receive_buffers.give_back(nbytes=loan)

    def _drain(self, sock: socket.socket, nbytes: int) -> bool:
        """Read and discard a refused Push's bytes (sizes already checked); False if the stream broke.
        Every connection drains into one scratch buffer: the bytes are never looked at."""
        left = nbytes
        deadline = time.monotonic() + 60
        view = memoryview(self._scratch)
        while left:
            n = min(left, view.nbytes)
            try:
                wire.recv_exact(sock, view[:n], deadline)
            except TransferError:
                hang_up(sock)
                return False
            left -= n
        return True

    @property
    def _chunk_rows(self) -> int:
        return max(1, IN_PLACE_CHUNK_BYTES // self.store.slot_bytes)

    def _land_in_place(self, sock: socket.socket, msg: wire.Push, conn: ConnectionState) -> None:
        """tcp: receive the group straight into its store slots, a chunk at a time: reserve a chunk's
        slots, read its bytes into them (NVMe rows through the lent buffer), verify, commit. The decode
        then copies slot -> blocks: two host copies in all, and the reservation runs at most one chunk
        ahead of the bytes delivered. Every refusal leaves the stream in step (the rest is drained)."""
        tid = msg.transfer_id
        unread = [msg.nbytes]  # bytes of this push still on the socket
        try:
            self._receive_chunks(sock, msg, conn, unread)
        except (TransferError, HungUp):
            raise
        except Exception as exc:  # a bug: answer in step, keep serving
            logger.exception("landing %r from %s failed unexpectedly", tid, conn.peer)
            if not self._drain(sock, unread[0]):
                raise HungUp(None) from None
            raise TransferError(FailureCause.PROTOCOL,
                                f"internal error landing this push: {type(exc).__name__}") from None
        self._count_landed(tid, TCP_PUSH.label, msg.nbytes)

    def _receive_chunks(self, sock: socket.socket, msg: wire.Push, conn: ConnectionState, unread: list[int]) -> None:
        slot, tid, n_blocks = self.store.slot_bytes, msg.transfer_id, msg.num_blocks
        silent = tamper.kind_of(tid, self.test_hooks) == "corrupt"
        deadline = time.monotonic() + 60

        def refuse(err: TransferError) -> TransferError:
            if not self._drain(sock, unread[0]):
                raise HungUp(None)
            return err

        for li, layer in enumerate(msg.layers):
            for j in range(0, n_blocks, self._chunk_rows):
                n, first = min(self._chunk_rows, n_blocks - j), msg.first_block + j
                try:
                    self.store.reserve(tid, layer, first, n)
                    target = self.store.begin_write(tid, layer, first, n)
                except StoreFullError as exc:
                    raise refuse(TransferError(FailureCause.STORE_FULL, f"landing store: {exc.detail}")) from None
                except (ValueError, IndexError) as exc:  # e.g. sealed meanwhile, or a bound the checks missed
                    raise refuse(TransferError(FailureCause.PROTOCOL, f"pushed transfer {tid!r}: {exc}")) from None
                ok = False
                try:
                    rows = self._receive_rows(sock, target, conn, deadline, unread, self.row_bytes(msg))
                    if silent:  # test hook: corrupt where the bytes landed, unnoticed by checksums
                        tamper.corrupt([memoryview(r) for r in rows])
                    if msg.checksums is not None and not silent:
                        bad = _bad_checksum(msg, rows, li * n_blocks + j)
                        if bad is not None:
                            raise refuse(bad)
                    ok = True
                finally:
                    nvme = conn.bounce(target.nvme_pos.size * slot).reshape(-1, slot) if ok else None
                    try:
                        self.store.end_write(target, nvme, ok=ok)
                    except OSError as exc:
                        if ok:  # (otherwise the error on its way out says more)
                            raise refuse(TransferError(FailureCause.STORE_FULL,
                                                       f"landing store write failed: {exc}")) from None

    def _receive_rows(self, sock: socket.socket, target: WriteTarget, conn: ConnectionState,
                      deadline: float, unread: list[int], row_bytes: int) -> list[np.ndarray]:
        """Read the target's rows, in order, into their DRAM slots (a run of consecutive slots in one
        read) or, for NVMe rows, the connection's lent buffer; returns the rows, in order. Rows
        shorter than a slot (head fragments) land in each slot's first `row_bytes`, one read each."""
        slot = self.store.slot_bytes
        segments = [(pos, target.slots[first:first + count]) for pos, first, count in target.dram_runs]
        if target.nvme_pos.size:
            bounce = conn.bounce(target.nvme_pos.size * slot).reshape(-1, slot)
            segments += [(int(target.nvme_pos[i]), bounce[i:i + count])
                         for i, _, count in runs(target.nvme_pos)]
        rows: list[np.ndarray] = []
        for _, seg in sorted(segments, key=lambda s: s[0]):
            if row_bytes != slot:  # a fragment's slot tails: never another transfer's old bytes
                seg[:, row_bytes:] = 0
            parts = [seg.reshape(-1)] if row_bytes == slot else [row[:row_bytes] for row in seg]
            for part in parts:
                try:
                    wire.recv_exact(sock, memoryview(part), deadline)
                except TransferError as exc:  # the stream itself broke
                    raise HungUp(exc) from None
                unread[0] -= part.nbytes
            rows.extend(seg if row_bytes == slot else parts)
        return rows

    def _land(self, msg: wire.Push, buf: np.ndarray, label: str, rec: _InFlight) -> None:
        """Verify, reserve and write one group that arrived over the path `label` (bytes counted
        per path)."""
        silent = tamper.kind_of(msg.transfer_id, self.test_hooks) == "corrupt"
        if silent:  # test hook: corrupt where the push delivered the bytes, unnoticed by checksums
            tamper.corrupt(buf)
        if msg.checksums is not None and not silent:
            bad = _bad_checksum(msg, buf, 0)
            if bad is not None:
                raise bad
        landed = buf.nbytes
        if buf.shape[1] != self.store.slot_bytes:  # head fragment rows: each in a slot's first bytes
            whole = np.zeros((buf.shape[0], self.store.slot_bytes), np.uint8)
            whole[:, :buf.shape[1]] = buf
            buf = whole
        try:
            self.store.reserve(msg.transfer_id, msg.layers, msg.first_block, buf.shape[0])
            self.store.write(msg.transfer_id, msg.layers, msg.first_block, buf)  # the group in one call
        except StoreFullError as exc:
            raise TransferError(FailureCause.STORE_FULL, f"landing store: {exc.detail}") from None
        except OSError as exc:
            raise TransferError(FailureCause.STORE_FULL, f"landing store write failed: {exc}") from None
        except (ValueError, IndexError) as exc:  # e.g. sealed meanwhile, or a bound the checks missed
            raise TransferError(FailureCause.PROTOCOL, f"pushed transfer {msg.transfer_id!r}: {exc}") from None
        self._count_landed(msg.transfer_id, label, landed)

    def _count_landed(self, tid: str, label: str, nbytes: int) -> None:
        with self._cond:
            paths = self._path_bytes.setdefault(tid, {})
            paths[label] = paths.get(label, 0) + nbytes
            while len(self._path_bytes) > MAX_FAILURES:
                self._path_bytes.popitem(last=False)

    def _abort_error(self, msg: wire.PushEnd, conn: ConnectionState) -> TransferError:
        text = msg.message[:MAX_MESSAGE]
        return TransferError(wire.failure_cause(msg.cause), f"producer {conn.peer} gave up pushing: {text}")

    def _refuse_header(self, tid: str, exc: TransferError, conn: ConnectionState) -> None:
        """A Push whose header is unusable: it fails the transfer only if it is the sender's own in
        flight, or nobody's (then the consumer learns why at once); anything else stays untouched."""
        with self._cond:  # decided and done at once: nobody binds the id in between
            try:
                wire.check_transfer_id(tid)
                rec = self._mine(tid, conn)
            except TransferError:
                self._count_foreign(tid, exc, conn)
                return
            if rec is not None or (tid not in conn.open and not self.store.contains(tid)):
                self._fail(tid, exc, conn)
            elif tid in conn.open:  # ours, but its entry ended already
                self._remember(tid, exc, conn)
            else:
                self._count_foreign(tid, exc, conn)

    def _fail_if_mine(self, tid: str, exc: TransferError, conn: ConnectionState) -> None:
        try:
            rec = self._mine(tid, conn)
        except TransferError:
            return
        if rec is not None:
            self._fail(tid, exc, conn)
        conn.open.discard(tid)

    def _fail(self, tid: str, exc: TransferError, conn: ConnectionState) -> None:
        """Fail `tid` for its owner `conn` (or nobody's: then nothing is released): drop what landed,
        remember why. Callers have checked that it is not someone else's."""
        conn.open.discard(tid)
        with self._cond:
            rec = self._inflight.get(tid)
            mine = rec is not None and rec.owner == conn.owner
            if mine:
                del self._inflight[tid]
        # Why it failed is on record before its entry goes: a consumer waiting meanwhile must see
        # this cause, not "landed here but its landing lease ended" (the entry missing, no failure yet)
        self._remember(tid, exc, conn)
        if mine:
            try:
                self.store.release(tid, writer=rec.writer)
            except (TransferError, StoreClosedError):  # gone already, or the store shut down
                pass

    def _remember(self, tid: str, exc: TransferError, conn: ConnectionState) -> None:
        self.log.warning("failed", "pushed transfer %s from %s failed to land: %s", tid, conn.peer, exc)
        with self._cond:
            self.counters["failed"] += 1
            self._path_bytes.pop(tid, None)
            self._heads.pop(tid, None)
            self._tokens.pop(tid, None)
            self._failed[tid] = exc
            while len(self._failed) > MAX_FAILURES:
                self._failed.popitem(last=False)
            self._cond.notify_all()

    def _refuse(self, sock: socket.socket, exc: TransferError, conn: ConnectionState) -> None:
        """Answer a push message with its typed refusal, in step. A peer that has not proved the shared
        secret is not told this store's layout or occupancy (issue 34): the cause only (the details
        are logged here, at most once per 10 s: such a peer may send refusable pushes at will)."""
        if exc.cause in _PRIVATE_CAUSES and not _authenticated(conn):
            self.log.info("unauthenticated", "refused a push message from unauthenticated %s: %s", conn.peer, exc)
            exc = TransferError(exc.cause, f"push refused ({exc.cause.value}); why is not shown to an unauthenticated "
                                           "peer (see the landing side's log; peers that prove the shared secret are told)")
        wire.send_refusal(sock, exc)

    def _count_foreign(self, tid: str, exc: TransferError, conn: ConnectionState) -> None:
        self.log.info("foreign", "refused a push message for %r from %s: %s", tid[:64], conn.peer, exc)
        with self._cond:
            self.counters["refused_foreign"] += 1

    def close(self) -> None:
        for path in self.paths.values():
            path.close()
        self.receive_buffers.drop_free()


def _bad_checksum(msg: wire.Push, rows: Sequence[np.ndarray] | np.ndarray, base: int) -> TransferError | None:
    """The mismatch of the first of `rows` (the push's rows base, base+1, ...) whose xxh3 is not the
    producer's, or None."""
    for k, row in enumerate(rows):
        i = base + k
        got, want = xxhash.xxh3_64_intdigest(row), msg.checksums[i]
        if got != want:
            layer, block = msg.layers[i // msg.num_blocks], msg.first_block + i % msg.num_blocks
            return TransferError(FailureCause.CHECKSUM_MISMATCH, (
                f"pushed transfer {msg.transfer_id!r}: layer {layer} block {block} has checksum "
                f"{got:016x}, producer staged {want:016x}"))
    return None


# Causes whose details describe this store (its layout, its free space): an unauthenticated peer gets
# the cause and this line instead (the details are logged here, and told to peers that prove the secret)
_PRIVATE_CAUSES = (FailureCause.LAYOUT_MISMATCH, FailureCause.STORE_FULL)


def _authenticated(conn: ConnectionState) -> bool:
    """Whether the connection's peer proved the secret (a server without one: nobody did)."""
    session = getattr(conn, "session", None)
    return bool(getattr(session, "authenticated", False))
