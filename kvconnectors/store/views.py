"""What `pinned_views` yields: read-only views of one DRAM-resident entry plus the arena byte offsets
a zero-copy sender (sendmsg, NIXL descriptors, a same-host shm reader) needs. Valid only inside the
`with` block; the accessors refuse afterwards, because the slots may be reused."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvconnectors.store.buffers import paired_runs, runs


class PinnedEntry:
    def __init__(self, key: str, num_layers: int, num_blocks: int, layers: tuple[int, ...], loc: np.ndarray,
                 slots: np.ndarray, slot_bytes: int, base_address: int, shm_path: str | None):
        self.key, self.num_layers, self.num_blocks = key, num_layers, num_blocks
        self.layers = layers
        self.slot_bytes = slot_bytes
        self.base_address = base_address   # register [base_address, +arena size) once with NIXL
        self.shm_path = shm_path           # same-host readers map this read-only
        self._loc = loc.reshape(num_layers, num_blocks)  # a private copy: DRAM slot numbers
        self._slots = slots
        self._open = True

    def _check(self, layer: int, block: int | None = None) -> None:
        if not self._open:
            raise RuntimeError(f"pinned views of {self.key!r} used after the with-block ended")
        if layer not in self.layers:
            raise IndexError(f"layer {layer} is not pinned (pinned: {list(self.layers)})")
        if block is not None and not 0 <= block < self.num_blocks:
            raise IndexError(f"block {block} out of range [0, {self.num_blocks})")

    def slot_index(self, layer: int, block: int) -> int:
        self._check(layer, block)
        return int(self._loc[layer, block])

    def offset(self, layer: int, block: int) -> int:
        """Byte offset of (layer, block) in the arena (and in the shm file)."""
        return self.slot_index(layer, block) * self.slot_bytes

    def offsets(self, layer: int) -> np.ndarray:
        self._check(layer)
        return self._loc[layer] * self.slot_bytes

    def array(self, layer: int, block: int) -> np.ndarray:
        view = self._slots[self.slot_index(layer, block)]
        view.flags.writeable = False
        return view

    def memoryview(self, layer: int, block: int) -> memoryview:
        return memoryview(self.array(layer, block))

    def layer_views(self, layer: int) -> list[memoryview]:
        return [self.memoryview(layer, b) for b in range(self.num_blocks)]

    def byte_runs(self, layer: int) -> list[tuple[int, int]]:
        """(arena offset, length) of each contiguous stretch of the layer's blocks, in block order:
        few large sends / descriptors instead of one per block."""
        self._check(layer)
        return [(first * self.slot_bytes, n * self.slot_bytes) for _, first, n in runs(self._loc[layer])]

    def run_views(self, layer: int, first: int, last: int) -> list[memoryview]:
        """Read-only 1-D memoryviews of blocks [first, last) of `layer`, one per contiguous arena run,
        in block order: a gather send of a few runs instead of one view per block."""
        self._check(layer)
        if not 0 <= first <= last <= self.num_blocks:
            raise IndexError(f"blocks [{first}, {last}) out of range [0, {self.num_blocks}]")
        views = []
        for _, slot, n in runs(self._loc[layer, first:last]):
            run = self._slots[slot:slot + n].reshape(-1)
            run.flags.writeable = False
            views.append(memoryview(run))
        return views

    def close(self) -> None:
        self._open = False
        self._slots = None  # type: ignore[assignment]


class WriteTarget:
    """Slots reserved by `TieredStore.begin_write`: rows at `dram_runs` go straight into the DRAM
    arena (`slots[slot:slot+n] = rows[pos:pos+n]`); rows at `nvme_pos` go to `end_write`."""

    def __init__(self, entry: Any, idx: Any, loc: np.ndarray, slots: np.ndarray):
        self.entry, self.idx, self.loc, self.slots = entry, idx, loc, slots
        in_dram = loc >= 0
        pos = np.flatnonzero(in_dram)
        self.nvme_pos = np.flatnonzero(~in_dram)
        # (row position, first slot, count) per run of consecutive slots
        self.dram_runs: list[tuple[int, int, int]] = list(paired_runs(pos, loc[pos])) if pos.size else []

    @property
    def rows(self) -> int:
        return int(self.loc.size)
