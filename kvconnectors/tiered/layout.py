"""How a worker's KV cache is laid out, and byte views of whole blocks.

On vLLM's CPU backend each layer is one tensor [num_blocks, kv_heads, block_size, 2*head_size]
whose block interior is kernel-packed (K transposed, or AMX tiles for bf16): blocks are moved
as opaque bytes, never sliced per token. The fingerprint captures everything that must match
for those bytes to mean the same thing on the other side.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

from kvconnectors.errors import FailureCause, TransferError


@dataclass(frozen=True)
class KVLayout:
    layer_names: tuple[str, ...]
    num_blocks: int
    block_size: int
    block_shape: tuple[int, ...]    # shape of one block of one layer
    dtype: str
    block_bytes: int
    cache_layout: str
    device: str
    tp_size: int
    tp_rank: int
    model: str = ""                 # served model name: same-shaped but different models must not mix

    @property
    def num_layers(self) -> int:
        return len(self.layer_names)

    def describe(self) -> dict:
        return {"layers": list(self.layer_names), "block_size": self.block_size,
                "block_shape": list(self.block_shape), "dtype": self.dtype, "block_bytes": self.block_bytes,
                "cache_layout": self.cache_layout, "device": self.device, "tp_size": self.tp_size,
                "model": self.model}

    @property
    def fingerprint(self) -> str:
        # tp_rank is left out on purpose: rank i of the consumer talks to rank i of the producer.
        return xxhash.xxh3_64_hexdigest(json.dumps(self.describe(), sort_keys=True).encode())


def detect_layout(kv_caches: dict[str, torch.Tensor], block_size: int, cache_layout: str,
                  tp_size: int = 1, tp_rank: int = 0, model: str = "") -> KVLayout:
    if not kv_caches:
        raise TransferError(FailureCause.LAYOUT_MISMATCH, "no KV cache tensors were registered")
    names = tuple(kv_caches)
    first = kv_caches[names[0]]
    for name, t in kv_caches.items():
        if t.shape != first.shape or t.dtype != first.dtype:
            raise TransferError(FailureCause.LAYOUT_MISMATCH,
                                f"layer {name} has shape {tuple(t.shape)} {t.dtype}, layer {names[0]} "
                                f"{tuple(first.shape)} {first.dtype}; hybrid layouts are not supported yet")
        if not t.is_contiguous() or t.device.type != "cpu":
            raise TransferError(FailureCause.LAYOUT_MISMATCH, (
                f"layer {name}: TieredConnector moves whole blocks of contiguous host-resident KV "
                f"caches with the block index first (vLLM's CPU layout); got device={t.device}, "
                f"shape={tuple(t.shape)}, contiguous={t.is_contiguous()}"))
    block_bytes = first[0].numel() * first.element_size()
    return KVLayout(layer_names=names, num_blocks=int(first.shape[0]), block_size=block_size,
                    block_shape=tuple(int(s) for s in first.shape[1:]), dtype=str(first.dtype).removeprefix("torch."),
                    block_bytes=block_bytes, cache_layout=cache_layout, device=first.device.type,
                    tp_size=tp_size, tp_rank=tp_rank, model=model)


def block_arrays(kv_caches: dict[str, torch.Tensor]) -> list[np.ndarray]:
    """Per layer, a uint8 numpy view [num_blocks, block_bytes] sharing the KV cache's memory."""
    return [t.view(torch.uint8).reshape(t.shape[0], -1).numpy() for t in kv_caches.values()]
