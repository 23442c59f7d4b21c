"""Turning caller buffers into (n, slot_bytes) uint8 views, page-aligned scratch memory, and
finding runs of consecutive slot numbers (one memcpy / one I/O per run instead of per slot)."""

from __future__ import annotations

import mmap
from typing import Any, Iterator, NamedTuple

import numpy as np

PAGE = mmap.PAGESIZE


class SlotRows(NamedTuple):
    """Slot i of an NVMe transfer is mem[idx[i]]: rows of one (m, slot_bytes) array, named by number so
    that runs of adjacent rows move as one buffer (no numpy view per slot)."""
    mem: np.ndarray
    idx: np.ndarray


def as_slots(obj: Any, slot_bytes: int, *, writable: bool, what: str) -> np.ndarray:
    """View `obj` (ndarray, bytes-like, or anything np.asarray takes, e.g. a CPU torch tensor) as
    uint8 of shape (n, slot_bytes) without copying. Raises TypeError/ValueError on a bad buffer."""
    if isinstance(obj, np.ndarray):
        arr = obj
    elif isinstance(obj, (list, tuple, str)):  # np.asarray would copy: writes would vanish
        raise TypeError(f"{what}: need a buffer, not a {type(obj).__name__}")
    else:
        try:
            arr = np.frombuffer(obj, dtype=np.uint8)
        except (TypeError, ValueError, BufferError):
            arr = _from_array_like(obj, what)
    if arr.dtype == object:
        raise TypeError(f"{what}: not a byte buffer ({type(obj).__name__})")
    if not arr.flags.c_contiguous:
        raise ValueError(f"{what}: buffer must be C-contiguous")
    if writable and not arr.flags.writeable:
        raise ValueError(f"{what}: buffer is read-only")
    flat = arr.reshape(-1).view(np.uint8)
    if flat.size == 0 or flat.size % slot_bytes:
        raise ValueError(f"{what}: {flat.size} bytes is not a positive multiple of slot_bytes={slot_bytes}")
    return flat.reshape(-1, slot_bytes)


def _from_array_like(obj: Any, what: str) -> np.ndarray:
    """CPU torch tensors (and other __array__ providers) without copying. bf16 and other dtypes numpy
    lacks are reinterpreted as bytes first; torch is only touched when the caller passed a tensor."""
    if type(obj).__module__.partition(".")[0] == "torch":
        import torch  # noqa: PLC0415 - the store itself never needs torch

        if obj.device.type != "cpu":
            raise ValueError(f"{what}: tensor is on {obj.device}; the store takes host memory")
        if not obj.is_contiguous():
            raise ValueError(f"{what}: buffer must be C-contiguous")
        return obj.view(torch.uint8).numpy()
    return np.asarray(obj)


def address(arr: np.ndarray) -> int:
    return int(arr.__array_interface__["data"][0])


def is_aligned(arr: np.ndarray, align: int = PAGE) -> bool:
    return address(arr) % align == 0 and arr.nbytes % align == 0


def anonymous_mapping(nbytes: int, *, shared: bool = False) -> mmap.mmap:
    """`nbytes` of page-aligned anonymous memory with the transparent-huge-page hint, not yet faulted
    in (the hint must come first). Private by default, not mmap.mmap(-1, n)'s MAP_SHARED: shared
    anonymous memory is shmem, which gets no THP where shmem_enabled=never, and O_DIRECT from 4 KiB pages
    pins more pages and splits each I/O into more, smaller block requests. `shared=True` is for the
    transfer benchmark, whose buffers have always been shared (its numbers must stay comparable)."""
    m = mmap.mmap(-1, nbytes, flags=(mmap.MAP_SHARED if shared else mmap.MAP_PRIVATE) | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):  # fewer TLB misses and bigger block requests; a hint only
        try:
            m.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    return m


def private_mapping(nbytes: int) -> mmap.mmap:
    """The store's kind of memory: private anonymous, huge-page hint, not yet faulted in."""
    return anonymous_mapping(nbytes)


def aligned_empty(nbytes: int) -> tuple[mmap.mmap, np.ndarray]:
    """Page-aligned scratch (O_DIRECT rejects malloc'ed numpy buffers, which sit 16 B past a page)."""
    m = private_mapping(max(nbytes, PAGE))
    return m, np.frombuffer(m, dtype=np.uint8, count=nbytes)


def aligned_zeros(nbytes: int, *, shared: bool = False) -> tuple[mmap.mmap, np.ndarray]:
    """Page-aligned, huge-page-hinted, zero-filled and faulted in now, so first-touch page faults stay
    out of whatever is timed later (the benchmarks' buffers). Keep the mmap alive with the array."""
    m = anonymous_mapping(max(nbytes, PAGE), shared=shared)
    a = np.frombuffer(m, dtype=np.uint8, count=nbytes)
    a[:] = 0
    return m, a


def runs(idx: np.ndarray) -> Iterator[tuple[int, int, int]]:
    """Yield (position, first_value, length) for each run of consecutive values in `idx`."""
    n = idx.size
    if n == 0:
        return
    breaks = np.flatnonzero(np.diff(idx) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [n]))
    for s, e in zip(starts.tolist(), ends.tolist()):
        yield s, int(idx[s]), e - s


def paired_runs(a: np.ndarray, b: np.ndarray) -> Iterator[tuple[int, int, int]]:
    """Yield (a0, b0, length) for each stretch where `a` and `b` both step by one."""
    n = a.size
    if n == 0:
        return
    breaks = np.flatnonzero((np.diff(a) != 1) | (np.diff(b) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [n]))
    for s, e in zip(starts.tolist(), ends.tolist()):
        yield int(a[s]), int(b[s]), e - s


def row_views(mem: np.ndarray, rows: np.ndarray) -> list[np.ndarray]:
    """mem[rows] as a list of views, one per run of consecutive row numbers (in `rows` order)."""
    return [mem[first:first + n] for _, first, n in runs(rows)]
