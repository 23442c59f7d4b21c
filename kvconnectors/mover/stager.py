"""Stager: engine KV blocks of a layer (group) -> slots of the host store, asynchronously.

`stage` reserves the entry's slots (`TieredStore.begin_write`) and enqueues one batched gather per
layer on the copy stream, after the forward's event: on CUDA the device gathers and one DMA lands
the rows straight in the page-locked DRAM arena; on CPU the copy thread gathers straight into
the arena. `complete` waits for the copy event, checksums the rows and commits them. Rows whose
slots live on NVMe (or every row, when the arena could not be page-locked on CUDA) go through a
host bounce buffer and are written by `complete`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch
import xxhash

from kvconnectors.mover.device import CopyEvent, DeviceOps
from kvconnectors.mover.geometry import BlockGeometry
from kvconnectors.store import TieredStore
from kvconnectors.store.buffers import runs
from kvconnectors.store.views import WriteTarget


@dataclass
class StagedCopy:
    """One enqueued staging copy: `len(layers) * num_blocks` rows, layer after layer."""

    transfer_id: str
    layers: tuple[int, ...]
    first_block: int
    num_blocks: int
    target: WriteTarget
    bounce_pos: np.ndarray           # row positions that land in `bounce` instead of the arena
    bounce: np.ndarray | None        # uint8 [len(bounce_pos), block_bytes]
    event: CopyEvent | None = None
    completed: bool = field(default=False)

    @property
    def nbytes(self) -> int:
        return self.target.rows * self.target.slots.shape[1]


class Stager:
    def __init__(self, geometry: BlockGeometry, store: TieredStore, ops: DeviceOps, *, checksum: bool = True,
                 all_layer_gather: bool | None = None):
        if store.slot_bytes != geometry.block_bytes:
            raise ValueError(f"store slots of {store.slot_bytes} B cannot hold blocks of {geometry.block_bytes} B")
        self.geometry, self.store, self.ops, self.checksum = geometry, store, ops, checksum
        # Cross-layer layouts: stage every layer of a block from its one run with a single gather
        # (on a GPU: one gather kernel, one DMA). On CPU per-layer gathers copy once, not twice.
        self.all_layer_gather = (geometry.cross_layer and (ops.device_type == "cuda" if all_layer_gather is None
                                                          else all_layer_gather))
        self._slots = store.arena_slots()
        self._arena = torch.from_numpy(self._slots)   # [num_slots, block_bytes], host
        # Async DMA needs page-locked memory; if the arena cannot be, rows bounce (said once).
        self.arena_pinned = ops.pin(self._slots, "the store's DRAM arena") if self._slots.size else True

    def stage(self, transfer_id: str, layers: Sequence[int], first_block: int, block_ids: Sequence[int],
              after: CopyEvent | None = None) -> StagedCopy:
        """Reserve the slots of (layers x blocks) and enqueue their copy; returns at once."""
        layers = tuple(int(x) for x in layers)
        ids = np.asarray(block_ids, dtype=np.int64)
        n = ids.size
        target = self.store.begin_write(transfer_id, list(layers), first_block, len(layers) * n)
        try:
            bounce_pos = (np.arange(target.rows) if not self.arena_pinned else target.nvme_pos)
            bounce = (self.ops.host_buffer(bounce_pos.size * self.geometry.block_bytes)
                      .reshape(bounce_pos.size, self.geometry.block_bytes) if bounce_pos.size else None)
            copy = StagedCopy(transfer_id, layers, first_block, n, target, bounce_pos, bounce)
            copy.event = self.ops.enqueue(lambda: self._copy(copy, ids), after)
        except BaseException:
            self.store.end_write(target, None, ok=False)
            raise
        return copy

    def _copy(self, copy: StagedCopy, block_ids: np.ndarray) -> None:
        """On the copy stream: one gather per (layer, destination run); a run is normally the
        whole layer (a fresh entry's slots are consecutive)."""
        g = self.geometry
        ids = self.ops.index(block_ids)
        n = copy.num_blocks
        direct = ([] if not self.arena_pinned else copy.target.dram_runs)
        if (self.all_layer_gather and copy.layers == tuple(range(g.num_layers)) and len(direct) == 1
                and direct[0][2] == copy.target.rows):
            slot = direct[0][1]
            out = self._arena[slot:slot + copy.target.rows].view(g.num_layers, n, *g.views[0].shape[1:])
            # one run per block read for every layer, written in the store's layer-major order
            self.ops.gather(g.all_layers_view().transpose(0, 1), ids, out, dim=1)
            return
        bounce = torch.from_numpy(copy.bounce) if copy.bounce is not None else None
        for i, layer in enumerate(copy.layers):
            src = g.views[layer]
            lo, hi = i * n, (i + 1) * n
            for pos, slot, count in direct:
                a, b = max(pos, lo), min(pos + count, hi)
                if a < b:
                    out = self._arena[slot + a - pos:slot + b - pos].view(b - a, *src.shape[1:])
                    self.ops.gather(src, ids[a - lo:b - lo], out)
            if bounce is not None:
                rows = copy.bounce_pos
                sel = np.flatnonzero((rows >= lo) & (rows < hi))
                for first, start, count in runs(rows[sel] - lo):
                    out = bounce[sel[first]:sel[first] + count].view(count, *src.shape[1:])
                    self.ops.gather(src, ids[start:start + count], out)

    def complete(self, copy: StagedCopy, timeout_s: float | None = None) -> np.ndarray:
        """Wait for the copy, commit it to the store; returns the rows' xxh3 checksums as
        uint64 [len(layers), num_blocks] (zeros when checksums are off). A TimeoutError leaves the
        copy open (its slots held): call complete() again or abandon()."""
        assert copy.event is not None and not copy.completed
        target = copy.target
        try:
            copy.event.wait(timeout_s)
        except BaseException:
            if not copy.event.done():
                # Still copying into the slots (a timeout): keep holding them, so the entry's slots
                # cannot be freed and reused under the copy; complete() again, or abandon() (waits).
                raise
            copy.completed = True
            self.store.end_write(target, None, ok=False)
            raise
        copy.completed = True
        sums = np.zeros(target.rows, dtype=np.uint64)
        try:
            if copy.bounce is not None and not self.arena_pinned:  # every row bounced: into the arena now
                for pos, slot, count in target.dram_runs:
                    np.copyto(self._slots[slot:slot + count], copy.bounce[pos:pos + count])
            if self.checksum:
                for pos, slot, count in target.dram_runs:
                    for k in range(count):
                        sums[pos + k] = xxhash.xxh3_64_intdigest(self._slots[slot + k])
            nvme_rows = None
            if target.nvme_pos.size:
                # bounce rows are either exactly the NVMe rows (pinned arena) or every row
                nvme_rows = copy.bounce if self.arena_pinned else copy.bounce[target.nvme_pos]
                if self.checksum:
                    for k, pos in enumerate(target.nvme_pos.tolist()):
                        sums[pos] = xxhash.xxh3_64_intdigest(nvme_rows[k])
        except BaseException:
            self.store.end_write(target, None, ok=False)
            raise
        self.store.end_write(target, nvme_rows)
        return sums.reshape(len(copy.layers), copy.num_blocks)

    def abandon(self, copy: StagedCopy) -> None:
        """Give the slots back unwritten (the copy's transfer failed); waits for the copy first:
        the arena rows must not be reused under it."""
        if copy.completed or copy.event is None:
            return
        copy.completed = True
        try:
            copy.event.wait()
        except BaseException:
            pass
        self.store.end_write(copy.target, None, ok=False)

