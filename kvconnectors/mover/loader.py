"""Loader: host bytes -> the engine's KV blocks.

Where the engine's cache is host memory and each block one run (vLLM's CPU backend), a data path
lands bytes in the blocks themselves: `direct_rows` and their `addrs()` (no copy here at all).
Otherwise the bytes land in a page-locked host buffer (`landing_buffer`) and `load` enqueues one
batched host->device scatter per layer on the copy stream; the load counts as finished only when
its event is done.
"""

from __future__ import annotations

import threading
import time
from typing import Sequence

import numpy as np
import torch

from kvconnectors.errors import FailureCause, TransferError
from kvconnectors.mover.device import CopyEvent, DeviceOps
from kvconnectors.mover.geometry import BlockGeometry
from kvconnectors.mover.block_views import BlockViews


class Loader:
    def __init__(self, geometry: BlockGeometry, ops: DeviceOps, *, pool_bytes: int = 256 << 20):
        self.geometry, self.ops = geometry, ops
        self.direct = geometry.device == "cpu" and geometry.block_contiguous
        # per layer: a uint8 [num_blocks, block_bytes] numpy view of the cache (direct mode only)
        self._rows = ([torch.as_strided(v, (geometry.num_blocks, geometry.block_bytes),
                                        (geometry.block_stride, 1)).numpy() for v in geometry.views]
                      if self.direct else [])
        self._pool_bytes = pool_bytes
        self._free: list[np.ndarray] = []  # page-locked buffers kept for reuse (pinning is slow)
        self._lent: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()

    # -- direct landing (host caches) ------------------------------------------------------------
    def direct_rows(self, layers: Sequence[int], block_ids: Sequence[int]) -> BlockViews | None:
        """Writable views of each (layer, block) of the cache, layer after layer, made as they are
        asked for (their `addrs()`: for NIXL descriptors and the shm copy); None when bytes cannot
        land in the cache directly (device memory, or blocks split in runs)."""
        if not self.direct:
            return None
        return BlockViews(self._rows, layers, block_ids)

    def host_arrays(self) -> list[np.ndarray]:
        """The cache's per-layer host row views (direct mode): what a NIXL agent registers."""
        return list(self._rows)

    # -- staged landing (device caches) ----------------------------------------------------------
    def landing_buffer(self, rows: int) -> np.ndarray:
        """A page-locked uint8 [rows, block_bytes] buffer; give it back with `release_buffer`."""
        need = rows * self.geometry.block_bytes
        with self._lock:
            i = next((i for i, b in enumerate(self._free) if b.size >= need), None)
            flat = self._free.pop(i) if i is not None else None
        if flat is None:
            flat = self.ops.host_buffer(need)
        view = flat[:need].reshape(rows, self.geometry.block_bytes)
        with self._lock:
            self._lent[id(view)] = flat
        return view

    def release_buffer(self, buf: np.ndarray) -> None:
        with self._lock:
            flat = self._lent.pop(id(buf), None)
            if flat is not None and sum(b.size for b in self._free) + flat.size <= self._pool_bytes:
                self._free.append(flat)

    def load(self, rows: np.ndarray, layers: Sequence[int], block_ids: Sequence[int],
             after: CopyEvent | None = None) -> CopyEvent:
        """Enqueue rows (uint8 [len(layers) * n, block_bytes], layer after layer) into the blocks."""
        layers = tuple(int(x) for x in layers)
        ids = np.asarray(block_ids, dtype=np.int64)
        n = ids.size
        if rows.shape != (len(layers) * n, self.geometry.block_bytes):
            raise ValueError(f"rows {rows.shape} do not hold {len(layers)} layers x {n} blocks of "
                             f"{self.geometry.block_bytes} B")
        host = torch.from_numpy(rows)

        def copy() -> None:
            index = self.ops.index(ids)
            for i, layer in enumerate(layers):
                dst = self.geometry.views[layer]
                self.ops.scatter(host[i * n:(i + 1) * n].view(n, *dst.shape[1:]), dst, index)
        return self.ops.enqueue(copy, after)

    def load_and_release(self, rows: np.ndarray, layers: Sequence[int], block_ids: Sequence[int],
                         deadline: float) -> None:
        """`load` and wait for it until `deadline` (time.monotonic); then the buffer goes back to the
        pool. Past the deadline: TransferError TIMEOUT, and the buffer stays lent (the copy may still
        read it)."""
        try:
            self.load(rows, layers, block_ids).wait(max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            raise TransferError(FailureCause.TIMEOUT, "copying the KV into the cache blocks missed the "
                                "load deadline") from None
        self.release_buffer(rows)
