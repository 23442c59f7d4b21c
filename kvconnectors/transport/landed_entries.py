"""The landed-entry table of push mode: what the landing receiver records of each pushed transfer,
and what the worker asks of it.

The receiver (push_receiver.py) fills it from its connection threads: it `claim`s a transfer for
the producer that first pushes it (binding it to that owner, creating the store entry under its
own writer, remembering the pushes' token and head range), `fail`s it, or marks it landed once
sealed. The worker (tiered/landed.py) asks it from its own thread: `wait` until sealed (or failed,
or never started), `abandon` (stop waiting, pull instead), `forget` (done with it), `landed_bytes`,
`heads_of`, `token_of` (also the store server's grants ask it), `counters`. Every record is
bounded (MAX_FAILURES, oldest first): a request may never come for what landed. One condition
guards it all; the decisions that must not interleave (claim, refuse a header, end an unclaimed
id) are taken under it in one call.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, field
from itertools import count

import numpy as np

from kvconnectors.errors import FailureCause, StoreFullError, TransferError
from kvconnectors.logs import LogLimiter, get_logger
from kvconnectors.store import StoreClosedError, TieredStore
from kvconnectors.transport import wire

LANDING_LOGGER = "kvconnectors.transport.landing"  # every part of the landing side logs as it
logger = get_logger(LANDING_LOGGER)
MAX_FAILURES = 10_000              # remembered landing failures (oldest forgotten first)
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


@dataclass(eq=False)
class InFlight:
    """A transfer landing here, not sealed yet: who may continue it, and its geometry."""
    owner: Hashable
    num_layers: int
    total_blocks: int
    conn: ConnectionState
    heads: tuple[int, ...] | None = None  # a head fragment's range (every Push of it must say the same)
    writer: object = field(default_factory=object)  # the store entry's writer: only we renew or release it


class Foreign(TransferError):
    """A refusal that touches nothing: the transfer is not the sender's to change."""

    def __init__(self, detail: str, cause: FailureCause = FailureCause.PROTOCOL):
        super().__init__(cause, detail, refused=True)


