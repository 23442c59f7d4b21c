"""Consumer side of push mode: the KV that producers pushed into this rank's landing store.

The landing receiver (transport/landing.py) fills this rank's store with pushed entries, and the
landed-entry table (`landing`, transport/landed_entries.py) with its records of them; this
part waits until a request's entry is sealed there (every layer of every block), copies it into
the request's KV cache blocks and lets it go. Decode TP < prefill TP: each producer rank pushed
the heads it serves here as a head fragment under its own id (tp.py `fragment_id`); the rows are
assembled from all of them, a fragment that did not land is pulled from its producer rank
instead (resliced.py), and nothing partial reaches the cache. Entries that did not land at all
are left to the puller, which pulls them from the producer.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import numpy as np

from kvconnectors.errors import FailureCause, TransferError
from kvconnectors.logs import get_logger
from kvconnectors.mover import Loader
from kvconnectors.mover.heads import HeadRange, SliceStep
from kvconnectors.mover.reslice import RowLayout, copy_heads
from kvconnectors.store import TieredStore
from kvconnectors.tiered.config import TieredConfig
from kvconnectors.tiered.layout import KVLayout
from kvconnectors.tiered.load import Load
from kvconnectors.tiered.resliced import ReslicedReads
from kvconnectors.tiered.tp import Reslice, fragment_id, is_fragment_of
from kvconnectors.transport import tamper
from kvconnectors.transport.landed_entries import LandedEntries

logger = get_logger(__name__)
FIRST_CHUNK_GRACE_S = 5.0  # no chunk of a transfer landed by then -> pull from the producer
LANDED_READ_BYTES = 32 << 20  # bytes copied out of the landing store per read_into call


class LandedReader:
    def __init__(self, store: TieredStore, landing: LandedEntries, layout: KVLayout, config: TieredConfig,
                 loader: Loader, resliced: ReslicedReads, record: Callable[..., None]):
        self.store, self.landing, self.layout, self.config, self.loader = store, landing, layout, config, loader
        self._resliced, self._record = resliced, record

    def load(self, load: Load, deadline: float) -> dict[str, int]:
        """Wait until the producer's push has landed in this rank's store (sealed: every layer of
        every block), then copy it into the KV cache blocks and release it. Returns the bytes that
        landed over each push data path."""
        tid = load.p.transfer_id
        self.landing.wait(tid, deadline, self._first_chunk_by())
        buf = self.loader.landing_buffer(self._rows_per_read(load.n))  # page-locked: it goes host->device
        try:
            for group, rows in self._groups(tid, load, buf):
                try:
                    self.loader.load(rows, group, load.targets).wait(max(0.0, deadline - time.monotonic()))
                except TimeoutError:
                    raise TransferError(FailureCause.TIMEOUT, "copying the landed KV into the cache blocks "
                                        "missed the load deadline") from None
            self.loader.release_buffer(buf)
            return self.landing.landed_bytes(tid)
        except TransferError as exc:
            if exc.cause is not FailureCause.TIMEOUT:  # (after a timeout the copy may still read it)
                self.loader.release_buffer(buf)
            raise
        finally:
            self.free([tid])

    def load_fragments(self, load: Load, rs: Reslice, deadline: float) -> dict[str, int]:
        """Decode TP < prefill TP: each producer rank of the plan pushed the heads it serves here as
        a fragment (tp.py `push_routes`). Copy each sealed fragment's heads into this rank's rows; a
        fragment that did not land (refused, lost, never came) is pulled from its producer rank
        instead, which kept its copy (the others let theirs go once landed). The rows are loaded
        only once every rank's heads are in: nothing partial reaches the cache. After a failure
        the landed fragments stay for a retry (the others are remembered as failed, so a retry
        pulls them at once); the puller frees them after a final failure, as drop does."""
        layers = self.layout.num_layers
        # at most half the time left for the pushes: a pull from the producer must still fit after them
        landed_by = time.monotonic() + (deadline - time.monotonic()) / 2
        first_chunk_by = self._first_chunk_by()
        keys = [fragment_id(load.p.transfer_id, step.producer_rank) for step in rs.steps]
        mine = self.loader.landing_buffer(layers * load.n)
        moved: dict[str, int] = {}
        try:
            for step, key in zip(rs.steps, keys):
                try:
                    self._copy_fragment(key, step, rs, load, mine, landed_by, first_chunk_by)
                    got = self.landing.landed_bytes(key)
                except TransferError as exc:
                    self.landing.abandon(key, exc)  # what still comes is refused; a retry pulls it at once
                    logger.warning("pushed KV of request %s from producer rank %d did not land (%s); pulling it",
                                   load.spec.req_id, step.producer_rank, exc)
                    self._record("record_push_fallback", exc.cause.value)
                    got = self._resliced.pull_fragment(load, rs, step, mine, deadline)
                for label, nbytes in got.items():
                    moved[label] = moved.get(label, 0) + nbytes
        except BaseException:
            self.loader.release_buffer(mine)
            raise
        self.free(keys)
        self.loader.load_and_release(mine, range(layers), load.targets, deadline)
        return moved

    def abandon(self, tid: str, exc: TransferError) -> None:
        """`tid` will not be loaded from here: what still comes is refused in step."""
        self.landing.abandon(tid, exc)

    def free(self, keys: list[str]) -> None:
        """Let go of these entries of this rank's store, and of the landing side's records of them."""
        for key in keys:
            self.landing.forget(key)
            try:
                self.store.release(key)
            except TransferError:
                pass

    def free_fragments(self, tid: str) -> None:
        """A pushed request's head fragments (decode TP < prefill TP) land under their own ids."""
        if tid:
            self.free([k for k in self.store.keys() if is_fragment_of(k, tid)])

    # ------------------------------------------------------------------ internals
    def _first_chunk_by(self) -> float:
        return time.monotonic() + min(FIRST_CHUNK_GRACE_S, self.config.load_timeout_s / 2)

    def _copy_fragment(self, key: str, step: SliceStep, rs: Reslice, load: Load, mine: np.ndarray,
                       deadline: float, first_chunk_by: float) -> None:
        """Wait for head fragment `key` to be sealed here, copy its heads into `mine`."""
        self.landing.wait(key, deadline, first_chunk_by)
        landed = self.landing.heads_of(key)
        if landed != tuple(step.consumer_heads):  # another plan than ours (another version?): not these heads
            raise TransferError(FailureCause.LAYOUT_MISMATCH, f"fragment {key!r} holds heads {landed}, this rank's "
                                f"plan takes heads {tuple(step.consumer_heads)} from that producer rank")
        row = rs.consumer_row.with_heads(step.consumer_heads.count)
        theirs = np.empty((self._rows_per_read(load.n), self.store.slot_bytes), np.uint8)
        for group, rows in self._groups(key, load, theirs):
            # a fragment row sits in the first bytes of its slot
            copy_heads(rows[:, :row.row_bytes], row, HeadRange(0, row.heads),
                       mine[group.start * load.n:group.stop * load.n], rs.consumer_row, step.consumer_heads)

    def _rows_per_read(self, n: int) -> int:
        """Rows of an n-block landed entry read per read_into call: whole layers, LANDED_READ_BYTES at most."""
        return n * max(1, min(self.layout.num_layers, LANDED_READ_BYTES // (n * self.store.slot_bytes)))

    def _groups(self, key: str, load: Load, buf: np.ndarray) -> Iterator[tuple[range, np.ndarray]]:
        """The landed entry `key`'s rows, a group of layers at a time, read into `buf` (layer-major).
        read_into, not pinning: part of a landed entry may sit on NVMe, and DRAM may be too short to
        hold all of it at once. Several layers per call (this runs on the critical path, after the
        last push): per-call costs, not bytes, dominate small prompts."""
        layers, per_read = self.layout.num_layers, buf.shape[0] // load.n
        for first in range(0, layers, per_read):
            group = range(first, min(first + per_read, layers))
            rows = buf[:len(group) * load.n]
            try:
                self.store.read_into(key, list(group), load.spec.first_block, rows)
            except OSError as exc:  # the landing copy's disk tier failed: pull instead
                raise TransferError(FailureCause.PROTOCOL, f"reading the landed copy {key!r} failed: {exc}") from None
            if load.fault == "corrupt_landed":  # test hook: the landed copy on its way into the blocks
                tamper.corrupt(rows)
            yield group, rows


def fragment_shapes(layout: KVLayout, row_layout: RowLayout) -> Callable[[int, int], tuple[str, int]]:
    """For the landing receiver: the rows fingerprint and row bytes of a head fragment filling this
    rank's heads [start, stop) (tp.py `push_routes`); ValueError for a range that is not part of them."""
    known: dict[tuple[int, int], tuple[str, int]] = {}  # asked for every Push of a fragment

    def shape(start: int, stop: int) -> tuple[str, int]:
        got = known.get((start, stop))
        if got is not None:
            return got
        heads = layout.block_shape[0]
        if not 0 <= start < stop <= heads or stop - start == heads:
            raise ValueError(f"not a part of this rank's {heads} KV heads")
        n = stop - start
        got = (layout.with_heads(n).rows_fingerprint, row_layout.with_heads(n).row_bytes)
        known[(start, stop)] = got  # (at most heads^2 / 2 entries)
        return got
    return shape
