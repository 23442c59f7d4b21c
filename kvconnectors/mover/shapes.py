"""KV caches shaped and strided the way vLLM allocates them, without vLLM: one backing buffer,
one logical [B, H, N, C] view per layer with the strides of a `KVCacheLayout`
(vllm/v1/kv_cache_interface.py, create_kv_cache_views). Tests and `kvconnectors bench device`
build GPU-shaped caches with it, on any device (cpu, cuda, meta)."""

from __future__ import annotations

import torch

# stride order of each layout over the logical axes (L, B, H, N, C), outermost first
STRIDE_ORDER = {"LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4),
                "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "BHLNC": (1, 2, 0, 3, 4)}


def synthetic_caches(layout: str, *, num_layers: int, num_blocks: int, heads: int, block_size: int,
                     content: int, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu",
                     fill: bool = True, seed: int = 0) -> dict[str, torch.Tensor]:
    """{layer name: [num_blocks, heads, block_size, content] view} over one allocation.
    FlashAttention: heads = KV heads, content = 2 * head_size; MLA: heads = 1, content = latent."""
    order = STRIDE_ORDER[layout]
    shape = (num_layers, num_blocks, heads, block_size, content)
    strides = [0] * 5
    step = 1
    for dim in reversed(order):
        strides[dim] = step
        step *= shape[dim]
    raw = torch.empty(step, dtype=dtype, device=device)
    if fill and raw.device.type != "meta":
        gen = torch.Generator(device=raw.device).manual_seed(seed)
        raw.view(torch.uint8).copy_(torch.randint(0, 256, (step * raw.element_size(),), dtype=torch.uint8,
                                                  generator=gen, device=raw.device))
    full = torch.as_strided(raw, shape, strides)
    return {f"model.layers.{i}.self_attn.attn": full[i] for i in range(num_layers)}