class LandedEntries:
    """Owned by the worker (it asks), filled by the landing receiver (it records); see the module
    docstring for who calls what."""

    def __init__(self, store: TieredStore):
        self.store = store
        self._cond = threading.Condition()
        self._failed: OrderedDict[str, TransferError] = OrderedDict()
        self._seen: OrderedDict[str, float] = OrderedDict()  # transfer id -> first chunk arrival
        self._inflight: dict[str, InFlight] = {}
        self._prune_at = MAX_FAILURES
        # transfer id -> bytes landed per data path (bounded like _seen: a request may never come)
        self._path_bytes: OrderedDict[str, dict[str, int]] = OrderedDict()
        self._heads: OrderedDict[str, tuple[int, ...]] = OrderedDict()  # head fragment id -> its heads (bounded too)
        self._tokens: OrderedDict[str, str] = OrderedDict()  # transfer id -> its first Push's token ("": none)
        self.counters = {"pushes": 0, "push_bytes": 0, "landed": 0, "failed": 0, "refused_foreign": 0}
        self.log = LogLimiter(logger)  # what a peer can provoke at will

    # ------------------------------------------------------------------ the worker's face
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

    # ------------------------------------------------------------------ the receiver's face
    def claim(self, msg: wire.Push, conn: ConnectionState) -> InFlight:
        """The in-flight record this push continues (its owner's, same geometry, lease renewed) or
        creates (nothing of that id here: bind it to this owner; the store entry reserves nothing
        yet). Foreign when the transfer is not this owner's; another TransferError fails it."""
        tid = msg.transfer_id
        with self._cond:
            rec = self.mine(tid, conn)
            failed = self._failed.get(tid)
            if failed is not None:  # it failed earlier (maybe on another connection): refuse in step
                conn.open.discard(tid)
                raise Foreign(failed.detail, failed.cause)
            if rec is None:
                if tid in conn.open:  # ours, but its entry ended under us
                    raise TransferError(FailureCause.LEASE_EXPIRED, (
                        f"pushed transfer {tid!r}: its landing entry ended before the push finished"))
                if self.store.contains(tid):
                    raise Foreign(f"transfer {tid!r} was sealed here already" if self.is_sealed(tid)
                                   else f"transfer {tid!r} exists here and is not this producer's")
                heads = tuple(msg.heads) if msg.heads is not None else None
                rec = InFlight(conn.owner, msg.num_layers, msg.total_blocks, conn, heads)
                try:
                    self.store.create(tid, msg.num_layers, msg.total_blocks, reserve=False, writer=rec.writer)
                except StoreFullError as exc:
                    raise TransferError(FailureCause.STORE_FULL, f"landing store: {exc.detail}") from None
                except ValueError:  # created meanwhile, not through us
                    raise Foreign(f"transfer {tid!r} exists here and is not this producer's") from None
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

    def mine(self, tid: str, conn: ConnectionState) -> InFlight | None:
        """This owner's in-flight record of `tid`; None when nobody has it in flight; Foreign
        when someone else has."""
        with self._cond:
            rec = self._inflight.get(tid)
        if rec is None:
            return None
        if rec.owner != conn.owner:
            raise Foreign(f"transfer {tid!r} is being pushed here by another producer")
        return rec

    def refuse_header(self, tid: str, exc: TransferError, conn: ConnectionState) -> None:
        """A Push whose header is unusable: it fails the transfer only if it is the sender's own in
        flight, or nobody's (then the consumer learns why at once); anything else stays untouched."""
        with self._cond:  # decided and done at once: nobody binds the id in between
            try:
                wire.check_transfer_id(tid)
                rec = self.mine(tid, conn)
            except TransferError:
                self.count_foreign(tid, exc, conn)
                return
            if rec is not None or (tid not in conn.open and not self.store.contains(tid)):
                self.fail(tid, exc, conn)
            elif tid in conn.open:  # ours, but its entry ended already
                self.remember(tid, exc, conn)
            else:
                self.count_foreign(tid, exc, conn)

    def fail_if_mine(self, tid: str, exc: TransferError, conn: ConnectionState) -> None:
        try:
            rec = self.mine(tid, conn)
        except TransferError:
            return
        if rec is not None:
            self.fail(tid, exc, conn)
        conn.open.discard(tid)

    def fail(self, tid: str, exc: TransferError, conn: ConnectionState) -> None:
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
        self.remember(tid, exc, conn)
        if mine:
            try:
                self.store.release(tid, writer=rec.writer)
            except (TransferError, StoreClosedError):  # gone already, or the store shut down
                pass

    def remember(self, tid: str, exc: TransferError, conn: ConnectionState) -> None:
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

    def count_foreign(self, tid: str, exc: TransferError, conn: ConnectionState) -> None:
        self.log.info("foreign", "refused a push message for %r from %s: %s", tid[:64], conn.peer, exc)
        with self._cond:
            self.counters["refused_foreign"] += 1

    def count_landed(self, tid: str, label: str, nbytes: int) -> None:
        with self._cond:
            paths = self._path_bytes.setdefault(tid, {})
            paths[label] = paths.get(label, 0) + nbytes
            while len(self._path_bytes) > MAX_FAILURES:
                self._path_bytes.popitem(last=False)

    def is_sealed(self, tid: str) -> bool:
        try:
            return self.store.is_sealed(tid)
        except TransferError:
            return False

    def end_unclaimed(self, tid: str, abort: TransferError | None,
                      conn: ConnectionState) -> tuple[bool, TransferError | None]:
        """A PushEnd for `tid`, of which the sender holds nothing in flight. An abort (`abort`, its
        error) for a transfer nothing of which landed is remembered: the consumer stops waiting now.
        Returns whether it was, and the failure remembered for `tid` (None: none)."""
        with self._cond:
            remembered = abort is not None and tid not in self._inflight and not self.store.contains(tid)
            if remembered:
                self.remember(tid, abort, conn)
            return remembered, self._failed.get(tid)

    def mark_landed(self, tid: str, rec: InFlight) -> None:
        """`tid` was sealed by its owner: no longer in flight; waiting consumers wake."""
        with self._cond:
            if self._inflight.get(tid) is rec:
                del self._inflight[tid]
            self.counters["landed"] += 1
            self._cond.notify_all()

    def count_push(self, nbytes: int) -> None:
        with self._cond:
            self.counters["pushes"] += 1
            self.counters["push_bytes"] += nbytes

    # ------------------------------------------------------------------ internals
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
