"""What a worker's KV cache is, as far as a peer must agree: the layout fingerprints.

`fingerprint` describes the model's whole KV (total KV heads, per-head block bytes and shape,
dtype, layout, backend and packing, block size, model), not one rank's shard: prefill and decode
pools of different TP sizes share it, and the ticket says each side's TP size (issue 20).
`rows_fingerprint` is the previous fingerprint (one rank's rows, with tp_size): equal exactly when
a producer rank's rows are byte for byte a consumer rank's rows. Push mode lands rows unsliced and
checks it; previous-version tickets (v3) carry it.

The byte geometry (where each block's bytes live, for every KVCacheLayout, on cpu or cuda) is
the mover's (kvconnectors/mover/geometry.py). Blocks move as opaque bytes, never sliced per
token: on vLLM's CPU backend a block's interior is kernel-packed (K transposed, AMX tiles for
bf16), so the attention backend, and on CPU its ISA packing, are part of what the bytes mean,
beside the physical layout, dtype, block shape and model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

import torch
import xxhash

from kvconnectors.mover.geometry import BlockGeometry, describe_kv_caches
from kvconnectors.mover.heads import head_map


@dataclass(frozen=True)
class KVLayout:
    layer_names: tuple[str, ...]
    num_blocks: int
    block_size: int
    block_shape: tuple[int, ...]    # logical shape of one block of one layer (heads, tokens, content)
    dtype: str
    block_bytes: int
    cache_layout: str               # vLLM's KVCacheLayout name (physical order)
    device: str
    tp_size: int
    tp_rank: int
    model: str = ""                 # served model name: same-shaped but different models must not mix
    backend: str = "unknown"        # attention backend: it decides what a block's bytes mean
    cache_dtype: str = "auto"       # vLLM's kv_cache_dtype (fp8 variants differ in meaning)
    packing: str = ""               # CPU_ATTN: the ISA packing of a block's interior (amx, vec, vec16, ...)
    total_kv_heads: int = 0         # the model's KV heads over all ranks (0: block_shape[0] * tp_size)
    physical_layout: str = ""       # the cache's own layout name (cache_layout is normalised for one head)

    @property
    def num_layers(self) -> int:
        return len(self.layer_names)

    @property
    def kv_heads(self) -> int:
        """The model's KV heads (replicated heads counted once)."""
        return self.total_kv_heads or self.block_shape[0] * self.tp_size

    def describe_model(self) -> dict:
        """The whole model's KV, whatever the TP size: what both pools must share to reslice."""
        one_head = self.kv_heads == 1  # then H and N orders hold the same bytes (see _SAME_WITH_ONE_HEAD)
        local = self.block_shape[0]
        return {"layers": list(self.layer_names), "block_size": self.block_size, "kv_heads": self.kv_heads,
                "head_block": list(self.block_shape[1:]), "head_bytes": self.block_bytes // local,
                "dtype": self.dtype, "model": self.model, "backend": self.backend,
                "cache_layout": self.cache_layout if one_head else (self.physical_layout or self.cache_layout),
                "cache_dtype": self.cache_dtype, **({"packing": self.packing} if self.packing else {})}

    def describe_side(self) -> str:
        """This side's TP size and KV heads, for messages naming both sides."""
        return f"TP {self.tp_size}, {self.kv_heads} KV heads ({self.block_shape[0]} on rank {self.tp_rank})"

    @property
    def fingerprint(self) -> str:
        # the "kv" prefix keeps it from ever equalling a rows fingerprint
        return xxhash.xxh3_64_hexdigest(b"kv" + json.dumps(self.describe_model(), sort_keys=True).encode())

    def describe(self) -> dict:
        # device is left out: a block means the same on cpu and cuda when the layout and backend do
        return {"layers": list(self.layer_names), "block_size": self.block_size,
                "block_shape": list(self.block_shape), "dtype": self.dtype, "block_bytes": self.block_bytes,
                "cache_layout": self.cache_layout, "tp_size": self.tp_size, "model": self.model,
                "backend": self.backend, "cache_dtype": self.cache_dtype,
                **({"packing": self.packing} if self.packing else {})}

    @property
    def rows_fingerprint(self) -> str:
        # tp_rank is left out on purpose: rank i of the consumer talks to rank i of the producer.
        return xxhash.xxh3_64_hexdigest(json.dumps(self.describe(), sort_keys=True).encode())

    def for_rank(self, tp_size: int, tp_rank: int) -> KVLayout:
        """The layout rank `tp_rank` of a pool at TP `tp_size` has for this same model: its share of
        the KV heads (vLLM's split), named as `layout_of` names it. A producer pushing rows sliced
        for another TP size presents that rank's `rows_fingerprint`, which its landing store checks."""
        return replace(self.with_heads(head_map(self.kv_heads, tp_size)[tp_rank].count), tp_size=tp_size,
                       tp_rank=tp_rank)

    def with_heads(self, heads: int) -> KVLayout:
        """This rank's layout holding `heads` KV heads per block instead (one head: named as
        `layout_of` names it). A head fragment pushed to this rank (decode TP < prefill TP) is
        rows of this shape, and presents its `rows_fingerprint`."""
        local = self.block_shape[0]
        physical = self.physical_layout or self.cache_layout
        return replace(self, block_shape=(heads, *self.block_shape[1:]), block_bytes=self.block_bytes // local * heads,
                       cache_layout=_SAME_WITH_ONE_HEAD.get(physical, physical) if heads == 1 else physical)


