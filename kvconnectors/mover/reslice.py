"""Head slices of host block rows: where a run of KV heads sits inside one (layer, block) row, and
batched copies of those slices between producer rows and consumer rows of different TP sizes.

A row (what the store holds, `BlockGeometry.block_bytes`) is one block of one layer in physical
order: the layout's axis order with the layer axis dropped and the block axis standing for the
kernel blocks (S) of a manager block, e.g. LBHNC -> [S, H, N, C], LBNHC -> [S, N, H, C],
LHBNC -> [H, S, N, C]. Seen as [outer, H, inner] (inner in bytes), heads h0..h1 are `outer` runs of
`(h1 - h0) * inner` bytes: one run where heads lead the row (a strided copy), one per token where
they interleave with tokens (NHD: a gather of C-byte pieces). A producer sending only some heads
(the tcp head read, a sliced push) checks, packs and rehashes its staged rows in one place,
`pack_checked_heads`. Which heads go where is planned in `tiered/tp.py` (over `mover.heads`).

vLLM's CPU backend (CPU_ATTN, LBHNC only) packs the interior of each (kernel block, head) region
per ISA: K column-major for vec/vec16, K in 16-token quad-word groups and V in token pairs for
AMX bf16, FP8 groups for amx_fp8 (csrc/cpu/cpu_attn_*.hpp, `reshape_and_cache`, which addresses
`block * num_blocks_stride + head * cache_head_num_stride`). The packing never crosses a head (checked
against vLLM's own writer for every ISA it picks: tests/unit/test_cpu_attn_packing.py), so a
whole-head run is still a contiguous byte range; only its interior differs by ISA, which is why
both sides must run the same ISA and why a token-outermost CPU_ATTN row is refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence, Union

import numpy as np
import torch

from kvconnectors.mover.block_shares import hash_rows
from kvconnectors.mover.checksums import verify_checksums
from kvconnectors.mover.geometry import LAYOUTS, PLAIN_CACHE_DTYPES, BlockGeometry, UnsupportedKVCache
from kvconnectors.mover.heads import HeadRange, HeadSplitError, SliceStep

Rows = Union[np.ndarray, torch.Tensor]  # uint8 [n, row_bytes], each row dense (last stride 1)

# Backends whose kernels pack a block's interior per head: only head-major rows can be sliced.
HEAD_PACKED_BACKENDS = ("CPU_ATTN",)


@dataclass(frozen=True)
class RowLayout:
    """The physical order of one (layer, block) row: `dims` outermost first, content in bytes."""

    dims: tuple[tuple[str, int], ...]   # (axis, size): axes S, H, N, C
    layout: str
    dtype: str
    backend: str
    mla: bool

    @property
    def heads(self) -> int:
        return dict(self.dims)["H"]

    @property
    def row_bytes(self) -> int:
        return math.prod(size for _, size in self.dims)

    @property
    def outer(self) -> int:
        """Runs per head slice: product of the axes before H."""
        return math.prod(size for axis, size in self.dims[:self._h])

    @property
    def inner(self) -> int:
        """Bytes of one head in one run: product of the axes after H."""
        return math.prod(size for axis, size in self.dims[self._h + 1:])

    @property
    def heads_outermost(self) -> bool:
        """A head slice is one contiguous run of the row."""
        return self.outer == 1

    @property
    def _h(self) -> int:
        return [axis for axis, _ in self.dims].index("H")

    def with_heads(self, heads: int) -> RowLayout:
        return RowLayout(tuple((a, heads if a == "H" else s) for a, s in self.dims), self.layout, self.dtype,
                         self.backend, self.mla)

    def describe(self) -> str:
        return f"layout {self.layout} dtype {self.dtype} row [{', '.join(f'{a}={s}' for a, s in self.dims)}]"


def _refuse(what: str, layout: str, dtype: str, backend: str) -> UnsupportedKVCache:
    return UnsupportedKVCache(f"cannot slice KV heads: {what} (KV cache layout {layout}, dtype {dtype}, "
                              f"attention backend {backend})")


def row_layout(layout: str, *, heads: int, tokens: int, content_bytes: int, splits: int = 1,
               dtype: str = "unknown", backend: str = "unknown", cache_dtype: str = "auto",
               mla: bool = False) -> RowLayout:
    """The row of a `layout` cache whose kernel blocks hold `heads` x `tokens` x `content_bytes`,
    `splits` kernel blocks per manager block; refuses, naming layout and dtype, what cannot be
    sliced by head."""
    if layout not in LAYOUTS:
        raise _refuse(f"layout {layout!r} does not say where the heads sit in a block (one of "
                      f"{', '.join(LAYOUTS)})", layout, dtype, backend)
    if cache_dtype not in PLAIN_CACHE_DTYPES:
        raise _refuse(f"kv_cache_dtype {cache_dtype} keeps scales inside the pages", layout, dtype, backend)
    sizes = {"S": splits, "H": heads, "N": tokens, "C": content_bytes}
    for axis, size in sizes.items():
        if not isinstance(size, int) or size < 1:
            raise _refuse(f"axis {axis} has size {size!r}", layout, dtype, backend)
    order = ["S" if axis == "B" else axis for axis in layout if axis != "L"]
    if backend in HEAD_PACKED_BACKENDS and order.index("N") < order.index("H"):
        raise _refuse(f"{backend} packs each head's tokens of a block together (K transposed, AMX tiles), "
                      f"so a token-outermost row has no per-head byte ranges", layout, dtype, backend)
    return RowLayout(tuple((axis, sizes[axis]) for axis in order), layout, dtype, backend, mla)


def geometry_row_layout(g: BlockGeometry, cache_dtype: str | None = None) -> RowLayout:
    """The row layout of a registered cache, checked against the geometry's own physical view."""
    heads, tokens, content = g.block_shape
    es = torch.empty(0, dtype=getattr(torch, g.dtype)).element_size()
    rl = row_layout(g.layout, heads=heads, tokens=tokens, content_bytes=content * es, splits=g.kernel_splits,
                    dtype=g.dtype, backend=g.backend, cache_dtype=cache_dtype or g.cache_dtype, mla=g.mla)
    # size-1 axes have no meaningful stride, so the geometry may sort them anywhere
    want = [s for _, s in rl.dims if s != 1]
    have = [int(s) for s in g.views[0].shape[1:] if s != 1]
    if want != have or rl.row_bytes != g.block_bytes:
        raise _refuse(f"the cache's physical block axes {have} are not the {rl.describe()} its layout implies",
                      g.layout, g.dtype, g.backend)
    return rl


