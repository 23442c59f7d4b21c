"""Worker-side connectors in this process, on CPU KV caches, stepped like vLLM's model runner.

An `EngineHarness` is one engine without a model: vLLM's real Scheduler with the connector's
SCHEDULER side, plus the connector's WORKER side with one CPU tensor per layer shaped like vLLM's
CPU KV cache, [num_blocks, num_kv_heads, block_size, 2 * head_size]. Each `step()` runs the
worker hooks in the order of vLLM 0.32's `KVConnectorModelRunnerMixin`:

    handle_preemptions -> bind_connector_metadata -> [start_load_kv if has_sync_kv_loads]
    -> per layer: wait_for_layer_load, ("attention"), save_kv_layer      (only with tokens)
    -> [start_load_kv otherwise] -> wait_for_save -> get_transfer_results
    -> get_block_ids_with_load_errors -> get_kv_connector_stats -> clear_connector_metadata

"Attention" writes nothing: a producer's cache is filled with seeded random bytes up front (as
if every block had been computed), a consumer's with other bytes, so whatever lands in a
consumer block can be compared byte for byte with its source.

vLLM's distributed state: TieredConnectorWorker needs none at tp_size 1 (it calls
get_tensor_model_parallel_rank only when tp_size > 1); NixlConnector's worker reads the TP
group's rank and size in __init__, so backends that say `needs_parallel_state = True` get a
one-rank gloo world for the test (`single_rank_parallel_state`), torn down afterwards so later
in-process engines can build their own.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch

from kvconnectors.conformance.harness import (DEFAULT_NUM_BLOCKS, KVShape, SchedulerHarness, StepResult,
                                              create_kv_cache_config, create_vllm_config, kv_shape)
from kvconnectors.serving import free_port

if TYPE_CHECKING:
    from kvconnectors.conformance.hooks import BackendHooks


@contextlib.contextmanager
def environment(overrides: dict[str, str]) -> Iterator[None]:
    """Set environment variables for the duration (connectors read some at construction)."""
    saved = {k: os.environ.get(k) for k in overrides}
    os.environ.update(overrides)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def single_rank_parallel_state(vllm_config: Any) -> Iterator[None]:
    """A one-rank gloo world plus vLLM's TP/PP groups (what a worker process has at tp_size 1).
    A no-op when they already exist; torn down on exit only if created here."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    if ps.model_parallel_is_initialized():
        yield
        return
    with set_current_vllm_config(vllm_config):
        ps.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                        distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
        ps.ensure_model_parallel_initialized(1, 1)
    try:
        yield
    finally:
        from vllm.distributed import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()


class _AttnMetadata:
    """Stands in for the per-layer attention metadata; connectors on the CPU path only test
    its type (e.g. ExampleConnector's MLA check)."""


def forward_context(kv_caches: dict[str, torch.Tensor], with_tokens: bool) -> Any:
    """A ForwardContext whose attention layers expose `kv_cache` (ExampleConnector reads it)."""
    layers = {name: SimpleNamespace(kv_cache=t) for name, t in kv_caches.items()}
    attn = {name: _AttnMetadata() for name in kv_caches} if with_tokens else None
    try:
        from vllm.forward_context import ForwardContext

        return ForwardContext(no_compile_layers=layers, attn_metadata=attn, slot_mapping={})
    except TypeError:  # a vLLM whose ForwardContext takes other fields
        return SimpleNamespace(no_compile_layers=layers, attn_metadata=attn, slot_mapping={}, virtual_engine=0)


def random_kv_caches(shape: KVShape, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape.tensor_shape, generator=gen, dtype=shape.dtype) for name in shape.layer_names}


