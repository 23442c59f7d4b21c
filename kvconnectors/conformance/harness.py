"""vLLM's real `Scheduler` on CPU with a connector's scheduler side, driven by fake worker outputs.

The shapes follow vLLM's own unit-test helpers (`tests/v1/kv_connector/unit/utils.py`:
create_vllm_config / create_scheduler / create_request / create_model_runner_output /
assert_scheduler_empty), which are not installed with vLLM; these are re-implemented against the
installed 0.32 constructors. Differences from vLLM's copies, on purpose:
- the model is the locally generated tiny Llama (`ensure_tiny_model`), never a hub id;
- block size 32 (vLLM's CPU attention needs a multiple of 32), prefix caching off (a local
  prefix hit would hide the connector);
- the KV cache config has the tiny model's real layer names and shapes, so worker-side
  connectors built from the same config can register real CPU tensors.

Every wait here is bounded and every assertion message says what was seen and what was expected.
"""

from __future__ import annotations

import copy
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import torch

DEFAULT_BLOCK_SIZE = 32
DEFAULT_NUM_BLOCKS = 128
DEFAULT_MAX_MODEL_LEN = 2048
SAMPLED_TOKEN = 17  # an ordinary token id of the tiny model


@lru_cache(maxsize=None)
def tiny_model_path(variant: str = "tiny") -> str:
    from kvconnectors.testing.tinymodel import ensure_tiny_model

    return str(ensure_tiny_model(variant))


def layer_names(num_layers: int) -> list[str]:
    """vLLM's attention layer names for Llama-style models."""
    return [f"model.layers.{i}.self_attn.attn" for i in range(num_layers)]


# ------------------------------------------------------------------------------------ config

def create_vllm_config(
    kv_transfer_config: dict[str, Any] | None,
    *,
    model: str | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 4096,
    max_model_len: int = DEFAULT_MAX_MODEL_LEN,
    enable_prefix_caching: bool = False,
) -> Any:
    """A `VllmConfig` for the CPU platform with the tiny model and the given kv_transfer_config
    (a dict of `KVTransferConfig` fields, e.g. {"kv_connector": ..., "kv_role": ...})."""
    from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig,
                             VllmConfig)

    model_config = ModelConfig(model=model or tiny_model_path(), dtype="float32", seed=0,
                               max_model_len=max_model_len)
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len, is_encoder_decoder=model_config.is_encoder_decoder)
    cache_config = CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching)
    ktc = KVTransferConfig(**kv_transfer_config) if kv_transfer_config is not None else None
    vllm_config = VllmConfig(model_config=model_config, scheduler_config=scheduler_config,
                             cache_config=cache_config, kv_transfer_config=ktc, device_config=DeviceConfig("cpu"))
    resolve_cpu_kv_cache_layout(vllm_config)
    return vllm_config


def resolve_cpu_kv_cache_layout(vllm_config: Any) -> str:
    """Resolve the KV cache layout as vLLM's engine core does before building workers, for the
    CPU attention backend (it supports LBHNC only; a connector's preference is honoured when
    compatible). Connectors read it at construction (`get_resolved_kv_cache_layout`)."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout

    supported = [layout.name for layout in CPUAttentionBackend.supported_kv_cache_layouts()]
    return resolve_kv_cache_layout(vllm_config, [supported]).name


@dataclass(frozen=True)
class KVShape:
    """The worker-side KV cache shape on vLLM's CPU backend: one tensor per layer,
    [num_blocks, num_kv_heads, block_size, 2 * head_size] (K and V halves inside a block)."""
    layer_names: tuple[str, ...]
    num_blocks: int
    num_kv_heads: int
    block_size: int
    head_size: int
    dtype: torch.dtype = torch.float32

    @property
    def tensor_shape(self) -> tuple[int, int, int, int]:
        return (self.num_blocks, self.num_kv_heads, self.block_size, 2 * self.head_size)

    @property
    def page_bytes(self) -> int:
        return self.num_kv_heads * self.block_size * 2 * self.head_size * torch.empty((), dtype=self.dtype).element_size()


def kv_shape(vllm_config: Any, num_blocks: int = DEFAULT_NUM_BLOCKS) -> KVShape:
    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    return KVShape(layer_names=tuple(layer_names(mc.get_num_layers(pc))), num_blocks=num_blocks,
                   num_kv_heads=mc.get_num_kv_heads(pc), block_size=vllm_config.cache_config.block_size,
                   head_size=mc.get_head_size())


def create_kv_cache_config(vllm_config: Any, num_blocks: int = DEFAULT_NUM_BLOCKS) -> Any:
    """One full-attention KV cache group with the model's real layer names and shapes."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor

    shape = kv_shape(vllm_config, num_blocks)
    spec = FullAttentionSpec(block_size=shape.block_size, num_kv_heads=shape.num_kv_heads,
                             head_size=shape.head_size, dtype=shape.dtype)
    tensors = [KVCacheTensor(size=shape.page_bytes * num_blocks, layers=[name], layer_stride=0,
                             block_stride=shape.page_bytes) for name in shape.layer_names]
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors,
                         kv_cache_groups=[KVCacheGroupSpec(list(shape.layer_names), spec)])