def check_pair(producer: RowLayout, consumer: RowLayout) -> None:
    """Producer and consumer rows may differ only in their head count."""
    for field in ("layout", "dtype", "backend", "mla"):
        if getattr(producer, field) != getattr(consumer, field):
            raise HeadSplitError(field, getattr(consumer, field),
                                 f"consumer differs from producer's {getattr(producer, field)!r}")
    if producer.with_heads(consumer.heads) != consumer:
        raise HeadSplitError("row", consumer.describe(), f"consumer differs from producer's {producer.describe()} "
                             "in more than the head count")


def head_runs(rl: RowLayout, heads: HeadRange) -> tuple[np.ndarray, int]:
    """(byte offsets of each run inside a row, bytes per run) of heads `heads` of a row."""
    _check_range(rl, heads, "heads")
    h, inner = rl.heads, rl.inner
    offsets = np.arange(rl.outer, dtype=np.int64) * (h * inner) + heads.start * inner
    return offsets, heads.count * inner


def _check_range(rl: RowLayout, heads: HeadRange, field: str) -> None:
    if not 0 <= heads.start < heads.stop <= rl.heads:
        raise HeadSplitError(field, tuple(heads), f"is not a non-empty range of the row's {rl.heads} heads")


def _heads_view(rows: Rows, rl: RowLayout, field: str) -> Rows:
    """rows as [n, outer, H, inner] without copying (writes through to `rows`, e.g. a cache's rows)."""
    if rows.ndim != 2 or rows.shape[1] != rl.row_bytes:
        raise HeadSplitError(field, tuple(rows.shape), f"is not [rows, {rl.row_bytes}] ({rl.describe()})")
    shape = (rows.shape[0], rl.outer, rl.heads, rl.inner)
    if isinstance(rows, torch.Tensor):
        if rows.dtype != torch.uint8 or rows.stride(1) != 1:
            raise HeadSplitError(field, f"{rows.dtype} strides {rows.stride()}", "rows must be dense uint8")
        return rows.view(shape)
    if rows.dtype != np.uint8 or rows.strides[1] != 1:
        raise HeadSplitError(field, f"{rows.dtype} strides {rows.strides}", "rows must be dense uint8")
    return rows.reshape(shape)  # splits the dense byte axis only: always a view, even of padded rows


