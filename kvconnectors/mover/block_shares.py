"""A pull's per-block work split into parallel shares: the shm copy and the checksum check.

One share per thread (a contiguous run of the block list), the calling thread running the first.
`copy_blocks` (shm): each block is copied out of the mapped arena and, when checksums are on, hashed
(xxh3) while it is still in cache, so verifying adds CPU, not memory traffic. Natively
(kvconnectors._blockcopy, built from kvconnectors/_native/blockcopy.c) a share runs without the GIL
and writes with streaming stores, hashing the source slot it has just read; without the build, each
block is one `memmove` and one xxh3 of the destination in Python, slower (the shares take turns at
the GIL). `first_mismatch` (nixl, after its READ): the xxh3 of each block, natively too when the
caller has the blocks' addresses. Small pulls stay on the calling thread.
`CheckBehind` (tcp): each layer's checksums are checked on another thread while the next layer is
still arriving, so a streamed read does not stop receiving to hash.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import xxhash

from kvconnectors.errors import FailureCause, TransferError

try:  # the C loop (setup.py NATIVE); None where the package was installed without a compiler
    from kvconnectors import _blockcopy as native
except ImportError:
    native = None

# At most this many threads work on one pull (the caller + THREADS - 1 pool threads).
THREADS = max(1, min(2, os.cpu_count() or 1))
MIN_BLOCKS_PER_SHARE = 64  # below this a share's hand-off costs more than it saves

_PREFIX = "kvc-blocks"
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=max(1, THREADS - 1), thread_name_prefix=_PREFIX)
        return _pool


def check_offsets(offsets: Sequence[int], slot: int, arena_bytes: int) -> np.ndarray:
    """The offsets as int64, each a slot boundary inside the arena, or a typed refusal naming the first
    that is not (they come from the producer: nothing is copied before all of them are checked)."""
    try:
        offs = np.asarray(offsets, dtype=np.int64)
    except (OverflowError, ValueError, TypeError):  # beyond int64: outside any arena
        off = next((o for o in offsets if not isinstance(o, int) or not -2**63 <= o < 2**63), offsets)
        raise TransferError(FailureCause.PROTOCOL, f"shm offset {off} outside the arena") from None
    bad = (offs < 0) | (offs > arena_bytes - slot) | (offs % slot != 0)
    if bad.any():
        off = int(offs[int(np.flatnonzero(bad)[0])])
        raise TransferError(FailureCause.PROTOCOL, f"shm offset {off} outside the arena or not at a slot "
                                                   f"boundary ({slot} B slots)")
    return offs


def _copy_share(src_base: int, offs: Sequence[int], dest: Sequence[memoryview], sums: Sequence[int] | None,
                start: int, stop: int, slot: int, addrs: Sequence[int] | None = None) -> int | None:
    """Copy blocks start..stop; the index of the first whose checksum differs (copying stops there).
    `addrs`: dest's addresses, worked out by the caller in one numpy pass (each block's Python work
    runs under the GIL, which the two shares take turns at: taking a view's address here cost about
    a tenth of a 64 KiB block's copy)."""
    memmove, digest = ctypes.memmove, xxhash.xxh3_64_intdigest
    for i in range(start, stop):
        view = dest[i]
        _check_size(view, i, slot)
        memmove(addrs[i] if addrs is not None else _address(view), src_base + offs[i], slot)
        if sums is not None and digest(view) != sums[i]:
            return i
    return None


