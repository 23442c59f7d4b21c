"""A stack of free slot indices held in one numpy array: take/give are O(n) vector copies, with no
per-slot Python objects, so reserving thousands of slots on the staging path costs microseconds."""

from __future__ import annotations

import numpy as np


class FreeList:
    def __init__(self, capacity: int):
        self.capacity = int(capacity)
        # Descending, so the stack top is index 0: a fresh store hands out 0, 1, 2, ... which keeps an
        # entry's NVMe extents adjacent (one coalesced I/O) and its DRAM slots in one run (one memcpy).
        self._stack = np.arange(self.capacity - 1, -1, -1, dtype=np.int64)
        self._top = self.capacity

    def __len__(self) -> int:
        return self._top

    @property
    def used(self) -> int:
        return self.capacity - self._top

    def take(self, n: int) -> np.ndarray:
        """Return `n` free indices (ascending where possible); raise if fewer are free."""
        if n < 0 or n > self._top:
            raise ValueError(f"cannot take {n} of {self._top} free slots")
        out = self._stack[self._top - n:self._top][::-1].copy()
        self._top -= n
        return out

    def give(self, idx: np.ndarray) -> None:
        idx = np.asarray(idx, dtype=np.int64)
        if idx.size == 0:
            return
        if self._top + idx.size > self.capacity:
            raise AssertionError("free list overflow: a slot was freed twice")
        # Sorted descending so the next take() gets this run back in ascending order.
        self._stack[self._top:self._top + idx.size] = np.sort(idx)[::-1]
        self._top += idx.size

    def free_indices(self) -> np.ndarray:
        return self._stack[:self._top].copy()