def copy_heads(src: Rows, src_layout: RowLayout, src_heads: HeadRange, dst: Rows, dst_layout: RowLayout,
               dst_heads: HeadRange) -> None:
    """dst[:, heads dst_heads] = src[:, heads src_heads] for every row of a batch (one strided copy)."""
    check_pair(src_layout, dst_layout)
    _check_range(src_layout, src_heads, "src_heads")
    _check_range(dst_layout, dst_heads, "dst_heads")
    if src_heads.count != dst_heads.count:
        raise HeadSplitError("dst_heads", tuple(dst_heads), f"holds {dst_heads.count} heads, src_heads "
                             f"{tuple(src_heads)} {src_heads.count}")
    if src.shape[0] != dst.shape[0]:
        raise HeadSplitError("dst", tuple(dst.shape), f"has another row count than src {tuple(src.shape)}")
    s = _heads_view(src, src_layout, "src")[:, :, src_heads.start:src_heads.stop]
    d = _heads_view(dst, dst_layout, "dst")[:, :, dst_heads.start:dst_heads.stop]
    if isinstance(d, torch.Tensor):
        d.copy_(s if isinstance(s, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(s)))
    else:
        d[...] = s.numpy() if isinstance(s, torch.Tensor) else s


def pack_heads(rows: Rows, rl: RowLayout, heads: HeadRange) -> np.ndarray:
    """The bytes of heads `heads` of each row, runs concatenated: uint8 [n, outer * count * inner]
    (what travels when a producer sends only a consumer's slice). Always a copy, never a view of
    `rows` (a slice that happens to be contiguous, e.g. one row, would otherwise change with it)."""
    _check_range(rl, heads, "heads")
    v = _heads_view(rows, rl, "rows")[:, :, heads.start:heads.stop]
    v = v.numpy() if isinstance(v, torch.Tensor) else v
    return np.array(v, dtype=np.uint8, order="C", copy=True).reshape(rows.shape[0], -1)


def pack_checked_heads(rows: np.ndarray, rl: RowLayout, heads: HeadRange, staged: Sequence[int] | None,
                       transfer_id: str, *, first: int = 0,
                       of: int | None = None) -> tuple[np.ndarray, list[int] | None]:
    """Heads `heads` of staged rows as they travel to a consumer rank of another TP size (the tcp
    head read, a sliced push): (packed rows, their xxh3 checksums). With `staged` (the rows' staged
    checksums; None: checksums are off) the rows are checked first, so corruption in the producer's
    store fails as checksum_mismatch (naming block first + i of `of`), as the consumer would have
    found it on whole rows; packing drops the staged sums, so the packed rows get their own."""
    if staged is not None:
        verify_checksums(staged, [memoryview(r) for r in rows], transfer_id, first=first, of=of)
    packed = pack_heads(rows, rl, heads)
    if staged is None:
        return packed, None
    sums = np.empty(len(packed), dtype=np.uint64)
    hash_rows(packed, sums)  # the stager's xxh3, natively without the GIL
    return packed, sums.tolist()


def unpack_heads(packed: np.ndarray, rows: Rows, rl: RowLayout, heads: HeadRange) -> None:
    """Land `pack_heads` output in heads `heads` of each row."""
    _check_range(rl, heads, "heads")
    need = rl.outer * heads.count * rl.inner
    if packed.ndim != 2 or packed.shape != (rows.shape[0], need):
        raise HeadSplitError("packed", tuple(packed.shape), f"is not [{rows.shape[0]}, {need}]")
    d = _heads_view(rows, rl, "rows")[:, :, heads.start:heads.stop]
    src = packed.reshape(rows.shape[0], rl.outer, heads.count, rl.inner)
    if isinstance(d, torch.Tensor):
        d.copy_(torch.from_numpy(np.ascontiguousarray(src)))
    else:
        d[...] = src


def assemble(plan: Sequence[SliceStep], producer_rows: Mapping[int, Rows], producer_layout: RowLayout,
             consumer_rows: Rows, consumer_layout: RowLayout) -> None:
    """Fill a consumer rank's rows from the producer ranks' rows of the same (layer, block) list,
    one batched copy per plan step; every consumer head must be written exactly once."""
    covered = np.zeros(consumer_layout.heads, dtype=np.int64)
    for step in plan:
        if step.producer_rank not in producer_rows:
            raise HeadSplitError("producer_rank", step.producer_rank,
                                 f"the plan reads it, rows came from ranks {sorted(producer_rows)}")
        copy_heads(producer_rows[step.producer_rank], producer_layout, step.producer_heads, consumer_rows,
                   consumer_layout, step.consumer_heads)
        covered[step.consumer_heads.start:step.consumer_heads.stop] += 1
    if not (covered == 1).all():
        raise HeadSplitError("plan", [tuple(s.consumer_heads) for s in plan],
                             f"writes consumer heads {covered.tolist()} times, not each once")