def _in_shares(work: Callable[[int, int], int | None], n: int) -> int | None:
    """Run work(start, stop) over contiguous shares of range(n); the lowest index any share returned.
    Returns only when every share has stopped (even when one raised, whose error is then raised)."""
    shares = max(1, min(THREADS, n // MIN_BLOCKS_PER_SHARE))
    if threading.current_thread().name.startswith(_PREFIX):
        shares = 1  # called from a share itself: waiting on the pool from inside it could deadlock
    bounds = [n * k // shares for k in range(shares + 1)]
    futures: list[Future] = [_executor().submit(work, bounds[k], bounds[k + 1]) for k in range(1, shares)]
    try:
        first = work(bounds[0], bounds[1])
    finally:
        for f in futures:  # wait for every share, even when this one raised
            f.exception()
    found = [first] + [f.result() for f in futures]
    return next((i for i in found if i is not None), None)


def copy_blocks(arena: memoryview, offsets: Sequence[int], dest: Sequence[memoryview],
                sums: Sequence[int] | None, slot: int, dest_addrs: np.ndarray | None = None) -> int | None:
    """Copy arena[offsets[i]:+slot] into dest[i] for every i (offsets checked first, `check_offsets`);
    with `sums`, the first block (lowest index) whose xxh3 differs from sums[i], else None. The
    native copy hashes the arena slot right after copying it when it wrote with streaming stores
    (the destination is then not in cache; the slot is, and it is pinned and sealed on the producer,
    so it holds the bytes copied: what it cannot see is a producer writing a pinned slot during
    the copy), else the destination; the Python copy hashes the destination.
    `dest_addrs` (uint64, the caller's own: dest[i]'s address, as BlockViews.addrs gives them)
    spares taking each view's address; the caller vouches that each holds `slot` bytes, as it vouches
    for the address itself (without them, each view's size is checked). Returns only when every
    share has stopped: no thread writes into `dest` after this returns, and `arena` (whose mapping the
    raw addresses point into) is held until then."""
    offs = check_offsets(offsets, slot, len(arena))
    # one of each per block: the native loop reads offsets[i], sums[i] and dest_addrs[i] for every i
    for what, seq in (("offsets", offs), ("checksums", sums), ("destination addresses", dest_addrs)):
        if seq is not None and len(seq) != len(dest):
            raise TransferError(FailureCause.PROTOCOL, f"{len(seq)} {what} for {len(dest)} blocks")
    src_base = np.frombuffer(arena, dtype=np.uint8).ctypes.data
    if native is None:
        addrs = None if dest_addrs is None else np.asarray(dest_addrs, dtype=np.uint64).tolist()
        offs_list = offs.tolist()
        return _in_shares(lambda start, stop: _copy_share(src_base, offs_list, dest, sums, start, stop, slot, addrs),
                          len(dest))
    addrs_arr = _addresses(dest, slot) if dest_addrs is None else np.ascontiguousarray(dest_addrs, dtype=np.uint64)
    sums_arr = None if sums is None else _checksums(sums)
    offs = np.ascontiguousarray(offs, dtype=np.int64)
    raw = (src_base, offs.ctypes.data, addrs_arr.ctypes.data, 0 if sums_arr is None else sums_arr.ctypes.data)

    def share(start: int, stop: int) -> int | None:  # (the arrays above stay alive until every share stops)
        bad = native.copy_verify(*raw, start, stop, slot)
        return None if bad < 0 else bad
    return _in_shares(share, len(dest))


def _checksums(sums: Sequence[int]) -> np.ndarray:
    """The producer's checksums as uint64, or a typed refusal (they come off the wire: a value
    outside 0..2**64-1 is no xxh3)."""
    try:
        return np.ascontiguousarray(sums, dtype=np.uint64)
    except (OverflowError, ValueError, TypeError):
        bad = next((x for x in sums if not isinstance(x, int) or not 0 <= x < 2**64), sums)
        raise TransferError(FailureCause.PROTOCOL, f"checksum {bad!r} is not a 64-bit xxh3") from None


def _addresses(dest: Sequence[memoryview], slot: int) -> np.ndarray:
    """Each writable view's address, once its size is checked (the native copy trusts the length)."""
    out = np.empty(len(dest), dtype=np.uint64)
    for i, view in enumerate(dest):
        _check_size(view, i, slot)
        out[i] = _address(view)
    return out


def _check_size(view: memoryview, i: int, slot: int) -> None:
    """Destination block i must hold a whole slot: the copy trusts the length, a shorter view would
    be overrun."""
    if view.nbytes != slot:
        raise TransferError(FailureCause.PROTOCOL, f"destination block {i} holds {view.nbytes} B, "
                                                   f"the producer's slots {slot} B")


def _address(view: memoryview) -> int:
    """A writable view's address (a read-only one is refused by from_buffer)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def first_mismatch(sums: Sequence[int], views: Sequence[memoryview], addrs: np.ndarray | None = None) -> int | None:
    """The lowest i whose xxh3 of views[i] differs from sums[i], else None. With `addrs` (uint64, the
    caller's own: views[i]'s address, each view as long as views[0]) the native check hashes them
    without the GIL (xxhash's binding holds it, so Python shares hash one at a time)."""
    n = min(len(sums), len(views))
    if native is not None and addrs is not None and n:
        if len(addrs) < n:
            raise TransferError(FailureCause.PROTOCOL, f"{len(addrs)} block addresses for {n} blocks")
        addrs_arr = np.ascontiguousarray(addrs[:n], dtype=np.uint64)
        sums_arr = _checksums(sums[:n])
        nbytes = views[0].nbytes

        def native_share(start: int, stop: int) -> int | None:  # (the arrays stay alive until every share stops)
            bad = native.first_mismatch(addrs_arr.ctypes.data, sums_arr.ctypes.data, start, stop, nbytes)
            return None if bad < 0 else bad
        return _in_shares(native_share, n)

    def share(start: int, stop: int) -> int | None:
        digest = xxhash.xxh3_64_intdigest
        return next((i for i in range(start, stop) if digest(views[i]) != sums[i]), None)
    return _in_shares(share, n)


def hash_rows(rows: np.ndarray, out: np.ndarray) -> None:
    """out[i] = xxh3 of rows[i] for every row of a 2-D uint8 array with contiguous rows (the stager's
    checksums); natively without the GIL, where python-xxhash holds it for every row."""
    if rows.ndim != 2 or rows.dtype != np.uint8 or rows.strides[1] != 1:
        raise ValueError(f"rows must be 2-D uint8 with contiguous rows, got {rows.dtype} {rows.shape} {rows.strides}")
    if out.shape != (len(rows),) or out.dtype != np.uint64 or (len(rows) > 1 and out.strides[0] != 8):
        raise ValueError(f"out must be {len(rows)} contiguous uint64, got {out.dtype} {out.shape}")
    if not len(rows):
        return
    if native is not None and rows.shape[1] and rows.strides[0] >= rows.shape[1]:
        native.hash_rows(rows.ctypes.data, rows.strides[0], out.ctypes.data, len(rows), rows.shape[1])
        return
    digest = xxhash.xxh3_64_intdigest
    for i, row in enumerate(rows):
        out[i] = digest(row)


_behind: ThreadPoolExecutor | None = None


def _behind_executor() -> ThreadPoolExecutor:
    global _behind
    with _pool_lock:
        if _behind is None:
            _behind = ThreadPoolExecutor(max_workers=THREADS, thread_name_prefix="kvc-check")
        return _behind


class CheckBehind:
    """Checks blocks' xxh3 on another thread while the caller goes on receiving the next ones:
    `add(first, views)` for each run as it lands, `first_mismatch()` once all have (the lowest
    mismatching index, else None). `close()` waits for checks still running (the views are the
    caller's to reuse after it)."""

    def __init__(self, sums: Sequence[int]):
        self.sums = sums
        self._checks: list[Future] = []

    def add(self, first: int, views: Sequence[memoryview]) -> None:
        sums = self.sums

        def check() -> int | None:
            digest = xxhash.xxh3_64_intdigest
            return next((first + i for i, v in enumerate(views) if digest(v) != sums[first + i]), None)
        self._checks.append(_behind_executor().submit(check))

    def first_mismatch(self) -> int | None:
        found = [f.result() for f in self._checks]
        return min((i for i in found if i is not None), default=None)

    def close(self) -> None:
        """Cancel checks not started yet (a failed receive needs none of them) and wait for the rest."""
        for f in self._checks:
            f.cancel()
        for f in self._checks:
            if not f.cancelled():
                f.exception()  # waits; a check's own error is the caller's to see via first_mismatch
