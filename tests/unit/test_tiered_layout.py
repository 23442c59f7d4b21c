"""The layout fingerprint: equal exactly when a block's bytes mean the same on both sides."""

from __future__ import annotations

import pytest
import torch

from kvconnectors.mover.shapes import synthetic_caches
from kvconnectors.tiered.layout import detect_layout


def fingerprint(layout: str, *, heads: int = 2, backend: str = "FLASH_ATTN", cache_dtype: str = "auto",
                dtype: torch.dtype = torch.bfloat16, device: str = "meta", content: int = 8) -> str:
    caches = synthetic_caches(layout, num_layers=2, num_blocks=4, heads=heads, block_size=16, content=content,
                              dtype=dtype, device=device)
    return detect_layout(caches, 16, layout, backend=backend, cache_dtype=cache_dtype)[0].fingerprint


def test_physical_layouts_differ_with_several_heads() -> None:
    assert len({fingerprint(x) for x in ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")}) == 6


@pytest.mark.parametrize("a, b", [("LBHNC", "LBNHC"), ("BLHNC", "BLNHC"), ("LBHNC", "LHBNC"), ("BLHNC", "BHLNC")])
def test_with_one_head_h_and_n_orders_hold_the_same_bytes(a: str, b: str) -> None:
    """MLA: one latent 'head', so the layout names differ while the bytes do not."""
    assert fingerprint(a, heads=1, backend="FLASHMLA", content=576) == \
        fingerprint(b, heads=1, backend="FLASHMLA", content=576)


def test_backend_and_fp8_flavour_change_the_meaning_the_device_does_not() -> None:
    base = fingerprint("LBHNC")
    assert fingerprint("LBHNC", backend="CPU_ATTN") != base  # CPU kernels pack a block's interior
    assert fingerprint("LBHNC", device="cpu") == base          # a cuda producer may feed a cpu consumer
    e4m3 = fingerprint("LBHNC", cache_dtype="fp8_e4m3", dtype=torch.uint8)
    assert e4m3 != fingerprint("LBHNC", cache_dtype="fp8_e5m2", dtype=torch.uint8)
    assert fingerprint("LBHNC", cache_dtype="bfloat16") == base  # plain dtypes: the tensor's says it


def test_cpu_attention_isa_packing_is_part_of_the_meaning(monkeypatch) -> None:
    """AMX and vector packings of the same CPU block differ byte for byte: a prefill on an AMX host
    and a decode on one without must not exchange KV."""
    import vllm.v1.attention.backends.cpu_attn as cpu_attn

    caches = synthetic_caches("LBHNC", num_layers=2, num_blocks=4, heads=2, block_size=32, content=64,
                              dtype=torch.bfloat16, device="cpu")
    here = detect_layout(caches, 32, "LBHNC", backend="CPU_ATTN")[0]
    assert here.packing == cpu_attn._get_attn_isa(torch.bfloat16, 32, 32, None)
    other = "vec" if here.packing == "amx" else "amx"
    monkeypatch.setattr(cpu_attn, "_get_attn_isa", lambda *a, **k: other)
    there = detect_layout(caches, 32, "LBHNC", backend="CPU_ATTN")[0]
    assert there.packing == other and there.fingerprint != here.fingerprint
    assert detect_layout(caches, 32, "LBHNC", backend="FLASH_ATTN")[0].packing == ""  # GPU backends: none
