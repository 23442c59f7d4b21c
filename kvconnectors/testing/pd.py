"""Prefill->decode handoff on ONE in-process engine (kv_role "kv_both").

The producer leg stages a prompt and returns a ticket; the consumer leg hands the ticket back
and pulls the KV over the real transport (loopback) from the same engine's store server into
freshly allocated blocks. It exercises the full scheduler/worker/transport path of a
connector in one process, without two engines' global state colliding.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvconnectors.testing.engines import generate_outputs


def prefill(llm: Any, prompts: Sequence[Sequence[int]]) -> list[dict | None]:
    outs = generate_outputs(llm, prompts, 1, [{"do_remote_decode": True}] * len(prompts))
    return [o.kv_transfer_params for o in outs]


def decode(llm: Any, prompts: Sequence[Sequence[int]], tickets: Sequence[dict | None],
           max_tokens: int) -> list[Any]:
    return generate_outputs(llm, prompts, max_tokens, list(tickets))


def worker_connector() -> Any:
    """The worker-side connector of the in-process engine that ran last."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group()


def scheduler_of(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core.scheduler


def assert_engine_idle(llm: Any) -> None:
    """Leak check: no request left in the scheduler, every KV block back in the free pool."""
    sched = scheduler_of(llm)
    pool = sched.kv_cache_manager.block_pool
    assert not sched.requests, f"scheduler still holds requests {list(sched.requests)[:5]}"
    free, total = pool.get_num_free_blocks(), pool.num_gpu_blocks - 1  # one null block
    assert free == total, f"{total - free} KV blocks still allocated after all requests finished"
