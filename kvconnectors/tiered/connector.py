"""TieredConnector: the `KVConnectorBase_V1` facade vLLM instantiates.

A thin facade, as in vLLM's NixlConnector: vLLM builds it twice per engine, once per role, and
each instance owns exactly one of a scheduler-side or a worker-side object and forwards to it.

    --kv-transfer-config '{"kv_connector": "TieredConnector",
                           "kv_connector_module_path": "kvconnectors.tiered",
                           "kv_role": "kv_producer", "kv_connector_extra_config": {"transport": "tcp"}}'

After `pip install kvconnectors` the module path can be omitted (a vllm.general_plugins entry
point registers the name). Settings: see tiered/README.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvconnectors.compat import check_vllm_version

check_vllm_version()

from kvconnectors.registry import setup_process  # noqa: E402

# The plugin entry point does this in every vLLM process of an installed kvconnectors; a checkout
# loaded by kv_connector_module_path has no entry point, and vLLM importing this module is where
# each of its processes passes (idempotent).
setup_process()

from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorBase_V1, KVConnectorRole, KVConnectorTransferResults)

from vllm.v1.metrics.cache_hit_source import CacheHitSource  # noqa: E402

from kvconnectors.mover.geometry import PREFERRED_LAYOUT  # noqa: E402
from kvconnectors.tiered.config import TieredConfig  # noqa: E402
from kvconnectors.tiered.metadata import TieredConnectorMetadata  # noqa: E402
from kvconnectors.tiered.scheduler import TieredConnectorScheduler  # noqa: E402
from kvconnectors.tiered.stats import TieredStats  # noqa: E402
from kvconnectors.tiered.worker import TieredConnectorWorker  # noqa: E402

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


class TieredConnector(KVConnectorBase_V1):
    # vLLM's prompt_tokens_cached_by_source: in pull mode the prompt's KV comes from a peer.
    _cache_hit_source = CacheHitSource.P2P

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig | None" = None):
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        config = TieredConfig.from_extra(ktc.kv_connector_extra_config)
        config.check_engine_policy(getattr(ktc, "kv_load_failure_policy", "fail"))
        config.check_role(ktc.kv_role)
        engine_id = str(ktc.engine_id)
        self.connector_scheduler: TieredConnectorScheduler | None = None
        self.connector_worker: TieredConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = TieredConnectorScheduler(vllm_config, config, engine_id)
        else:
            self.connector_worker = TieredConnectorWorker(vllm_config, config, engine_id)

    # ============================== Scheduler side methods ==============================
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.connector_scheduler is not None
        return self.connector_scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        assert self.connector_scheduler is not None
        self.connector_scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> TieredConnectorMetadata:
        assert self.connector_scheduler is not None
        return self.connector_scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self.connector_scheduler is not None
        return self.connector_scheduler.request_finished(request, block_ids)

    def get_external_cache_hit_sources(self, request: "Request", num_external_tokens: int) -> dict:
        if num_external_tokens == 0 or self.connector_scheduler is None:
            return {}
        return self.connector_scheduler.hit_sources(request, num_external_tokens)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: "VllmConfig") -> str | None:
        # Every block of a layer one contiguous run: one memcpy (CPU) or one DMA row (GPU) per
        # block, and what NixlConnector asks for too. MLA has one head: any layout is one run.
        use_mla = bool(getattr(getattr(vllm_config, "model_config", None), "use_mla", False))
        return None if use_mla else PREFERRED_LAYOUT

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # vLLM passes only kv_connector_extra_config here, so the role comes from the config
        # (cudagraph_piecewise, tiered/README.md): push producers stream layer groups from
        # save_kv_layer, which a replayed full graph skips; pull mode and decode instances keep
        # full graphs (layers a graph skipped are staged in wait_for_save, after the forward).
        # vLLM asks while it builds its config, before any model loads (on CUDA, where graphs are
        # on by default): the earliest point the connector sees its settings, so the checks of what
        # start-up needs on this host run here too, not minutes later (issue 41).
        config = TieredConfig.from_extra(extra_config)
        config.check_local(create_dirs=False)
        return config.piecewise

    def update_connector_output(self, connector_output: Any) -> None:
        if self.connector_scheduler is not None:
            self.connector_scheduler.update_connector_output(connector_output)

    def on_new_request(self, request: "Request") -> None:
        if self.connector_scheduler is not None:
            self.connector_scheduler.on_new_request(request)

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        assert self.connector_scheduler is not None
        self.connector_scheduler.set_xfer_handshake_metadata(metadata)

    # ============================== Worker side methods ==============================
    def register_kv_caches(self, kv_caches: dict[str, "torch.Tensor"]) -> None:
        assert self.connector_worker is not None
        self.connector_worker.register_kv_caches(kv_caches)

    def get_handshake_metadata(self) -> Any:
        return self.connector_worker.get_handshake_metadata() if self.connector_worker else None

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        assert self.connector_worker is not None
        self.connector_worker.start_load_kv(self._tiered_meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads are asynchronous: the request is not in the batch until they finish

    def save_kv_layer(self, layer_name: str, kv_layer: "torch.Tensor", attn_metadata: Any, **kwargs: Any) -> None:
        assert self.connector_worker is not None
        self.connector_worker.save_kv_layer(self._tiered_meta(), layer_name)

    def wait_for_save(self) -> None:
        assert self.connector_worker is not None
        self.connector_worker.wait_for_save(self._tiered_meta())

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self.connector_worker is not None
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        idle = isinstance(meta, TieredConnectorMetadata) and meta.idle_step
        done, failed = self.connector_worker.take_results(wait_s=self.connector_worker.config.idle_wait_s if idle else 0.0)
        # Failed loads are also "finished receiving": that releases the request from its wait,
        # and failed_recving makes vLLM's kv_load_failure_policy fail or recompute it.
        return KVConnectorTransferResults(finished_recving=done | set(failed), failed_recving=set(failed))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return None, results.finished_recving or None

    def get_kv_connector_stats(self) -> TieredStats | None:
        return self.connector_worker.get_stats() if self.connector_worker else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> TieredStats:
        return TieredStats(data=data or {})

    @classmethod
    def build_prom_metrics(cls, vllm_config: "VllmConfig", metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> Any:
        from kvconnectors.tiered.prom import TieredPromMetrics

        return TieredPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # vLLM 0.33: sleep mode discards and re-allocates the KV caches under the connector's feet;
    # our registered block views would dangle, so decline it clearly at config time.
    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any = None) -> bool:
        return False

    def unregister_kv_caches(self) -> None:
        raise RuntimeError("TieredConnector does not support vLLM sleep mode")

    def restore_kv_caches(self) -> None:
        raise RuntimeError("TieredConnector does not support vLLM sleep mode")

    def shutdown(self) -> None:
        if self.connector_worker is not None:
            self.connector_worker.shutdown()
        if self.connector_scheduler is not None:
            self.connector_scheduler.shutdown()

    def _tiered_meta(self) -> TieredConnectorMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, TieredConnectorMetadata), type(meta)
        return meta
