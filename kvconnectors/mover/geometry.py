"""Where the bytes of one KV block of one layer live, for every layout vLLM hands a connector.

vLLM (0.32+) gives each attention layer a logical [B, H, N, C] view (blocks, heads, tokens,
content; MLA: H = 1, one latent tensor) whose strides follow the resolved `KVCacheLayout`:
layer-first (LBHNC, LBNHC, LHBNC) or cross-layer (BLHNC, BLNHC, BHLNC: block b of *all* layers is
one run, each layer's view is strided). We move a block as opaque bytes in *physical* order, so a
block of a block-contiguous layout is one memcpy; LHBNC/BHLNC blocks are H runs. Both sides must
have the same physical layout: it is part of the fingerprint.

torch only, no vLLM import: the connector passes vLLM's names (layout, backend, kv_cache_dtype).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvconnectors.errors import FailureCause, TransferError

LAYOUTS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")
# Backends whose per-layer caches are plain [B, H, N, C] pages we can move as bytes.
ATTENTION_BACKENDS = ("CPU_ATTN", "FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION")
MLA_BACKENDS = ("CPU_MLA", "FLASHMLA", "FLASH_ATTN_MLA", "FLASHINFER_MLA", "CUTLASS_MLA", "TRITON_MLA")
# kv_cache_dtype values whose pages hold only the values (fp8: scales are per tensor, on the layer).
PLAIN_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")
TENSOR_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.uint8,
                 torch.float8_e4m3fn, torch.float8_e5m2)
# The layout that moves fastest: every block of a layer one contiguous run (what NIXL asks for too).
PREFERRED_LAYOUT = "LBHNC"


class UnsupportedKVCache(TransferError):
    def __init__(self, detail: str):
        super().__init__(FailureCause.LAYOUT_MISMATCH, detail)


@dataclass(frozen=True)
class BlockGeometry:
    """The byte geometry of a registered KV cache: per layer, a uint8 view whose dim 0 is the
    block (manager block: vLLM may split one into `kernel_splits` kernel blocks) and whose inner
    dims are the block's bytes in physical order; `runs` contiguous runs of `run_bytes` each."""

    views: tuple[torch.Tensor, ...]     # per layer, uint8 [num_blocks, *physical inner dims]
    layer_names: tuple[str, ...]
    num_blocks: int
    block_bytes: int
    runs: int                           # contiguous runs per block of one layer
    run_bytes: int
    block_stride: int                   # bytes between block b and b+1 of one layer
    cross_layer: bool                   # one block of all layers is one contiguous run
    layout: str
    backend: str
    cache_dtype: str
    dtype: str
    block_shape: tuple[int, ...]        # logical shape of one block of one layer (H, N, C)
    kernel_splits: int
    device: str
    mla: bool

    @property
    def num_layers(self) -> int:
        return len(self.views)

    @property
    def block_contiguous(self) -> bool:
        return self.runs == 1

    def all_layers_view(self) -> torch.Tensor:
        """uint8 [num_blocks, num_layers, *inner]: block b of every layer, one run in memory
        (cross-layer layouts only; BHLNC interleaves the layers inside that run)."""
        if not self.cross_layer:
            raise ValueError(f"layout {self.layout} has no all-layer run per block")
        first = self.views[0]
        step = self.views[1].storage_offset() - first.storage_offset()
        return torch.as_strided(first, (self.num_blocks, self.num_layers, *first.shape[1:]),
                                (self.block_stride, step, *first.stride()[1:]))

    def describe(self) -> dict:
        """What must match on both sides for the bytes to mean the same (the fingerprint's input)."""
        return {"layout": self.layout, "dtype": self.dtype, "cache_dtype": self.cache_dtype,
                "block_shape": list(self.block_shape), "block_bytes": self.block_bytes,
                "kernel_splits": self.kernel_splits, "mla": self.mla, "runs": self.runs}


