"""The parts of a vLLM config a TieredConnectorWorker reads, for building one without an engine
(unit tests, the benchmarks' workers): the KV role, the block size and resolved cache layout, the
TP size, the model's name and total KV heads."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any


def worker_vllm_config(role: str, block_size: int, kv_heads: int, *, tp_size: int = 1, layout: str = "LBHNC",
                       model_name: str = "tiny", cache_dtype: str | None = None,
                       model_dtype: Any = None) -> SimpleNamespace:
    """`role` "p" (producer) or "c" (consumer). vLLM resolves the layout (the connector asks for
    LBHNC); with one head per rank it could not be detected. `cache_dtype` and `model_dtype` are
    set only when given, as a config without them reads to the worker."""
    cache = SimpleNamespace(block_size=block_size, get_resolved_kv_cache_layout=lambda: SimpleNamespace(name=layout))
    if cache_dtype is not None:
        cache.cache_dtype = cache_dtype
    model = SimpleNamespace(served_model_name=model_name, get_total_num_kv_heads=lambda: kv_heads)
    if model_dtype is not None:
        model.dtype = model_dtype
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(is_kv_producer=role == "p", is_kv_consumer=role == "c"),
        cache_config=cache, parallel_config=SimpleNamespace(tensor_parallel_size=tp_size), model_config=model)