# With one head (MLA) the H and N axes cannot be told apart in memory: these pairs hold the same bytes.
_SAME_WITH_ONE_HEAD = {"LBNHC": "LBHNC", "BLNHC": "BLHNC", "LHBNC": "LBHNC", "BHLNC": "BLHNC"}


def layout_of(geometry: BlockGeometry, block_size: int, tp_size: int = 1, tp_rank: int = 0,
              model: str = "", total_kv_heads: int = 0, model_dtype: torch.dtype | None = None) -> KVLayout:
    layout = geometry.layout
    if geometry.block_shape and geometry.block_shape[0] == 1:
        layout = _SAME_WITH_ONE_HEAD.get(layout, layout)
    return KVLayout(layer_names=geometry.layer_names, num_blocks=geometry.num_blocks, block_size=block_size,
                    block_shape=geometry.block_shape, dtype=geometry.dtype, block_bytes=geometry.block_bytes,
                    cache_layout=layout, device=geometry.device, tp_size=tp_size, tp_rank=tp_rank,
                    model=model, backend=geometry.backend,
                    # plain float dtypes are said by `dtype`; only fp8's flavour adds meaning
                    cache_dtype=geometry.cache_dtype if geometry.cache_dtype.startswith("fp8") else "auto",
                    packing=(cpu_attention_packing(geometry, block_size, model_dtype) if geometry.backend == "CPU_ATTN"
                             else ""),
                    total_kv_heads=1 if geometry.mla else total_kv_heads, physical_layout=geometry.layout)


def cpu_attention_packing(geometry: BlockGeometry, block_size: int, model_dtype: torch.dtype | None = None) -> str:
    """How vLLM's CPU attention packs a block's interior on this machine: per ISA (AMX tiles for
    bf16, vector layouts otherwise), so the same layout and dtype hold different bytes on a CPU
    with another ISA, and a prefill on one with a decode on the other would read garbage KV.
    vLLM chooses by the model's dtype, not the cache's: an fp8 cache is uint8 in memory while a
    bf16 model still packs it for AMX (tests/unit/test_cpu_attn_packing.py)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa  # vLLM's own choice, same arguments

    head_size = geometry.block_shape[-1] // 2  # a CPU block's content is K and V of one head
    cache_dtype = None if geometry.cache_dtype == "auto" else geometry.cache_dtype
    dtype = model_dtype if model_dtype is not None else getattr(torch, geometry.dtype)
    return _get_attn_isa(dtype, block_size, head_size, cache_dtype)


def detect_layout(kv_caches: dict[str, torch.Tensor], block_size: int, cache_layout: str = "unknown",
                  tp_size: int = 1, tp_rank: int = 0, model: str = "", backend: str = "unknown",
                  cache_dtype: str = "auto", total_kv_heads: int = 0,
                  model_dtype: torch.dtype | None = None) -> tuple[KVLayout, BlockGeometry]:
    """Check the registered caches (refusing what cannot move, naming backend, layout and dtype)
    and return the layout peers must share, with the mover's geometry. `model_dtype`: the model's
    compute dtype (vllm_config.model_config.dtype), where it can differ from the cache's (fp8)."""
    geometry = describe_kv_caches(kv_caches, block_size=block_size, layout=cache_layout, backend=backend,
                                  cache_dtype=cache_dtype)
    return layout_of(geometry, block_size, tp_size, tp_rank, model, total_kv_heads, model_dtype), geometry