def _refuse(what: str, backend: str, layout: str, dtype: str) -> UnsupportedKVCache:
    return UnsupportedKVCache(
        f"{what} (attention backend {backend}, KV cache layout {layout}, kv_cache_dtype {dtype}); "
        f"TieredConnector moves per-layer caches of {', '.join(ATTENTION_BACKENDS + MLA_BACKENDS)} in layouts "
        f"{', '.join(LAYOUTS)} with dtypes float32/float16/bfloat16 or fp8 with per-tensor scales")


def describe_kv_caches(kv_caches: dict[str, torch.Tensor], *, block_size: int, layout: str = "unknown",
                       backend: str = "unknown", cache_dtype: str = "auto") -> BlockGeometry:
    """Check vLLM's registered caches and describe their bytes; refuse what cannot be moved as
    whole blocks, naming the backend, layout and dtype."""
    if not kv_caches:
        raise UnsupportedKVCache("no KV cache tensors were registered")
    mla = backend in MLA_BACKENDS
    if backend not in ATTENTION_BACKENDS + MLA_BACKENDS and backend != "unknown":
        raise _refuse(f"attention backend {backend} is not supported", backend, layout, cache_dtype)
    if layout not in LAYOUTS and layout != "unknown":
        raise _refuse(f"KV cache layout {layout} is not supported", backend, layout, cache_dtype)
    if cache_dtype not in PLAIN_CACHE_DTYPES:
        raise _refuse(f"kv_cache_dtype {cache_dtype} keeps dynamic scales with the pages", backend, layout,
                      cache_dtype)
    names = tuple(kv_caches)
    first = kv_caches[names[0]]
    for name, t in kv_caches.items():
        if t.dtype not in TENSOR_DTYPES:
            raise _refuse(f"layer {name} has dtype {t.dtype}", backend, layout, cache_dtype)
        if t.dim() not in (3, 4):
            raise _refuse(f"layer {name} has shape {tuple(t.shape)}, not [blocks, heads, tokens, content]",
                          backend, layout, cache_dtype)
        if t.shape != first.shape or t.dtype != first.dtype or t.stride() != first.stride() \
                or t.device != first.device:
            raise _refuse(f"layer {name} has shape {tuple(t.shape)} strides {t.stride()} {t.dtype} on "
                          f"{t.device}, layer {names[0]} {tuple(first.shape)} {first.stride()} {first.dtype} on "
                          f"{first.device}: non-uniform layers are not supported", backend, layout, cache_dtype)
        if t.device.type not in ("cpu", "cuda", "meta"):
            raise _refuse(f"layer {name} is on {t.device}", backend, layout, cache_dtype)
        if t.stride(-1) != 1:
            raise _refuse(f"layer {name}: its content dim has stride {t.stride(-1)}", backend, layout, cache_dtype)
    logical = first if first.dim() == 4 else first.unsqueeze(1)  # MLA [B, N, C] -> [B, 1, N, C]
    tokens = int(logical.shape[2])
    if tokens == block_size or tokens == 0:
        splits = 1
    elif tokens < block_size and block_size % tokens == 0:
        splits = block_size // tokens  # vLLM split each manager block into kernel blocks
    else:
        raise _refuse(f"layer {names[0]} holds {tokens} tokens per block, the block size is {block_size}",
                      backend, layout, cache_dtype)
    if logical.shape[0] % splits:
        raise _refuse(f"{logical.shape[0]} kernel blocks do not group into {splits}-block manager blocks",
                      backend, layout, cache_dtype)
    es = first.element_size()
    views = tuple(_physical_bytes(t if t.dim() == 4 else t.unsqueeze(1), splits) for t in kv_caches.values())
    v0 = views[0]
    runs, run_bytes = _runs(v0)
    block_bytes = runs * run_bytes
    if block_bytes != math.prod(v0.shape[1:]):
        raise _refuse(f"layer {names[0]}'s blocks overlap (strides {first.stride()})", backend, layout, cache_dtype)
    block_stride = int(v0.stride(0))
    detected = _layout_of(first if first.dim() == 4 else first.unsqueeze(1), kv_caches, es)
    # One layer: where L sits in the name changes no stride (BLHNC of one layer is LBHNC).
    if layout != "unknown" and detected is not None and detected != layout \
            and not (len(views) == 1 and detected.replace("L", "") == layout.replace("L", "")):
        raise _refuse(f"the caches' strides say layout {detected}, vLLM says {layout}", backend, layout, cache_dtype)
    cross = _is_cross_layer(views, block_bytes, block_stride)
    return BlockGeometry(
        views=views, layer_names=names, num_blocks=int(v0.shape[0]), block_bytes=block_bytes, runs=runs,
        run_bytes=run_bytes, block_stride=block_stride, cross_layer=cross,
        layout=layout if layout != "unknown" else (detected or "unknown"), backend=backend,
        cache_dtype=cache_dtype, dtype=str(first.dtype).removeprefix("torch."),
        block_shape=tuple(int(s) for s in logical.shape[1:]), kernel_splits=splits, device=first.device.type,
        mla=mla)


