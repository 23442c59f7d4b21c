"""BlockViews: a pull's destination blocks as writable views, each made only when it is asked for.

A pull names its destination as one view per (layer, block), layer after layer. Made up front that
is 4,096 memoryviews for 2,048 tokens of an 8B model, about 1.6 ms of a 16 ms shm pull, while the
paths that copy by address (shm, nixl, given `addrs()`) never touch most of them. Paths that do
(tcp's recvmsg_into, a checksum check) get them as they go, at the same cost as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import overload

import numpy as np


class BlockViews(Sequence[memoryview]):
    """Views of rows `arrays[layer][block]` for each layer of `layers` and block of `block_ids`,
    layer after layer. Each array is 2-D uint8 [blocks, row bytes] with whole rows contiguous
    (a KV cache layer seen as rows, or a buffer of rows)."""

    def __init__(self, arrays: Sequence[np.ndarray], layers: Sequence[int], block_ids: Sequence[int]):
        self._arrays, self._layers = arrays, list(layers)
        self._ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
        self._per_layer = len(self._ids)
        # Checked here, not when a view is made: addrs() turns ids into raw addresses for copies
        # that trust them (the shm copy, NIXL descriptors).
        self.row_bytes = arrays[self._layers[0]].shape[-1] if self._layers else 0
        for layer in self._layers:
            a = arrays[layer]
            if a.ndim != 2 or a.dtype != np.uint8 or a.strides[1] != 1 or a.shape[1] != self.row_bytes:
                raise ValueError(f"layer {layer}: rows must be 2-D uint8, contiguous, {self.row_bytes} B each; "
                                 f"got {a.dtype} {a.shape} strides {a.strides}")
            if self._per_layer and not (0 <= int(self._ids.min()) and int(self._ids.max()) < len(a)):
                raise IndexError(f"block ids {int(self._ids.min())}..{int(self._ids.max())} outside layer "
                                 f"{layer}'s {len(a)} blocks")
        self._ids_list = self._ids.tolist()

    @classmethod
    def of_rows(cls, rows: np.ndarray) -> "BlockViews":
        """Every row of one 2-D buffer, in order."""
        return cls([rows], [0], range(len(rows)))

    def __len__(self) -> int:
        return len(self._layers) * self._per_layer

    @overload
    def __getitem__(self, i: int) -> memoryview: ...

    @overload
    def __getitem__(self, i: slice) -> list[memoryview]: ...

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"block view {i} of {n}")
        layer, k = divmod(i, self._per_layer)
        return memoryview(self._arrays[self._layers[layer]][self._ids_list[k]])

    def addrs(self) -> np.ndarray:
        """uint64 address of every view's first byte, in the same order (made without the views)."""
        base = np.array([self._arrays[layer].ctypes.data for layer in self._layers], dtype=np.uint64)
        stride = np.array([self._arrays[layer].strides[0] for layer in self._layers], dtype=np.uint64)
        return (base[:, None] + self._ids.astype(np.uint64)[None, :] * stride[:, None]).reshape(-1)
