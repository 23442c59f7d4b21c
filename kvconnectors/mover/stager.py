"""Stager: engine KV blocks of a layer (group) -> slots of the host store, asynchronously.

`stage` reserves the entry's slots (`TieredStore.begin_write`) and enqueues one batched gather per
layer on the copy stream, after the forward's event: on CUDA the device gathers and one DMA lands
the rows straight in the page-locked DRAM arena; on CPU the copy thread gathers straight into
the arena. Each layer's copy has its own event, so `complete` checksums layer i while the copy
stream still moves layer i+1 (the checksum pass then costs about one layer, not all of them), and
commits the rows once every layer is in. Rows whose
slots live on NVMe (or every row, when the arena could not be page-locked on CUDA) go through a
host bounce buffer and are written by `complete`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from kvconnectors.mover.device import CopyEvent, DeviceOps
from kvconnectors.mover.geometry import BlockGeometry
from kvconnectors.store import TieredStore
from kvconnectors.store.buffers import runs
from kvconnectors.store.views import WriteTarget
from kvconnectors.mover.block_shares import hash_rows


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
    layer_events: list[CopyEvent] = field(default_factory=list)  # one per layer (one in all: all-layer gather)
    completed: bool = field(default=False)
    sums: np.ndarray | None = None   # uint64 [rows] xxh3 of each row, filled as its layer comes in
    checked: int = 0                 # layer events waited for and checksummed so far

    @property
    def event(self) -> CopyEvent | None:
        """Done when the whole copy is: the stream runs its copies in order, so the last one's event."""
        return self.layer_events[-1] if self.layer_events else None

    @property
    def nbytes(self) -> int:
        return self.target.rows * self.target.slots.shape[1]


