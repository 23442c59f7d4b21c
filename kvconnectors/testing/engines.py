"""In-process vLLM engines on CPU for tests: build, generate greedily, tear down cleanly.

Several engines can be built one after another in one process (plain, producer, consumer)
because teardown destroys the distributed environment vLLM sets up per engine.
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator, Sequence
from typing import Any

from kvconnectors.testing import process_state
from kvconnectors.transport.ucx_env import set_cpu_defaults

# Must be set before vLLM is imported: run EngineCore in this process so tests can see
# the connector's objects, and keep one engine per core.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
set_cpu_defaults()

DEFAULT_BLOCK_SIZE = 32  # CPU attention needs a multiple of 32
DEFAULT_KV_CACHE_BYTES = 64 * 2**20


def engine_kwargs(model: str, *, block_size: int = DEFAULT_BLOCK_SIZE,
                  kv_cache_memory_bytes: int = DEFAULT_KV_CACHE_BYTES, max_model_len: int = 2048,
                  dtype: str = "float32", kv_transfer_config: dict | None = None,
                  **overrides: Any) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(
        model=model, dtype=dtype, max_model_len=max_model_len, enforce_eager=True, seed=0,
        block_size=block_size, kv_cache_memory_bytes=kv_cache_memory_bytes,
        enable_prefix_caching=False, max_num_seqs=16,
    )
    if kv_transfer_config is not None:
        from vllm.config import KVTransferConfig

        kwargs["kv_transfer_config"] = KVTransferConfig(**kv_transfer_config)
    kwargs.update(overrides)
    return kwargs


@contextlib.contextmanager
def llm_engine(model: str, **kwargs: Any) -> Iterator[Any]:
    """Yield a `vllm.LLM` and destroy it (and vLLM's distributed state) on exit, leaving this
    process's CPU affinity and environment as they were (vLLM's CPU worker changes both)."""
    with process_state.kept():
        from vllm import LLM

        llm = LLM(**engine_kwargs(model, **kwargs))
        try:
            yield llm
        finally:
            shutdown_llm(llm)
            gc.collect()


def shutdown_llm(llm: Any) -> None:
    """Shut the in-process engine down now, exactly once.

    The in-process client tears down vLLM's *global* distributed state from a weakref
    finalizer; left to the garbage collector it would fire while the next engine runs and
    destroy that engine's process groups. `InprocClient.shutdown` detaches the finalizer.
    """
    client = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if client is not None:
        client.shutdown()  # also runs connector.shutdown() on both roles


def greedy(max_tokens: int, **extra: Any) -> Any:
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **extra)


def generate_ids(llm: Any, prompts: Sequence[Sequence[int]], max_tokens: int,
                 kv_transfer_params: Sequence[dict | None] | None = None) -> list[list[int]]:
    """Greedy token ids for token-id prompts, in prompt order."""
    from vllm.inputs import TokensPrompt

    params = []
    for i in range(len(prompts)):
        ktp = kv_transfer_params[i] if kv_transfer_params else None
        params.append(greedy(max_tokens, extra_args={"kv_transfer_params": ktp} if ktp else None))
    outs = llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params,
                        use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def generate_outputs(llm: Any, prompts: Sequence[Sequence[int]], max_tokens: int,
                     kv_transfer_params: Sequence[dict | None] | None = None) -> list[Any]:
    """Like generate_ids but returns vLLM's RequestOutputs (for kv_transfer_params etc.)."""
    from vllm.inputs import TokensPrompt

    params = []
    for i in range(len(prompts)):
        ktp = kv_transfer_params[i] if kv_transfer_params else None
        params.append(greedy(max_tokens, extra_args={"kv_transfer_params": ktp} if ktp else None))
    return llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params,
                        use_tqdm=False)