def _physical_bytes(t: torch.Tensor, splits: int) -> torch.Tensor:
    """uint8 view [manager blocks, inner dims in physical (descending stride) order, bytes]."""
    b = t.view(torch.uint8)  # the content dim in bytes
    if splits > 1:
        b = b.unflatten(0, (b.shape[0] // splits, splits))
    inner = sorted(range(1, b.dim()), key=lambda d: (-b.stride(d), d))
    return b.permute(0, *inner)


def _runs(v: torch.Tensor) -> tuple[int, int]:
    """(runs, run_bytes) of one block of `v` (inner dims already in physical order)."""
    run = 1
    count = 1
    dense = True
    for d in range(v.dim() - 1, 0, -1):
        size, stride = int(v.shape[d]), int(v.stride(d))
        if dense and (size == 1 or stride == run):
            run *= size
        else:
            dense = False
            count *= size
    return count, run


def _layout_of(t: torch.Tensor, caches: dict[str, torch.Tensor], es: int) -> str | None:
    """The KVCacheLayout name the strides of a [B, H, N, C] view imply (None: cannot tell, e.g.
    a dim of size 1 has no meaningful stride)."""
    sizes = dict(zip("BHNC", t.shape))
    strides = dict(zip("BHNC", t.stride()))
    if sizes["H"] == 1 or sizes["N"] == 1:
        return None
    tensors = list(caches.values())
    step = _layer_step(tensors)
    if step is None or step >= strides["B"] * sizes["B"]:
        name = "L" + "".join(sorted("BHN", key=lambda d: -strides[d])) + "C"
    else:
        strides["L"] = step
        name = "".join(sorted("BHNL", key=lambda d: -strides[d])) + "C"
    return name if name in LAYOUTS else None


def _layer_step(tensors: list[torch.Tensor]) -> int | None:
    """Elements between layer 0 and layer 1 when they are views of one allocation, else None."""
    if len(tensors) < 2 or not _same_storage(tensors):
        return None
    step = tensors[1].storage_offset() - tensors[0].storage_offset()
    return step if step > 0 else None


def _same_storage(tensors: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> bool:
    ptr = tensors[0].untyped_storage().data_ptr()
    return all(t.untyped_storage().data_ptr() == ptr for t in tensors)


def _is_cross_layer(views: tuple[torch.Tensor, ...], block_bytes: int, block_stride: int) -> bool:
    """Block b of all layers is one dense run: layer views evenly spaced in one allocation, and
    blocks `num_layers * block_bytes` apart."""
    if len(views) < 2 or block_stride != len(views) * block_bytes or not _same_storage(views):
        return False
    offsets = [v.storage_offset() for v in views]
    step = offsets[1] - offsets[0]
    return 0 < step < block_stride and all(b - a == step for a, b in zip(offsets, offsets[1:]))