def create_scheduler(vllm_config: Any, kv_cache_config: Any) -> Any:
    """vLLM's real Scheduler; with a kv_transfer_config it builds the SCHEDULER-role connector."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    return Scheduler(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                     structured_output_manager=StructuredOutputManager(vllm_config),
                     block_size=vllm_config.cache_config.block_size, log_stats=True)


def create_request(request_id: str, prompt_token_ids: list[int], *, max_tokens: int = 4,
                   kv_transfer_params: dict[str, Any] | None = None) -> Any:
    """A greedy request (ignore_eos) as the engine core would build it."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    # The engine reads the params from extra_args, as the OpenAI server and LLM.generate pass
    # them; a deep copy, because connectors may mutate them (e.g. clear do_remote_prefill).
    extra = {"kv_transfer_params": copy.deepcopy(kv_transfer_params)} if kv_transfer_params is not None else None
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, extra_args=extra)
    return Request(request_id=request_id, prompt_token_ids=list(prompt_token_ids), sampling_params=sp,
                   pooling_params=None, block_hasher=None)


def create_kv_connector_output(*, finished_sending: Iterable[str] | None = None,
                               finished_recving: Iterable[str] | None = None,
                               failed_recving: Iterable[str] | None = None,
                               invalid_block_ids: Iterable[int] | None = None) -> Any:
    from vllm.v1.outputs import KVConnectorOutput

    return KVConnectorOutput(
        finished_sending=set(finished_sending) if finished_sending else None,
        finished_recving=set(finished_recving) if finished_recving else None,
        failed_recving=set(failed_recving or ()), invalid_block_ids=set(invalid_block_ids or ()))


def create_model_runner_output(req_ids: list[str], sampled: dict[str, list[int]],
                               kv_connector_output: Any | None = None) -> Any:
    """What the worker returns for one step: sampled tokens for the requests that completed
    their prompt (or decoded) this step, nothing for partial prefills."""
    from vllm.v1.outputs import ModelRunnerOutput

    return ModelRunnerOutput(req_ids=list(req_ids), req_id_to_index={r: i for i, r in enumerate(req_ids)},
                             sampled_token_ids=[list(sampled.get(r, [])) for r in req_ids],
                             kv_connector_output=kv_connector_output)


