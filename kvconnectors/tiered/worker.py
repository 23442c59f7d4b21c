"""Worker side of TieredConnector (runs in every vLLM worker process): the facade vLLM calls.

It assembles this rank's parts once the KV cache is known (`register_kv_caches`) and hands each
vLLM hook to the part that owns the work; each part owns its state and gets what it calls back
through its constructor, so calls flow one way, down:

  producer  save_kv_layer / wait_for_save -> StagingBook (staging.py) -> PushBook (pushes.py)
            the store and its server (transport/server.py) serve what was staged
  consumer  start_load_kv -> Puller (puller.py) -> LandedReader (landed.py, push mode),
            ReslicedReads (resliced.py, another TP size), PullPaths (pull_paths.py)
  both      PeerLinks (links.py): connections and allowed_peers; LoadResults (results.py):
            outcomes for get_finished and the stats for vLLM's metrics

Report every outcome (done or failed with a cause) through `take_results` so vLLM's
`kv_load_failure_policy` acts on failures.
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch

from kvconnectors.errors import ConfigError, TransferError
from kvconnectors.logs import get_logger
from kvconnectors.mover import BlockGeometry, DeviceOps, Loader, Stager, ops_for
from kvconnectors.mover.geometry import UnsupportedKVCache
from kvconnectors.mover.reslice import RowLayout, geometry_row_layout
from kvconnectors.store import StoreConfig, TieredStore
from kvconnectors.store.reaper import Reaper
from kvconnectors.tiered.config import TieredConfig
from kvconnectors.tiered.landed import LandedReader, fragment_shapes
from kvconnectors.tiered.layout import KVLayout, detect_layout
from kvconnectors.tiered.links import PeerLinks
from kvconnectors.tiered.metadata import TieredConnectorMetadata, TieredHandshakeMetadata
from kvconnectors.tiered.pull_paths import PullPaths
from kvconnectors.tiered.puller import Puller
from kvconnectors.tiered.resliced import ReslicedReads
from kvconnectors.tiered.results import LoadResults
from kvconnectors.tiered.staging import StagingBook, StagingFailures
from kvconnectors.tiered.stats import TieredStats
from kvconnectors.transport import nixl as nixl_transport
from kvconnectors.transport import nixl_device
from kvconnectors.transport.auth import load_secret
from kvconnectors.transport.landing import Landing
from kvconnectors.transport.paths import TCP_PUSH, NixlPush
from kvconnectors.transport.server import StoreServer

logger = get_logger(__name__)


class TieredConnectorWorker:
    def __init__(self, vllm_config: Any, config: TieredConfig, engine_id: str):
        self.config, self.engine_id = config, engine_id
        ktc = vllm_config.kv_transfer_config
        self.is_producer, self.is_consumer = ktc.is_kv_producer, ktc.is_kv_consumer
        self.block_size = vllm_config.cache_config.block_size
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        names = getattr(vllm_config.model_config, "served_model_name", None) or ""
        self._model_name = names[0] if isinstance(names, (list, tuple)) else str(names)
        self._vllm_config = vllm_config
        resolve = getattr(vllm_config.cache_config, "get_resolved_kv_cache_layout", None)
        resolved = resolve() if resolve else None
        self._cache_layout = getattr(resolved, "name", None) or (str(resolved) if resolved else "unknown")
        self._cache_dtype = str(getattr(vllm_config.cache_config, "cache_dtype", "auto") or "auto")
        if config.transfer_mode == "push" and self.is_consumer and self.tp_size > 1 and not config.store_port:
            # rank r's landing store listens on store_port + r, derived by the prefill side from push_target
            raise ConfigError("store_port", config.store_port, (
                "push mode with tensor parallelism needs a fixed store_port (rank r listens on store_port + r)"))
        # Tickets and push targets come from HTTP clients: connect only to allowed_peers.
        self.links = PeerLinks(config, engine_id, load_secret(config.secret_file))
        if config.piecewise and self.is_consumer and not self.is_producer and config.cudagraph_piecewise == "auto":
            logger.warning("TieredConnector: this decode instance runs PIECEWISE CUDA graphs because push mode "
                           "forces them for producers (vLLM decides before it knows the role); set "
                           "cudagraph_piecewise 'off' in its kv_connector_extra_config to keep full graphs")
        if config.test_hooks:  # say it loudly: any client of this instance can ask for corrupted KV
            logger.warning("TieredConnector test_hooks is on: requests may ask for their KV to be corrupted "
                           "(kv_transfer_params kvc_fault); for tests only, never in production")
        # transport nixl: fail start-up now if NIXL is missing; the consumer agent comes at first pull
        if config.transport == "nixl":
            nixl_transport.require_nixl()
        self.results = LoadResults()
        # set up by register_kv_caches, once the KV cache is known
        self.layout: KVLayout | None = None
        self.geometry: BlockGeometry | None = None
        self.ops: DeviceOps | None = None
        self.loader: Loader | None = None   # consumer: host bytes -> KV blocks
        self._row_layout: RowLayout | UnsupportedKVCache | None = None
        self._layer_index: dict[str, int] = {}
        self.store: TieredStore | None = None
        self.server: StoreServer | None = None
        self._reaper: Reaper | None = None
        self._store_last: tuple[dict, dict] | None = None  # None: the first report always goes out
        self.staging: StagingBook | None = None  # producer
        self.landing: Landing | None = None      # consumer, push mode: the landing receiver
        self.paths: PullPaths | None = None
        self.puller: Puller | None = None
        self._resliced: ReslicedReads | None = None
        self._landed: LandedReader | None = None

    @property
    def stats(self) -> TieredStats:
        return self.results.stats

    @property
    def totals(self) -> TieredStats:
        return self.results.totals

    # ------------------------------------------------------------------ start-up: the assembly
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        tp_rank = get_tensor_model_parallel_rank() if self.tp_size > 1 else 0
        self.layout, self.geometry = detect_layout(
            kv_caches, self.block_size, self._cache_layout, self.tp_size, tp_rank, model=self._model_name,
            backend=_attention_backend(self._vllm_config), cache_dtype=self._cache_dtype,
            total_kv_heads=_total_kv_heads(self._vllm_config), model_dtype=_model_dtype(self._vllm_config))
        try:  # needed only when a producer runs another TP size: refused then, naming layout and dtype
            self._row_layout = geometry_row_layout(self.geometry)
        except UnsupportedKVCache as exc:
            self._row_layout = exc
            logger.warning("TieredConnector: pools of another tensor-parallel size will be refused: %s "
                           "(equal TP sizes are unaffected)", exc)
        self.ops = ops_for(self.geometry.device)
        self.loader = Loader(self.geometry, self.ops)
        self._layer_index = {name: i for i, name in enumerate(kv_caches)}
        self.paths = PullPaths(self.config.transport, self.engine_id, self.layout.tp_rank, self.geometry,
                               self.loader, self.results.record, self.config.checksum)
        if self.is_consumer and nixl_device.applies(self.geometry.device, self.config.transport):
            self.paths.open_device()
        landing = self.is_consumer and self.config.transfer_mode == "push"
        if self.is_producer or landing:
            self._open_store(tp_rank, landing)
        self._resliced = ReslicedReads(self.layout, self.config, self.links, self.paths, self.loader,
                                       self.results.record)
        if self.landing is not None and self.store is not None:
            self._landed = LandedReader(self.store, self.landing.entries, self.layout, self.config, self.loader,
                                        self._resliced, self.results.record)
        self.puller = Puller(self.layout, self.geometry, self._row_layout, self.config, self.links, self.paths,
                             self.loader, self.results, self._resliced, self._landed)

    def _open_store(self, tp_rank: int, landing: bool) -> None:
        """This rank's store and its server: what it stages (producer), what lands here (push mode)."""
        assert self.layout is not None and self.geometry is not None and self.ops is not None
        cfg, layout, row_layout = self.config, self.layout, self._row_layout
        safe = re.sub(r"[^A-Za-z0-9_.]", "", self.engine_id)[:16] or "engine"
        self.store = TieredStore(StoreConfig(
            slot_bytes=layout.block_bytes, dram_bytes=cfg.dram_bytes, nvme_dirs=cfg.nvme_dirs,
            nvme_bytes=cfg.nvme_bytes, nvme_create_dirs=cfg.nvme_create_dirs, lease_ttl_s=cfg.lease_ttl_s,
            instance_name=f"{cfg.instance_name}{tp_rank}",
            shm_name=f"kvc_{safe}_{tp_rank}_{os.getpid()}" if cfg.transport == "shm" else None))
        # the producer's stager page-locks the arena; a landing store's arena is pinned for host->device
        # copies. Before anything listens or registers it with NIXL, as it always was.
        stager = Stager(self.geometry, self.store, self.ops, checksum=cfg.checksum) if self.is_producer else None
        if stager is None and self.store.arena_slots().size:
            self.ops.pin(self.store.arena_slots(), "the landing store's DRAM arena")
        # Expiry is the backstop for consumers that never come: check a few times per TTL.
        self._reaper = Reaper(self.store, interval_s=min(1.0, cfg.lease_ttl_s / 4)).start()
        port = cfg.store_port + tp_rank if cfg.store_port else 0
        if landing:
            push_paths = [TCP_PUSH] + ([NixlPush(sink_factory=lambda: nixl_transport.NixlSink(
                tag=f"landing-{self.engine_id}"))] if cfg.transport == "nixl" else [])
            # pushes land rows unsliced: the producer's rows must be ours byte for byte
            self.landing = Landing(self.store, fingerprint=layout.rows_fingerprint,
                                   num_layers=layout.num_layers, paths=push_paths, test_hooks=cfg.test_hooks,
                                   fragment_rows=fragment_shapes(layout, row_layout)
                                   if isinstance(row_layout, RowLayout) and not row_layout.mla else None)
        failures = StagingFailures()
        # peers of the previous wire version too (allow_previous_wire): pools are upgraded one at a time.
        # A producer-only server knows every transfer by its token (granted when its staging starts);
        # a landing store's pushed entries answer to the token their pushes carried (landing.py).
        self.server = StoreServer(self.store, cfg.bind_host, port, fingerprint=layout.fingerprint,
                                  rows_fingerprint=layout.rows_fingerprint,
                                  num_layers=layout.num_layers, compat=cfg.compat,
                                  secret=self.links.secret, idle_timeout_s=cfg.server_idle_timeout_s,
                                  handshake_timeout_s=cfg.server_handshake_timeout_s,
                                  max_connections=cfg.server_max_connections, max_per_peer=cfg.server_max_per_peer,
                                  max_pending=cfg.server_max_pending,
                                  staging_failure=failures.get, faults=cfg.fault_plan,
                                  nixl=cfg.transport == "nixl" and self.is_producer, landing=self.landing,
                                  require_grants=self.is_producer and not landing,
                                  protection=cfg.wire_protection,
                                  # consumers of a larger TP size read only the heads they keep
                                  row_layout=row_layout if self.is_producer and isinstance(
                                      row_layout, RowLayout) else None,
                                  tp_size=layout.tp_size)  # a producer of another TP size plans by it
        if stager is not None:
            assert row_layout is not None
            self.staging = StagingBook(
                self.store, stager, self.ops, layout,
                cfg, self.server, failures, self.results.record, self.links,
                push_path=NixlPush(source=self.server.nixl) if self.server.nixl else TCP_PUSH, row_layout=row_layout)
        logger.info("TieredConnector store: %s DRAM, serving %s:%d (%s%s), block %d B x %d layers "
                    "(%s %s %s on %s)", cfg.dram_bytes, cfg.bind_host, self.server.port, cfg.transport,
                    ", accepts pushes" if landing else "", layout.block_bytes, layout.num_layers,
                    self.geometry.backend, self.geometry.layout, self._cache_dtype, self.geometry.device)

    def get_handshake_metadata(self) -> TieredHandshakeMetadata | None:
        if self.server is None or self.layout is None:
            return None
        return TieredHandshakeMetadata(host=self.config.advertise_host or self.server.host, port=self.server.port,
                                       tp_rank=self.layout.tp_rank, fingerprint=self.layout.fingerprint,
                                       shm_path=self.store.shm_path or "" if self.store else "",
                                       kv_heads=self.layout.kv_heads)

    # ------------------------------------------------------------------ producer
    def save_kv_layer(self, meta: TieredConnectorMetadata, layer_name: str) -> None:
        """Called after each attention layer: hand its new blocks to the staging thread and return."""
        if not meta.saves or self.staging is None:
            return
        layer = self._layer_index.get(layer_name)
        if layer is not None:
            self.staging.save_layer(meta, layer)

    def wait_for_save(self, meta: TieredConnectorMetadata) -> None:
        if self.staging is not None:
            self.staging.wait_for_save(meta)

    def drop(self, transfer_ids: list[str]) -> None:
        """Requests aborted before their transfer ended: what was granted, staged or landed goes."""
        for tid in transfer_ids:
            if self.server is not None:
                self.server.revoke(tid)
            if self._landed is not None:  # (forgets the landing records before the entry goes)
                self._landed.free([tid])
                self._landed.free_fragments(tid)
            if self.staging is not None:
                self.staging.drop(tid)

    # ------------------------------------------------------------------ consumer
    def start_load_kv(self, meta: TieredConnectorMetadata) -> None:
        if meta.drops:
            self.drop(meta.drops)
        for spec in meta.recvs:
            assert self.puller is not None, "start_load_kv before register_kv_caches"
            self.puller.submit(spec)

    @property
    def inflight_loads(self) -> int:
        return self.results.inflight

    def take_results(self, wait_s: float = 0.0) -> tuple[set[str], dict[str, TransferError]]:
        """Loads done now, and loads failed by the previous call (results.py)."""
        return self.results.take(wait_s)

    def get_stats(self) -> TieredStats | None:
        return self.results.report(self._store_report())

    def _store_report(self) -> dict | None:
        """Store counter deltas since the last report, gauges for the log line, and the store's
        address (the API server reads the store's state from it at scrape time, prom.py); None
        when nothing changed since the last report (the first one always goes out)."""
        if self.store is None or self.server is None:
            return None
        counters = self.store.stats.snapshot()
        usage = self.store.usage()
        gauges = {"entries": usage["entries"], "dram_bytes": usage["dram"]["used_bytes"],
                  "nvme_bytes": usage["nvme"]["used_bytes"]}
        last_counters, last_gauges = self._store_last or ({}, None)
        deltas = {k: v - last_counters.get(k, 0) for k, v in counters.items() if isinstance(v, (int, float))}
        deltas = {k: v for k, v in deltas.items() if v}
        if not deltas and gauges == last_gauges:
            return None
        self._store_last = (counters, gauges)
        addr = f"{self.config.advertise_host or self.server.host}:{self.server.port}"
        return {"addrs": [addr], "gauges": gauges, "deltas": deltas}

    # ------------------------------------------------------------------ shutdown
    def shutdown(self) -> None:
        for part in (self.puller, self._resliced):
            if part is not None:
                part.close()
        self.links.close()
        if self.staging is not None:
            self.staging.close()
            self.staging = None
        if self.paths is not None:
            self.paths.close()
        if self._reaper is not None:
            self._reaper.stop()
        if self.server is not None:
            self.server.close()
            self.server = None
        ops, self.ops = getattr(self, "ops", None), None  # set by register_kv_caches
        try:
            if ops is not None:
                ops.close()  # the copy stream; CUDA: unpins the arena, so before the store unmaps it
        finally:
            if self.store is not None:
                self.store.close()
                self.store = None


def _model_dtype(vllm_config: Any) -> torch.dtype | None:
    """The model's compute dtype (None in tests built without a model config): vLLM's CPU
    attention picks its packing by it, also for an fp8 cache."""
    dtype = getattr(getattr(vllm_config, "model_config", None), "dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else None


def _total_kv_heads(vllm_config: Any) -> int:
    """The model's KV heads over all ranks (0 where the config cannot say: tests without a model)."""
    get = getattr(getattr(vllm_config, "model_config", None), "get_total_num_kv_heads", None)
    try:
        return int(get()) if get is not None else 0
    except Exception as exc:  # a config built without an hf_config (tests): the layout derives it
        logger.debug("total KV heads unknown: %r", exc)
        return 0


def _attention_backend(vllm_config: Any) -> str:
    """The attention backend's name (FLASH_ATTN, CPU_ATTN, ...): it decides what a block's bytes
    mean. Several distinct backends (hybrid models) are refused by the mover."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

        names = sorted({b.get_name() for b in get_current_attn_backends(vllm_config)})
    except Exception as exc:  # an engine built without the usual config (tests): say so, move on
        logger.debug("attention backend unknown: %r", exc)
        return "unknown"
    return names[0] if len(names) == 1 else "+".join(names)