class _StreamIndex:
    """The block ids as a device index tensor, made on the copy stream by the first copy that needs
    it: made on the caller's stream instead, the copy stream would not wait for its host->device
    copy, and the caching allocator could hand its memory to the caller's stream while the copy
    stream still reads it. Every later layer's copy runs after the first on the same stream."""

    def __init__(self, ops: DeviceOps, ids: np.ndarray):
        self.ops, self.ids, self.tensor = ops, ids, None

    def __call__(self) -> torch.Tensor:
        if self.tensor is None:
            self.tensor = self.ops.index(self.ids)
        return self.tensor


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
        copy: StagedCopy | None = None
        try:
            bounce_pos = (np.arange(target.rows) if not self.arena_pinned else target.nvme_pos)
            bounce = (self.ops.host_buffer(bounce_pos.size * self.geometry.block_bytes)
                      .reshape(bounce_pos.size, self.geometry.block_bytes) if bounce_pos.size else None)
            copy = StagedCopy(transfer_id, layers, first_block, n, target, bounce_pos, bounce,
                              sums=np.zeros(target.rows, dtype=np.uint64))
            index = _StreamIndex(self.ops, ids)
            if self._one_gather(copy):
                copy.layer_events.append(self.ops.enqueue(lambda: self._copy_all_layers(copy, index()), after))
            else:
                for i in range(len(layers)):  # the stream keeps them in order: only the first waits
                    copy.layer_events.append(
                        self.ops.enqueue(lambda i=i: self._copy_layer(copy, index(), i), after if i == 0 else None))
        except BaseException:
            if copy is not None and copy.layer_events:
                self.abandon(copy)  # some layers are already on the stream: wait for them first
            else:
                self.store.end_write(target, None, ok=False)
            raise
        return copy

    def _direct_runs(self, copy: StagedCopy) -> list[tuple[int, int, int]]:
        """(row position, arena slot, count) of the rows the stream writes straight into the arena."""
        return [] if not self.arena_pinned else copy.target.dram_runs

    def _one_gather(self, copy: StagedCopy) -> bool:
        direct = self._direct_runs(copy)
        return (self.all_layer_gather and copy.layers == tuple(range(self.geometry.num_layers))
                and len(direct) == 1 and direct[0][2] == copy.target.rows)

    def _copy_all_layers(self, copy: StagedCopy, ids: torch.Tensor) -> None:
        """On the copy stream: one run per block read for every layer, written in the store's
        layer-major order (cross-layer layouts on CUDA: one gather kernel, one DMA)."""
        g, slot = self.geometry, self._direct_runs(copy)[0][1]
        out = self._arena[slot:slot + copy.target.rows].view(g.num_layers, copy.num_blocks, *g.views[0].shape[1:])
        self.ops.gather(g.all_layers_view().transpose(0, 1), ids, out, dim=1)

    def _copy_layer(self, copy: StagedCopy, ids: torch.Tensor, i: int) -> None:
        """On the copy stream: layer i's gathers, one per destination run; a run is normally the
        whole layer (a fresh entry's slots are consecutive)."""
        src = self.geometry.views[copy.layers[i]]
        n = copy.num_blocks
        lo, hi = i * n, (i + 1) * n
        for pos, slot, count in self._direct_runs(copy):
            a, b = max(pos, lo), min(pos + count, hi)
            if a < b:
                out = self._arena[slot + a - pos:slot + b - pos].view(b - a, *src.shape[1:])
                self.ops.gather(src, ids[a - lo:b - lo], out)
        if copy.bounce is not None:
            bounce = torch.from_numpy(copy.bounce)
            rows = copy.bounce_pos
            sel = np.flatnonzero((rows >= lo) & (rows < hi))
            for first, start, count in runs(rows[sel] - lo):
                out = bounce[sel[first]:sel[first] + count].view(count, *src.shape[1:])
                self.ops.gather(src, ids[start:start + count], out)

    def complete(self, copy: StagedCopy, timeout_s: float | None = None) -> np.ndarray:
        """Wait for the copy layer by layer, checksumming each layer as soon as it is in, then
        commit it to the store; returns the rows' xxh3 checksums as uint64 [len(layers), num_blocks]
        (zeros when checksums are off). A TimeoutError leaves the copy open (its slots held): call
        complete() again (it goes on where it stopped) or abandon()."""
        assert copy.layer_events and not copy.completed
        target = copy.target
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        per_event = target.rows // len(copy.layer_events)
        while copy.checked < len(copy.layer_events):
            event = copy.layer_events[copy.checked]
            try:
                event.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
            except BaseException:
                if not event.done():
                    # Still copying into the slots (a timeout): keep holding them, so the entry's
                    # slots cannot be freed and reused under the copy.
                    raise
                self.abandon(copy)  # this layer's copy failed: wait for the others, free the slots
                raise
            try:
                lo = copy.checked * per_event
                self._land(copy, lo, lo + per_event)
            except BaseException:
                self.abandon(copy)
                raise
            copy.checked += 1
        nvme_rows = None
        try:
            if target.nvme_pos.size:
                # bounce rows are either exactly the NVMe rows (pinned arena) or every row
                nvme_rows = copy.bounce if self.arena_pinned else copy.bounce[target.nvme_pos]
                if self.checksum:
                    sums = np.empty(len(target.nvme_pos), dtype=np.uint64)
                    hash_rows(nvme_rows, sums)  # nvme_rows[k] is the row at nvme_pos[k]
                    copy.sums[target.nvme_pos] = sums
        except BaseException:
            self.abandon(copy)
            raise
        copy.completed = True
        self.store.end_write(target, nvme_rows)
        return copy.sums.reshape(len(copy.layers), copy.num_blocks)

    def _land(self, copy: StagedCopy, lo: int, hi: int) -> None:
        """Rows [lo, hi) are in host memory: bounce them into the arena if they bounced, checksum
        the ones in the arena (NVMe rows are checksummed once every layer is in)."""
        for pos, slot, count in copy.target.dram_runs:
            a, b = max(pos, lo), min(pos + count, hi)
            if a >= b:
                continue
            first = slot + a - pos
            if copy.bounce is not None and not self.arena_pinned:  # every row bounced
                np.copyto(self._slots[first:first + b - a], copy.bounce[a:b])
            if self.checksum:
                hash_rows(self._slots[first:first + b - a], copy.sums[a:b])

    def abandon(self, copy: StagedCopy) -> None:
        """Give the slots back unwritten (the copy's transfer failed); waits for the copy first:
        the arena rows must not be reused under it."""
        if copy.completed or copy.event is None:
            return
        copy.completed = True
        for event in copy.layer_events:
            try:
                event.wait()
            except BaseException:
                pass
        self.store.end_write(copy.target, None, ok=False)