def request_block_hasher(vllm_config: Any) -> Any | None:
    """The block hasher EngineCore gives every Request when prefix caching or a KV connector
    is on (vllm/v1/engine/core.py)."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    if not (vllm_config.cache_config.enable_prefix_caching or vllm_config.kv_transfer_config is not None):
        return None
    hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    return get_request_block_hasher(vllm_config.cache_config.block_size, hash_fn)


# ------------------------------------------------------------------------------------ checks

def scheduler_leaks(scheduler: Any) -> list[str]:
    """Everything a drained scheduler still holds, as readable findings (empty = clean)."""
    found: list[str] = []

    def check(what: str, value: Any) -> None:
        if value:
            items = sorted(map(str, value))[:5] if not isinstance(value, int) else value
            found.append(f"{what}: {items}")

    check("requests", list(scheduler.requests))
    check("waiting", [r.request_id for r in scheduler.waiting])
    check("kv_holding_waiting", [r.request_id for r in scheduler.kv_holding_waiting])
    check("running", [r.request_id for r in scheduler.running])
    check("finished_recving_kv_req_ids", scheduler.finished_recving_kv_req_ids)
    check("failed_recving_kv_req_ids", scheduler.failed_recving_kv_req_ids)
    check("_inflight_prefills", [r.request_id for r in getattr(scheduler, "_inflight_prefills", ())])
    mgr = scheduler.kv_cache_manager
    for g, m in enumerate(mgr.coordinator.single_type_managers):
        check(f"group {g} req_to_blocks", list(m.req_to_blocks))
    pool = mgr.block_pool
    free, total = pool.free_block_queue.num_free_blocks, pool.num_gpu_blocks - 1  # one null block
    if free != total:
        found.append(f"free blocks: {free}, expected {total} (all but the null block)")
    held = [b.block_id for b in pool.blocks if b.ref_cnt != 0 and not getattr(b, "is_null", False)]
    check("blocks with ref_cnt != 0", held)
    return found


def assert_scheduler_empty(scheduler: Any, context: str = "") -> None:
    """Leak check: no request left anywhere, every block free, every ref count 0."""
    leaks = scheduler_leaks(scheduler)
    assert not leaks, (f"scheduler not empty{' after ' + context if context else ''}: "
                       + "; ".join(leaks) + " — expected no requests and all blocks free")


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str, *,
               interval_s: float = 0.01, on_poll: Callable[[], None] | None = None,
               describe: Callable[[], str] | None = None) -> None:
    """Poll `predicate` (calling `on_poll` between tries) until true or `timeout_s` passes; a
    timeout is an AssertionError naming what was awaited and, via `describe`, what was seen."""
    deadline = time.monotonic() + timeout_s
    while True:
        if on_poll is not None:
            on_poll()
        if predicate():
            return
        if time.monotonic() >= deadline:
            seen = f"; seen: {describe()}" if describe else ""
            raise AssertionError(f"timed out after {timeout_s:.1f}s waiting for {what}{seen}")
        time.sleep(interval_s)


# ------------------------------------------------------------------------------------ driver

@dataclass
class StepResult:
    scheduler_output: Any
    outputs: dict[str, Any] = field(default_factory=dict)   # req_id -> EngineCoreOutput
    kv_connector_output: Any | None = None

    @property
    def meta(self) -> Any:
        return self.scheduler_output.kv_connector_metadata

    def scheduled(self, req_id: str) -> int:
        return self.scheduler_output.num_scheduled_tokens.get(req_id, 0)


WorkerStep = Callable[[Any], Any]   # SchedulerOutput -> KVConnectorOutput | None


class SchedulerHarness:
    """One engine's scheduler, stepped by hand.

    `step()` = `schedule()` + `update_from_output()` with a fake ModelRunnerOutput: a sampled
    token for each request whose prompt is complete, plus the KVConnectorOutput given (or the
    one the attached `worker` callback produces from the SchedulerOutput).
    """

    def __init__(self, vllm_config: Any, num_blocks: int = DEFAULT_NUM_BLOCKS, *, name: str = "engine",
                 kv_cache_config: Any | None = None):
        self.name = name
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config or create_kv_cache_config(vllm_config, num_blocks)
        self.scheduler = create_scheduler(vllm_config, self.kv_cache_config)
        self.block_hasher = request_block_hasher(vllm_config)
        self.worker: WorkerStep | None = None
        self.outputs: dict[str, list[Any]] = defaultdict(list)
        self.finished: dict[str, Any] = {}     # req_id -> the EngineCoreOutput that finished it
        self.steps = 0
        self._closed = False

    # -------------------------------------------------------------- properties
    @property
    def connector(self) -> Any:
        return self.scheduler.connector

    @property
    def block_size(self) -> int:
        return self.vllm_config.cache_config.block_size

    def request(self, req_id: str) -> Any | None:
        return self.scheduler.requests.get(req_id)

    def status(self, req_id: str) -> Any | None:
        req = self.request(req_id)
        return None if req is None else req.status

    def block_ids(self, req_id: str) -> list[int]:
        """The request's blocks in the (single) KV cache group; [] when it holds none."""
        mgr = self.scheduler.kv_cache_manager
        if not any(req_id in m.req_to_blocks for m in mgr.coordinator.single_type_managers):
            return []
        return list(mgr.get_block_ids(req_id)[0])

    def num_free_blocks(self) -> int:
        return self.scheduler.kv_cache_manager.block_pool.free_block_queue.num_free_blocks

    def loads_to_complete(self, so: Any = None) -> Any:
        """Fake worker output reporting every request still waiting for remote KV (and not yet
        reported) as received: the "every load succeeds at once" worker."""
        from vllm.v1.request import RequestStatus

        done = [r for r, req in self.scheduler.requests.items()
                if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
                and r not in self.scheduler.finished_recving_kv_req_ids]
        return create_kv_connector_output(finished_recving=done) if done else None

    def held_finished(self) -> list[str]:
        """Finished requests whose blocks the connector still holds (delay_free)."""
        return [r for r, req in self.scheduler.requests.items() if req.is_finished()]

    # -------------------------------------------------------------- driving
    def add(self, request: Any) -> Any:
        """Add a request, first giving it this engine's block hasher (as EngineCore does when
        building Requests: connectors such as OffloadingConnector key KV by block hash)."""
        if self.block_hasher is not None and getattr(request, "_block_hasher", False) is None:
            request._block_hasher = self.block_hasher
            request.update_block_hashes()
        self.scheduler.add_request(request)
        return request

    def abort(self, *req_ids: str) -> list[Any]:
        from vllm.v1.request import RequestStatus

        return self.scheduler.finish_requests(list(req_ids), RequestStatus.FINISHED_ABORTED)

    def step(self, kv_connector_output: Any | None = None, *, token: int = SAMPLED_TOKEN) -> StepResult:
        """One engine step. `kv_connector_output` is the fake worker result, or a callable that
        builds it from this step's SchedulerOutput (to report on blocks allocated this step)."""
        so = self.scheduler.schedule()
        if callable(kv_connector_output):
            kv_connector_output = kv_connector_output(so)
        if kv_connector_output is None and self.worker is not None:
            kv_connector_output = self.worker(so)
        sampled: dict[str, list[int]] = {}
        for req_id in so.num_scheduled_tokens:
            req = self.scheduler.requests.get(req_id)
            if req is not None and req.num_computed_tokens >= req.num_tokens:
                sampled[req_id] = [token]
        mro = create_model_runner_output(list(so.num_scheduled_tokens), sampled, kv_connector_output)
        engine_outputs = self.scheduler.update_from_output(so, mro)
        result = StepResult(so, kv_connector_output=kv_connector_output)
        for eco in engine_outputs.values():
            for out in eco.outputs:
                result.outputs[out.request_id] = out
                self.outputs[out.request_id].append(out)
                if out.finish_reason is not None:
                    self.finished[out.request_id] = out
        self.steps += 1
        return result

    def run_until(self, predicate: Callable[[], bool], what: str, *, max_steps: int = 64,
                  timeout_s: float = 30.0, kv_output: Callable[[Any], Any] | None = None,
                  pause_s: float = 0.0) -> list[StepResult]:
        """Step until `predicate()`; bounded by steps and wall time. `kv_output(scheduler_output)`
        may supply the fake worker output of each step (called after schedule())."""
        results: list[StepResult] = []
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if len(results) >= max_steps or time.monotonic() > deadline:
                raise AssertionError(
                    f"[{self.name}] {what}: not reached after {len(results)} steps / {timeout_s:.0f}s; "
                    f"seen: {self.describe()}")
            results.append(self.step(kv_output))
            if pause_s:
                time.sleep(pause_s)
        return results

    def finish_held(self, max_steps: int = 8) -> None:
        """Emulate the worker reporting `finished_sending` for every finished request whose
        blocks the connector held back (what a worker does once the consumer has read them)."""
        for _ in range(max_steps):
            held = self.held_finished()
            if not held:
                return
            self.step(create_kv_connector_output(finished_sending=held))
        raise AssertionError(f"[{self.name}] finished requests {self.held_finished()} still hold blocks "
                             f"after {max_steps} finished_sending reports")

    def drain(self, *, release_held: bool = True, max_steps: int = 8) -> None:
        """A couple of empty steps (they flush `finished_req_ids` and let the connector build
        its metadata once more), reporting finished_sending for held blocks if asked."""
        if release_held:
            self.finish_held()
        for _ in range(max_steps):
            self.step()
            if not self.scheduler.has_requests():
                break
        self.step()  # one more: finished_req_ids is cleared by the next schedule()

    def assert_empty(self, context: str = "") -> None:
        assert_scheduler_empty(self.scheduler, f"{context} [{self.name}]" if context else f"[{self.name}]")

    def describe(self) -> str:
        sched = self.scheduler
        reqs = {r: f"{req.status.name}(computed={req.num_computed_tokens}/{req.num_tokens})"
                for r, req in list(sched.requests.items())[:6]}
        return (f"requests={reqs}, finished={ {r: str(o.finish_reason) for r, o in self.finished.items()} }, "
                f"free_blocks={self.num_free_blocks()}")

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.scheduler.shutdown()