class EngineHarness:
    """One engine (scheduler + worker-side connector + CPU KV caches), no model."""

    def __init__(self, backend: "BackendHooks", role: str, *, name: str, seed: int,
                 policy: str = "fail", extra: dict[str, Any] | None = None,
                 num_blocks: int = DEFAULT_NUM_BLOCKS):
        from vllm.config import set_current_vllm_config
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        self.name, self.role, self.backend = name, role, backend
        self.env = dict(backend.environment(role, name))
        with environment(self.env):
            self.vllm_config = create_vllm_config(backend.kv_transfer_config(role, policy=policy, extra=extra),
                                                  block_size=backend.block_size)
            self.shape = kv_shape(self.vllm_config, num_blocks)
            kv_cache_config = create_kv_cache_config(self.vllm_config, num_blocks)
            self.kv_caches = random_kv_caches(self.shape, seed)
            with set_current_vllm_config(self.vllm_config):
                # Worker first, as in vLLM: workers register their caches before the engine
                # core builds the scheduler and hands it the workers' handshake metadata.
                self.worker = KVConnectorFactory.create_connector(self.vllm_config, KVConnectorRole.WORKER,
                                                                  kv_cache_config)
                self.worker.register_kv_caches(self.kv_caches)
                self.sched = SchedulerHarness(self.vllm_config, num_blocks, name=name,
                                              kv_cache_config=kv_cache_config)
                handshake = self.worker.get_handshake_metadata()
                if handshake is not None:
                    self.sched.connector.set_xfer_handshake_metadata_pp_aware({(0, 0): handshake})
        self.sched.worker = self.worker_step
        self.worker_outputs: list[Any] = []
        self.on_step: list[Any] = []    # callbacks(scheduler_output, kv_connector_output) after each worker step
        self.on_layer: list[Any] = []   # callbacks(scheduler_output, layer_name) right after wait_for_layer_load
        # False: the per-layer hooks never run, as in a replayed full CUDA graph (vLLM skips the
        # Python of attention layers then); start_load_kv and wait_for_save still do
        self.layer_hooks = True
        self._closed = False

    # ---------------------------------------------------------------- the model runner
    def worker_step(self, so: Any) -> Any:
        from vllm.config import set_current_vllm_config
        from vllm.v1.outputs import KVConnectorOutput

        w = self.worker
        tokens = so.total_num_scheduled_tokens > 0
        fc = forward_context(self.kv_caches, tokens)
        out = KVConnectorOutput()
        with set_current_vllm_config(self.vllm_config), environment(self.env):
            assert so.kv_connector_metadata is not None, (
                f"[{self.name}] SchedulerOutput.kv_connector_metadata is None: build_connector_meta must "
                "return metadata every step")
            w.handle_preemptions(so.kv_connector_metadata)
            w.bind_connector_metadata(so.kv_connector_metadata)
            if so.has_sync_kv_loads:
                w.start_load_kv(fc)
            try:
                if tokens and w.has_connector_metadata() and self.layer_hooks:
                    for layer, kv in self.kv_caches.items():
                        w.wait_for_layer_load(layer)
                        for cb in self.on_layer:
                            cb(so, layer)
                        w.save_kv_layer(layer, kv, fc.attn_metadata[layer])
            finally:
                if not so.has_sync_kv_loads:
                    w.start_load_kv(fc)
                w.wait_for_save()
                results = w.get_transfer_results(so.finished_req_ids)
                out.finished_sending = results.finished_sending or None
                out.finished_recving = results.finished_recving or None
                out.failed_recving = set(results.failed_recving or ())
                out.invalid_block_ids = set(w.get_block_ids_with_load_errors() or ())
                out.kv_connector_stats = w.get_kv_connector_stats()
                out.kv_connector_worker_meta = w.build_connector_worker_meta()
                w.clear_connector_metadata()
        self.worker_outputs.append(out)
        for cb in self.on_step:
            cb(so, out)
        return out

    # ---------------------------------------------------------------- helpers
    def step(self) -> StepResult:
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.vllm_config), environment(self.env):
            return self.sched.step()

    def block_bytes(self, block_ids: list[int], num_tokens: int) -> dict[str, list[torch.Tensor]]:
        """Per layer, the KV of the token slots [0, num_tokens) spread over `block_ids`: whole
        blocks, then the first `num_tokens % block_size` slots of a partial last block."""
        bs = self.shape.block_size
        full, rest = divmod(num_tokens, bs)
        out: dict[str, list[torch.Tensor]] = {}
        for layer, t in self.kv_caches.items():
            parts = [t[b].clone() for b in block_ids[:full]]
            if rest and len(block_ids) > full:
                parts.append(t[block_ids[full]][:, :rest, :].clone())
            out[layer] = parts
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.vllm_config), environment(self.env):
            try:
                self.worker.shutdown()
                self.backend.release_worker(self.worker)
            finally:
                self.sched.close()
                self.worker = None


def compare_blocks(src: dict[str, list[torch.Tensor]], dst: dict[str, list[torch.Tensor]]) -> list[str]:
    """Differences between two `block_bytes` results, one readable line per differing block."""
    diffs = []
    for layer in src:
        for i, (a, b) in enumerate(zip(src[layer], dst[layer])):
            if a.shape != b.shape or not torch.equal(a.contiguous().view(torch.uint8),
                                                       b.contiguous().view(torch.uint8)):
                nbad = int((a != b).sum()) if a.shape == b.shape else -1
                diffs.append(f"{layer} block #{i}: {nbad} of {a.numel()} values differ")
        if len(src[layer]) != len(dst[layer]):
            diffs.append(f"{layer}: {len(src[layer])} source blocks vs {len(dst[layer])} destination blocks")
    return diffs
