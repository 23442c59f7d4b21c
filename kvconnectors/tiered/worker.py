"""Worker side of TieredConnector (runs in every vLLM worker process).

Producer: after each attention layer, hand the request's newly computed blocks of that layer
(whole blocks, opaque bytes) to the staging thread, which copies them into the host store while
the next layers compute; `wait_for_save` waits for those copies (vLLM may then reuse the blocks)
and seals the entries whose prompt is complete. The store server in this process serves them to
consumers. Push mode: the staging thread also hands each finished layer group to the push sender,
which streams it to the decode instance's landing store (transport/push.py).
Consumer: pull a ticket's blocks straight into the KV cache blocks vLLM allocated, off the
forward thread, under a deadline; in push mode wait for the pushed copy to land in this worker's
own store and copy it in. Report every outcome (done or failed with a cause) through
`get_transfer_results` so vLLM's `kv_load_failure_policy` acts on failures.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any

import msgspec
import numpy as np
import torch

from kvconnectors.errors import ConfigError, FailureCause, StoreFullError, TransferError
from kvconnectors.logs import get_logger
from kvconnectors.store import StoreConfig, TieredStore
from kvconnectors.store.reaper import Reaper
from kvconnectors.tiered.config import TieredConfig
from kvconnectors.mover import BlockGeometry, CopyEvent, DeviceOps, Loader, Stager, ops_for
from kvconnectors.mover.geometry import UnsupportedKVCache
from kvconnectors.mover.heads import HeadRange, SliceStep
from kvconnectors.mover.reslice import RowLayout, copy_heads, geometry_row_layout
from kvconnectors.tiered.layout import KVLayout, detect_layout
from kvconnectors.tiered.tp import Reslice, plan_for
from kvconnectors.tiered.metadata import RecvSpec, SaveSpec, TieredConnectorMetadata, TieredHandshakeMetadata
from kvconnectors.tiered import params as kvparams
from kvconnectors.tiered.params import TransferParams
from kvconnectors.tiered.stats import TieredStats
from kvconnectors.transport import nixl as nixl_transport
from kvconnectors.transport import nixl_device
from kvconnectors.transport import tamper, wire
from kvconnectors.transport.auth import load_secret
from kvconnectors.transport.block_views import BlockViews
from kvconnectors.transport.client import StoreClient
from kvconnectors.transport.client_pool import ClientPool
from kvconnectors.transport.landing import Landing
from kvconnectors.transport.peers import PeerPolicy
from kvconnectors.transport.paths import (TCP_HEADS_PULL, TCP_PULL, TCP_PUSH, NixlDevicePull, NixlPull,
                                         NixlPush, PullPath, ShmPull)
from kvconnectors.tiered.push_routes import (Addr, ConsumerSizes, NotPushable, PushRoute, fragment_id, is_fragment_of,
                                             push_routes)
from kvconnectors.transport.push import PushJob, PushSender, parse_target
from kvconnectors.transport.server import StoreServer

logger = get_logger(__name__)
_MAX_FAILURE_MEMORY = 10_000
FIRST_CHUNK_GRACE_S = 5.0  # push: no chunk of a transfer landed by then -> pull from the producer
LANDED_READ_BYTES = 32 << 20  # push: bytes copied out of the landing store per read_into call


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
        self._secret = load_secret(config.secret_file)
        if config.piecewise and self.is_consumer and not self.is_producer and config.cudagraph_piecewise == "auto":
            logger.warning("TieredConnector: this decode instance runs PIECEWISE CUDA graphs because push mode "
                           "forces them for producers (vLLM decides before it knows the role); set "
                           "cudagraph_piecewise 'off' in its kv_connector_extra_config to keep full graphs")
        if config.test_hooks:  # say it loudly: any client of this instance can ask for corrupted KV
            logger.warning("TieredConnector test_hooks is on: requests may ask for their KV to be corrupted "
                           "(kv_transfer_params kvc_fault); for tests only, never in production")
        self._compat = config.compat  # the previous wire version too, while allow_previous_wire
        # Tickets and push targets come from HTTP clients: connect only to allowed_peers.
        self._peers = PeerPolicy.from_setting(config.allowed_peers, (config.bind_host, config.advertise_host))
        self.layout: KVLayout | None = None
        self.geometry: BlockGeometry | None = None
        self.ops: DeviceOps | None = None
        self.stager: Stager | None = None   # producer: KV blocks -> store slots
        self.loader: Loader | None = None   # consumer: host bytes -> KV blocks
        self._layer_index: dict[str, int] = {}
        self.store: TieredStore | None = None
        self.server: StoreServer | None = None
        self._reaper: Reaper | None = None
        self._store_last: tuple[dict, dict] | None = None  # None: the first report always goes out
        # producer staging state (staging thread; the forward thread once it has drained)
        self._checksums: dict[str, np.ndarray] = {}
        self._staging_failed: dict[str, TransferError] = {}
        self._stager_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvc-stage")
        self._staging: list = []                     # this step's copy futures
        self._push_layers: dict[str, list[int]] = {}  # transfer -> staged layers not yet pushed
        self._layers_this_step: dict[str, set[int]] = {}  # transfer -> layers staged in this step
        self._push_targets: dict[str, list[PushRoute]] = {}  # transfer -> where its groups go (until sealed)
        self._push_open: dict[str, dict[Addr, PushRoute]] = {}  # transfer -> routes not finished yet
        self._push_kept: set[str] = set()  # a route was refused: its consumer rank pulls the staged copy
        self._consumer_sizes = ConsumerSizes(self._ask_tp_size, self.tp_size)
        self._said_not_pushable: set[Addr] = set()
        self._fragment_shapes: dict[tuple[int, int], tuple[str, int]] = {}  # landing: heads -> (fingerprint, row bytes)
        self._stage_lock = threading.RLock()
        self.pusher: PushSender | None = None
        self.landing: Landing | None = None
        # consumer results (pull threads -> forward thread)
        self._lock = threading.RLock()
        self._results_ready = threading.Condition(self._lock)  # a load finished or failed
        self._done: set[str] = set()
        self._failed: dict[str, TransferError] = {}
        self._failed_ready: dict[str, TransferError] = {}  # reported at the next take_results
        self.stats = TieredStats()    # this interval's, handed to vLLM and reset
        self.totals = TieredStats()   # since start-up: what tests and diagnostics read
        self._pool = ThreadPoolExecutor(max_workers=config.max_concurrent_loads, thread_name_prefix="kvc-pull")
        # Connections to producers, kept between pulls; never one a producer of this configuration
        # would time out (it closes a connection idle for server_idle_timeout_s).
        self._producers = ClientPool(self._client, max_idle_s=min(30.0, config.server_idle_timeout_s / 2))
        # another TP size: a pull reads its producer ranks side by side (threads start on demand)
        self._rank_reads = ThreadPoolExecutor(max_workers=4 * config.max_concurrent_loads,
                                              thread_name_prefix="kvc-rank-read")
        # transport nixl: fail start-up now if NIXL is missing; the consumer agent comes at first pull
        if config.transport == "nixl":
            nixl_transport.require_nixl()
        self._nixl_pull: NixlPull | None = None  # holds this process's consumer NIXL agent
        self._nixl_device: NixlDevicePull | None = None  # CUDA cache: its agent, the cache registered as VRAM
        self._nixl_lock = threading.Lock()
        self._warned_nixl_device = False
        self.inflight_loads = 0

    # ------------------------------------------------------------------ start-up
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        tp_rank = get_tensor_model_parallel_rank() if self.tp_size > 1 else 0
        self.layout, self.geometry = detect_layout(
            kv_caches, self.block_size, self._cache_layout, self.tp_size, tp_rank, model=self._model_name,
            backend=_attention_backend(self._vllm_config), cache_dtype=self._cache_dtype,
            total_kv_heads=_total_kv_heads(self._vllm_config), model_dtype=_model_dtype(self._vllm_config))
        try:  # needed only when a producer runs another TP size: refused then, naming layout and dtype
            self._row_layout: RowLayout | UnsupportedKVCache = geometry_row_layout(self.geometry)
        except UnsupportedKVCache as exc:
            self._row_layout = exc
            logger.warning("TieredConnector: pools of another tensor-parallel size will be refused: %s "
                           "(equal TP sizes are unaffected)", exc)
        self.ops = ops_for(self.geometry.device)
        self.loader = Loader(self.geometry, self.ops)
        self._layer_index = {name: i for i, name in enumerate(kv_caches)}
        if self.is_consumer and nixl_device.applies(self.geometry.device, self.config.transport):
            self._open_nixl_device()
        landing = self.is_consumer and self.config.transfer_mode == "push"
        if not (self.is_producer or landing):
            return
        cfg = self.config
        safe = re.sub(r"[^A-Za-z0-9_.]", "", self.engine_id)[:16] or "engine"
        self.store = TieredStore(StoreConfig(
            slot_bytes=self.layout.block_bytes, dram_bytes=cfg.dram_bytes, nvme_dirs=cfg.nvme_dirs,
            nvme_bytes=cfg.nvme_bytes, nvme_create_dirs=cfg.nvme_create_dirs, lease_ttl_s=cfg.lease_ttl_s,
            instance_name=f"{cfg.instance_name}{tp_rank}",
            shm_name=f"kvc_{safe}_{tp_rank}_{os.getpid()}" if cfg.transport == "shm" else None))
        if self.is_producer:
            self.stager = Stager(self.geometry, self.store, self.ops, checksum=cfg.checksum)
        elif self.store.arena_slots().size:  # the landing store: landed copies go host->device from it
            self.ops.pin(self.store.arena_slots(), "the landing store's DRAM arena")
        # Expiry is the backstop for consumers that never come: check a few times per TTL.
        self._reaper = Reaper(self.store, interval_s=min(1.0, cfg.lease_ttl_s / 4)).start()
        port = cfg.store_port + tp_rank if cfg.store_port else 0
        if landing:
            push_paths = [TCP_PUSH] + ([NixlPush(sink_factory=lambda: nixl_transport.NixlSink(
                tag=f"landing-{self.engine_id}"))] if cfg.transport == "nixl" else [])
            # pushes land rows unsliced: the producer's rows must be ours byte for byte
            self.landing = Landing(self.store, fingerprint=self.layout.rows_fingerprint,
                                   num_layers=self.layout.num_layers, paths=push_paths, test_hooks=cfg.test_hooks,
                                   fragment_rows=self._fragment_rows if isinstance(self._row_layout, RowLayout)
                                   and not self._row_layout.mla else None)
        # peers of the previous wire version too (allow_previous_wire): pools are upgraded one at a time.
        # A producer-only server knows every transfer by its token (granted when its staging starts);
        # a landing store's pushed entries answer to the token their pushes carried (landing.py).
        self.server = StoreServer(self.store, cfg.bind_host, port, fingerprint=self.layout.fingerprint,
                                  rows_fingerprint=self.layout.rows_fingerprint,
                                  num_layers=self.layout.num_layers, compat=self._compat,
                                  secret=self._secret, idle_timeout_s=cfg.server_idle_timeout_s,
                                  handshake_timeout_s=cfg.server_handshake_timeout_s,
                                  max_connections=cfg.server_max_connections, max_per_peer=cfg.server_max_per_peer,
                                  max_pending=cfg.server_max_pending,
                                  staging_failure=self._staging_failed.get, faults=cfg.fault_plan,
                                  nixl=cfg.transport == "nixl" and self.is_producer, landing=self.landing,
                                  require_grants=self.is_producer and not landing,
                                  protection=cfg.wire_protection,
                                  # consumers of a larger TP size read only the heads they keep
                                  row_layout=self._row_layout if self.is_producer and isinstance(
                                      self._row_layout, RowLayout) else None,
                                  tp_size=self.layout.tp_size)  # a producer of another TP size plans by it
        if self.is_producer:
            self.pusher = PushSender(self.store, fingerprint=self.layout.rows_fingerprint,
                                     num_layers=self.layout.num_layers, client_factory=self._client,
                                     timeout_s=cfg.load_timeout_s, on_done=self._push_done,
                                     path=NixlPush(source=self.server.nixl) if self.server.nixl else TCP_PUSH,
                                     row_layout=self._row_layout if isinstance(self._row_layout, RowLayout) else None)
        logger.info("TieredConnector store: %s DRAM, serving %s:%d (%s%s), block %d B x %d layers "
                    "(%s %s %s on %s)", cfg.dram_bytes, cfg.bind_host, self.server.port, cfg.transport,
                    ", accepts pushes" if landing else "", self.layout.block_bytes, self.layout.num_layers,
                    self.geometry.backend, self.geometry.layout, self._cache_dtype, self.geometry.device)

    def _open_nixl_device(self) -> None:
        """CUDA cache and transport nixl, once per rank at start-up: register the device KV cache
        with NIXL as VRAM for GPU-direct READs, or keep the host path, said once here (WARNING,
        naming the reason) and counted in kvconnectors:nixl_vram_fallbacks{reason}."""
        sink, fallback = nixl_device.open_direct(
            self.geometry, checksum=self.config.checksum,
            sink_factory=lambda: nixl_transport.NixlSink(tag=self.engine_id))
        rank = self.layout.tp_rank if self.layout is not None else 0
        if sink is not None:
            self._nixl_device = NixlDevicePull(sink=sink)
            logger.info("transport nixl, rank %d: pulls READ straight into the %s KV cache (registered with NIXL "
                        "as VRAM; this path has not been validated on GPU hardware)", rank, self.geometry.device)
            return
        assert fallback is not None
        self._warned_nixl_device = True  # said once, here; each load is still counted in path_fallbacks
        logger.warning("transport nixl, rank %d: not READing into device memory (%s: %s); pulls go over tcp into "
                       "page-locked host memory, then to the device", rank, fallback.reason, fallback.detail)
        self._record("record_nixl_vram_fallback", fallback.reason)

    def get_handshake_metadata(self) -> TieredHandshakeMetadata | None:
        if self.server is None or self.layout is None:
            return None
        return TieredHandshakeMetadata(host=self.config.advertise_host or self.server.host, port=self.server.port,
                                       tp_rank=self.layout.tp_rank, fingerprint=self.layout.fingerprint,
                                       shm_path=self.store.shm_path or "" if self.store else "",
                                       kv_heads=self.layout.kv_heads)

    # ------------------------------------------------------------------ producer
    def save_kv_layer(self, meta: TieredConnectorMetadata, layer_name: str) -> None:
        """Called after each attention layer: hand its new blocks to the staging thread and return
        (later layers never touch this layer's blocks, so they may be copied meanwhile)."""
        if not meta.saves or self.stager is None:
            return
        layer = self._layer_index.get(layer_name)
        if layer is not None:
            # the copy stream waits for this point of the forward stream, not the host
            after = self.ops.forward_event()
            self._staging.append(self._stager_thread.submit(self._stage_layers, [layer], meta.saves, after))

    def _stage_layers(self, layers: list[int], saves: list[SaveSpec], after: CopyEvent | None,
                      missing_only: bool = False) -> None:
        with self._stage_lock:  # the push sender may fail a transfer meanwhile
            for spec in saves:
                todo = layers
                if missing_only:  # the step's end: layers whose per-layer hook never ran
                    staged = self._layers_this_step.get(spec.transfer_id, set())
                    todo = [x for x in layers if x not in staged]
                if not todo:
                    continue
                try:
                    self._stage_spec(todo, spec, after)
                except Exception as exc:  # a bug must fail this transfer, not the engine (wait_for_save)
                    logger.exception("staging layers %s of %s failed", todo[:4], spec.transfer_id)
                    self._fail_staging(spec.transfer_id,
                                       TransferError(FailureCause.PROTOCOL, f"internal error: {exc!r}"))

    def _stage_spec(self, layers: list[int], spec: SaveSpec, after: CopyEvent | None) -> None:
        tid = spec.transfer_id
        if tid in self._staging_failed or not spec.block_ids:
            return
        try:
            if tid not in self._checksums:
                if self.server is not None:  # before the entry exists: it answers only to its ticket's token
                    self.server.grant(tid, spec.token)
                self.store.create(tid, self.layout.num_layers, spec.total_blocks)
                self._checksums[tid] = np.zeros((self.layout.num_layers, spec.total_blocks), np.uint64)
                if spec.push_target:
                    self._set_push_target(tid, spec.push_target)
            # one batched gather per layer, straight into the entry's slots, then checksums
            copy = self.stager.stage(tid, layers, spec.first_block, spec.block_ids, after)
            try:
                sums = self.stager.complete(copy, self.config.load_timeout_s)
            except TimeoutError:
                # complete() keeps the slots held while the copy still runs: give them back once it
                # is done, or the entry's write reference never ends and its slots never free
                self.stager.abandon(copy)
                raise
        except TransferError as exc:
            self._fail_staging(tid, exc)
            return
        except (OSError, ValueError, TimeoutError) as exc:  # a disk error or a bad spec fails this transfer
            self._fail_staging(tid, TransferError(FailureCause.PROTOCOL, f"staging error: {exc!r}"))
            return
        n = len(spec.block_ids)
        for i, layer in enumerate(layers):
            self._checksums[tid][layer, spec.first_block:spec.first_block + n] = sums[i]
        self._record("record_staged", copy.nbytes, n * len(layers))
        pending = self._push_layers.setdefault(tid, []) if tid in self._push_targets else None
        if pending is not None:
            pending.extend(layers)
        staged = self._layers_this_step.setdefault(tid, set())
        staged.update(layers)
        if spec.seal and len(staged) == self.layout.num_layers:
            # The prompt's last layer is staged: seal it and send its last group (with the seal)
            # from here, not after the forward thread's wait_for_save: one hand-off less between
            # the last layer's compute and the decode instance having everything.
            if self._seal_transfer(spec) and self.server is not None:
                self.server.notify_sealed()
        elif pending is not None and spec.layerwise and len(pending) >= self.config.layer_group_size:
            self._push_group(spec)

    def _ask_tp_size(self, host: str, port: int) -> int:
        """The TP size of the decode instance whose rank 0 lands on host:port (0: it does not say)."""
        try:
            with self._client(host, port) as client:
                return client.status(time.monotonic() + self.config.connect_timeout_s).tp_size
        except OSError as exc:  # typed, so ConsumerSizes remembers it and staging goes on for a pull
            raise TransferError(FailureCause.PEER_UNREACHABLE, f"landing store {host}:{port}: {exc}") from None

    def _set_push_target(self, tid: str, target: str) -> None:
        """Push `tid` to the consumer ranks behind `target` (its rank 0's landing store; rank r
        listens on port + r) that this rank serves (push_routes.py), unless the target is not
        allowed (a typed BAD_PARAMS error naming the field and value), cannot be asked, or the TP
        sizes are served by pulls: then it is staged for a pull only."""
        try:
            host, port = parse_target(target)
            host = self._peers.check(host, port, "kv_transfer_params.push_target")
            routes = push_routes(self.layout, self._row_layout, host, port, self._consumer_sizes.tp_size(host, port))
        except NotPushable as exc:
            if (host, port) not in self._said_not_pushable:
                self._said_not_pushable.add((host, port))
                logger.info("not pushing to %s:%d: %s", host, port, exc)
            return
        except (TransferError, ValueError) as exc:
            cause = exc.cause.value if isinstance(exc, TransferError) else FailureCause.BAD_PARAMS.value
            logger.warning("not pushing transfer %s: %s; it is staged for a pull", tid, exc)
            self._record("record_failure", f"push_{cause}")
            return
        if routes:  # else no consumer rank reads this rank's rows (replicated heads, MLA)
            self._push_targets[tid] = routes
            self._push_open[tid] = {r.target: r for r in routes}

    def _submit_push(self, tid: str, **job: object) -> None:
        """One PushJob per route of `tid` (a head fragment under its own id)."""
        assert self.pusher is not None
        for route in self._push_targets.get(tid, ()):
            wire_id = fragment_id(tid, self.layout.tp_rank) if route.fragment is not None else ""
            self.pusher.submit(PushJob(tid, route.target, heads=route.heads, fingerprint=route.fingerprint,
                                       wire_id=wire_id, fragment=route.fragment, **job))

    def _fragment_rows(self, start: int, stop: int) -> tuple[str, int]:
        """Landing side: the rows fingerprint and row bytes of a head fragment filling this rank's
        heads [start, stop) (push_routes.py); ValueError for a range that is not part of them."""
        known = self._fragment_shapes.get((start, stop))  # asked for every Push of a fragment
        if known is not None:
            return known
        heads = self.layout.block_shape[0]
        if not 0 <= start < stop <= heads or stop - start == heads:
            raise ValueError(f"not a part of this rank's {heads} KV heads")
        assert isinstance(self._row_layout, RowLayout)
        n = stop - start
        shape = (self.layout.with_heads(n).rows_fingerprint, self._row_layout.with_heads(n).row_bytes)
        self._fragment_shapes[(start, stop)] = shape  # (at most heads^2 / 2 entries)
        return shape

    def _push_group(self, spec: SaveSpec, end: bool = False) -> None:
        """Hand the staged, not yet pushed layers of `spec` to the push sender; `end`: the
        transfer's last message (the landing side seals it; sent even with no layers left)."""
        layers = self._push_layers.pop(spec.transfer_id, None) or []
        if self.pusher is None or not (layers or end):
            return
        if not layers:
            self._submit_push(spec.transfer_id, end=True, token=spec.token)
            return
        n = len(spec.block_ids)
        sums = self._checksums[spec.transfer_id]
        checksums = (np.concatenate([sums[layer, spec.first_block:spec.first_block + n] for layer in layers])
                     .tolist() if self.config.checksum else None)
        self._submit_push(spec.transfer_id, layers=layers, first_block=spec.first_block, num_blocks=n,
                          checksums=checksums, end=end, token=spec.token)

    def wait_for_save(self, meta: TieredConnectorMetadata) -> None:
        if self.store is None:
            return
        if meta.saves and self.stager is not None:
            # Layers whose per-layer hook did not run (a replayed full CUDA graph skips them) are
            # staged now, after the forward, in one call per transfer (one all-layer gather on a
            # cross-layer layout); on a CPU engine every hook runs and this finds nothing to do.
            self._staging.append(self._stager_thread.submit(
                self._stage_layers, list(range(self.layout.num_layers)), meta.saves, self.ops.forward_event(),
                True))
        staging, self._staging = self._staging, []
        for fut in staging:  # after this, every staged byte is in the store: vLLM may reuse the blocks
            fut.result()
        with self._stage_lock:  # the push sender may fail a transfer meanwhile
            self._seal_step(meta)
            self._layers_this_step.clear()

    def _seal_step(self, meta: TieredConnectorMetadata) -> None:
        sealed = False
        for spec in meta.saves:
            try:
                sealed |= self._finish_step(spec)
            except Exception as exc:  # a bug here must fail one transfer, never the engine's step
                logger.exception("finishing the staging step of %s failed", spec.transfer_id)
                self._fail_staging(spec.transfer_id, TransferError(FailureCause.PROTOCOL, f"internal error: {exc!r}"))
        if sealed and self.server is not None:
            self.server.notify_sealed()

    def _finish_step(self, spec: SaveSpec) -> bool:
        """After a step's copies: push its last group, and seal a completed prompt. True if sealed."""
        tid = spec.transfer_id
        if tid in self._staging_failed:
            return False
        if not spec.seal:
            if tid in self._push_targets:
                self._push_group(spec)  # this step's last group; the prompt goes on next step
            return False
        return self._seal_transfer(spec)  # unless the stager did at the last layer

    def _seal_transfer(self, spec: SaveSpec) -> bool:
        """Seal a completely staged prompt; in push mode send its last group, sealing the landing
        copy too. False if there is nothing to seal (already sealed, failed, never staged)."""
        tid = spec.transfer_id
        sums = self._checksums.get(tid)
        if sums is None:
            return False
        try:
            self.store.seal(tid, {"xxh3": sums.reshape(-1).tolist()} if self.config.checksum else None)
            # The lease started at the first staged layer; a long prefill must not eat it.
            self.store.renew(tid)
        except (TransferError, ValueError) as exc:
            self._fail_staging(tid, TransferError(FailureCause.PROTOCOL, f"seal failed: {exc}"))
            return False
        if tid in self._push_targets:
            # the last group (below layerwise_min_tokens: every layer), sealing the landing copy;
            # after our own seal, because a landed push releases our staged copy
            self._push_group(spec, end=True)
            self._push_targets.pop(tid, None)
        self._checksums.pop(tid, None)
        return True

    def _push_done(self, tid: str, target: Addr, error: TransferError | None) -> None:
        """Push sender thread: the push of a transfer to one consumer rank (`target`) finished
        (error None) or failed. The staged copy goes once every route landed."""
        if error is not None:
            self._record("record_failure", f"push_{error.cause.value}")
            # Broke on the wire: no consumer will pull the staged copy. Refused in step (store full, bad
            # checksum, gave up waiting, ...) or never connected: it keeps it, the consumer pulls instead.
            if error.cause.push_lost and not error.refused:
                with self._stage_lock:
                    self._fail_staging(tid, TransferError(error.cause, f"push to the decode instance failed: {error}"))
                return
        with self._stage_lock:
            routes = self._push_open.get(tid)
            route = routes.pop(target, None) if routes is not None else None
            if route is None:
                return  # failed meanwhile (_fail_staging), or dropped
            if error is not None:
                self._push_kept.add(tid)
            else:
                info = self.store.info(tid) if self.store.contains(tid) else None
                if info is not None:
                    row = self.store.slot_bytes if route.heads is None else (
                        self._row_layout.with_heads(route.heads.count).row_bytes)
                    self._record("record_push", info.num_layers * info.num_blocks * row)
            if routes:
                return  # other consumer ranks still to land
            del self._push_open[tid]
            if tid in self._push_kept:
                self._push_kept.discard(tid)
                return  # a consumer rank was refused and pulls it: its lease keeper (or expiry) ends it
        try:  # every consumer rank holds it now, under its own lease
            self.store.release(tid)
        except TransferError:
            pass

    def _forget_push(self, tid: str) -> None:
        """(stage lock held) No more pushes of `tid`, and no route's end matters any more."""
        self._push_targets.pop(tid, None)
        self._push_open.pop(tid, None)
        self._push_kept.discard(tid)

    def _fail_staging(self, tid: str, exc: TransferError) -> None:
        logger.error("staging of transfer %s failed: %s", tid, exc)
        self._record("record_staging_failure", exc.cause.value)
        self._checksums.pop(tid, None)
        if len(self._staging_failed) >= _MAX_FAILURE_MEMORY:
            self._staging_failed.pop(next(iter(self._staging_failed)))
        self._staging_failed[tid] = exc
        self._push_layers.pop(tid, None)
        if tid in self._push_targets and self.pusher is not None:  # tell the consumer now, not at its deadline
            self._submit_push(tid, abort=exc)
        self._forget_push(tid)
        if self.store is not None and not isinstance(exc, StoreFullError):
            try:
                self.store.release(tid)
            except TransferError:
                pass
        if self.server is not None:
            self.server.notify_sealed()  # wake readers waiting for this transfer

    def drop(self, transfer_ids: list[str]) -> None:
        for tid in transfer_ids:
            if self.server is not None:
                self.server.revoke(tid)
            self._checksums.pop(tid, None)
            self._push_layers.pop(tid, None)
            if tid in self._push_targets and self.pusher is not None:
                self._submit_push(tid, abort=TransferError(
                    FailureCause.UNKNOWN_TRANSFER, "the request was aborted on the prefill instance"))
            with self._stage_lock:
                self._forget_push(tid)
            self._free_landed([tid])
            self._free_fragments(tid)

    def _free_landed(self, keys: list[str]) -> None:
        """Let go of these entries of this worker's store, and of the landing side's records of them."""
        for key in keys:
            if self.landing is not None:
                self.landing.forget(key)
            if self.store is not None:
                try:
                    self.store.release(key)
                except TransferError:
                    pass

    def _free_fragments(self, tid: str) -> None:
        """A pushed request's head fragments (decode TP < prefill TP) land under their own ids."""
        if tid and self.landing is not None and self.store is not None:
            self._free_landed([k for k in self.store.keys() if is_fragment_of(k, tid)])

    # ------------------------------------------------------------------ consumer
    def start_load_kv(self, meta: TieredConnectorMetadata) -> None:
        if meta.drops:
            self.drop(meta.drops)
        for spec in meta.recvs:
            with self._lock:
                self.inflight_loads += 1
            self._pool.submit(self._pull, spec)

    def _client(self, host: str, port: int) -> StoreClient:
        return StoreClient(host, port, compat=self._compat, secret=self._secret,
                           connect_timeout_s=self.config.connect_timeout_s, peer_name=self.engine_id[:wire.MAX_PEER_NAME],
                           protection=self.config.wire_protection)

    def _producer_client(self, p: TransferParams, rank: int) -> AbstractContextManager[StoreClient]:
        """A connection to the ticket's producer `rank` (whose address must be in allowed_peers) for
        a with-block: a kept one when there is one (client_pool.py), handed back when the block went
        well."""
        addr = p.addrs[rank]
        host = self._peers.check(addr.host, addr.port, f"kv_transfer_params.kvc.addrs[{rank}]")
        return self._producers.client(host, addr.port)

    def _pull(self, spec: RecvSpec) -> None:
        start = time.monotonic()
        deadline = start + self.config.load_timeout_s
        try:
            by_path = self._pull_with_retries(spec, deadline)
        except TransferError as exc:
            self._finish(spec.req_id, exc)  # report first: the release below may wait on a dead peer
            self._free_fragments(self._tid_of(spec))  # head fragments kept for a retry
            self._give_back(spec, exc)
        except Exception as exc:  # a bug must fail the request, not strand it
            logger.exception("unexpected error pulling KV for %s", spec.req_id)
            self._finish(spec.req_id, TransferError(FailureCause.PROTOCOL, f"internal error: {exc!r}"))
            self._free_fragments(self._tid_of(spec))
        else:
            self._finish(spec.req_id, None, by_path, time.monotonic() - start)

    @staticmethod
    def _tid_of(spec: RecvSpec) -> str:
        tid = spec.params.get("transfer_id") if isinstance(spec.params, dict) else None
        return tid if isinstance(tid, str) else ""

    def _give_back(self, spec: RecvSpec, exc: TransferError) -> None:
        """After a final failure, release the producer's entry now (best effort) instead of
        leaving it to the lease: this request will never read it (vLLM fails or recomputes)."""
        if spec.params is None or exc.cause.nothing_to_release:
            return
        try:
            p = msgspec.convert(spec.params, TransferParams)
            if p.v >= 4 and p.tp_size != self.layout.tp_size:
                return  # resliced: the scheduler's lease keeper releases every producer rank
            with self._producer_client(p, min(self.layout.tp_rank, len(p.addrs) - 1)) as client:
                client.release(p.transfer_id, time.monotonic() + self.config.connect_timeout_s, token=p.token)
        except (TransferError, OSError, msgspec.ValidationError) as release_exc:
            logger.warning("could not release transfer for %s after its failure (it will expire): %s",
                           spec.req_id, release_exc)

    def _pull_with_retries(self, spec: RecvSpec, deadline: float) -> dict[str, int]:
        """failure_policy "retry": transient faults (peer gone, timeout, bad bytes, protocol) are
        tried again with exponential back-off inside the one load deadline; the producer keeps
        its entry until a pull succeeds, so a retry reads the same bytes."""
        backoff = self.config.retry_backoff_s
        for attempt in range(spec.retries + 1):
            # Each attempt gets an even share of the time left, so a silent peer cannot eat it all.
            attempt_deadline = time.monotonic() + (deadline - time.monotonic()) / (spec.retries + 1 - attempt)
            try:
                return self._pull_into_cache(spec, attempt_deadline)
            except TransferError as exc:
                left = deadline - time.monotonic()
                if attempt == spec.retries or not exc.cause.transient or left <= backoff:
                    raise
                logger.warning("KV load for %s failed (%s), retry %d/%d in %.2fs", spec.req_id, exc,
                               attempt + 1, spec.retries, backoff)
                self._record("record_retry", exc.cause.value)
                time.sleep(backoff)
                backoff *= 2
        raise AssertionError("unreachable")

    def _pull_into_cache(self, spec: RecvSpec, deadline: float) -> dict[str, int]:
        """Load one request's KV into its blocks; returns the bytes each data path carried."""
        if spec.error_cause is not None:
            raise TransferError(spec.error_cause, spec.error_message)
        p = msgspec.convert(spec.params, TransferParams)
        layout = self.layout
        reslice = plan_for(p, layout, self._row_layout)  # checked before any byte lands in the KV cache
        num_blocks = p.num_blocks - spec.first_block
        if num_blocks <= 0:
            return {}
        if len(spec.block_ids) < num_blocks:
            raise TransferError(FailureCause.LAYOUT_MISMATCH,
                                f"{len(spec.block_ids)} local blocks allocated for {num_blocks} remote blocks")
        targets = spec.block_ids[:num_blocks]
        fault = tamper.kind_of(p.transfer_id, self.config.test_hooks)
        # Pushed here: this rank's rows (at another TP size when one producer rank holds all its
        # heads), or head fragments from several producer ranks (push_routes.py, pulled one by one
        # where missing); when they did not land, pull.
        if p.push_target and self.landing is not None and reslice is not None and not reslice.one_source:
            return self._load_fragments(spec, p, reslice, targets, deadline, fault)
        if p.push_target and self.landing is not None:
            try:
                # at most half the time left: a pull from the producer must still fit after it
                return self._load_landed(p, spec.first_block, targets,
                                         time.monotonic() + (deadline - time.monotonic()) / 2, fault)
            except TransferError as exc:
                self.landing.abandon(p.transfer_id, exc)
                # It did not land here (refused, producer lost, never came): the producer still
                # holds its staged copy unless the push broke on the wire; its answer decides.
                logger.warning("pushed KV for request %s did not land (%s); pulling it from the producer",
                               spec.req_id, exc)
                self._record("record_push_fallback", exc.cause.value)
        if reslice is not None:
            return self._pull_resliced(spec, p, reslice, targets, deadline, fault)
        layers = range(layout.num_layers)
        if self._nixl_device is not None and fault is None:  # a test-hook fault needs host rows to corrupt
            return self._pull_to_device(spec, p, layers, targets, deadline)
        # Host caches with whole-run blocks (vLLM's CPU backend): bytes land in the blocks
        # themselves. Device caches: in page-locked host rows, then one scatter per layer.
        dest = self.loader.direct_rows(layers, targets)
        staged = None if dest is not None else self.loader.landing_buffer(layout.num_layers * len(targets))
        if staged is not None:
            dest = BlockViews.of_rows(staged)
        path = self._pull_path(spec, p, direct=staged is None)
        # shm copies by address into any of them; a nixl READ only into the cache its agent registered
        by_address = isinstance(path, ShmPull) or (isinstance(path, NixlPull) and staged is None)
        dest_addrs = dest.addrs() if by_address else None
        with self._producer_client(p, layout.tp_rank) as client:
            nbytes = client.read(p.transfer_id, layers, spec.first_block, dest,
                                 fingerprint=p.fingerprint, deadline=deadline,
                                 verify=self.config.checksum and fault != "corrupt",
                                 path=path, dest_addrs=dest_addrs, token=p.token)
            if fault == "corrupt":  # test hook: silently, where the data path delivered the bytes
                tamper.corrupt(dest)
            if staged is not None:  # reported done only once the copy into the blocks is
                self._load_rows(staged, layers, targets, deadline)
            if path.streams:
                # The KV has landed and been verified: a slow or failed release must not fail the
                # load (the lease ends the entry anyway), so give it its own short deadline.
                try:
                    client.release(p.transfer_id, time.monotonic() + self.config.connect_timeout_s, token=p.token)
                except TransferError as exc:
                    client.close()  # its answer may still come: out of step, so not kept for another pull
                    logger.warning("release of %s failed after a good pull (it will expire): %s",
                                   p.transfer_id, exc)
        return {path.label: nbytes}

    def _pull_resliced(self, spec: RecvSpec, p: TransferParams, rs: Reslice, targets: list[int],
                       deadline: float, fault: str | None) -> dict[str, int]:
        """Another TP size: read every (layer, block) row of each producer rank the plan names, all
        ranks at once, copy each one's head runs into this rank's rows as it arrives, and load them
        only when every rank's slices are in: the first rank to fail fails the load, named, and
        nothing partial reaches the cache. Over tcp a rank of which this one keeps only some heads
        sends just those (TCP_HEADS_PULL); over shm whole rows are copied out of its arena. No
        release here: a producer rank may serve several consumer ranks, so the scheduler's lease
        keeper releases every rank once all are done (shm reads answer "read, keep it"). nixl goes
        over tcp, counted (its READs need registered destinations)."""
        layers = range(self.layout.num_layers)
        path = self._pull_path(spec, p, rank=rs.ranks[0]) if self.config.transport == "shm" else TCP_PULL
        if self.config.transport == "nixl":
            self._record("record_path_fallback", self.config.transport, TCP_PULL.label)
        mine = self.loader.landing_buffer(len(layers) * len(targets))
        reads = {self._rank_reads.submit(self._read_rank, spec, p, rs, rank, len(targets), deadline, fault, path): rank
                 for rank in rs.ranks}
        nbytes = 0
        try:
            for done in as_completed(reads):
                theirs, row, first_head, got = done.result()
                nbytes += got
                for step in rs.steps_of(reads[done]):
                    copy_heads(theirs, row, step.producer_heads.shift(-first_head), mine, rs.consumer_row,
                               step.consumer_heads)
        except BaseException:
            for read in reads:  # the others run to their end (or the deadline) on their own
                read.cancel()
            self.loader.release_buffer(mine)
            raise
        self._load_rows(mine, layers, targets, deadline)
        return {path.label: nbytes}

    def _read_rank(self, spec: RecvSpec, p: TransferParams, rs: Reslice, rank: int, n: int, deadline: float,
                   fault: str | None, path: PullPath) -> tuple[np.ndarray, RowLayout, int, int]:
        """Producer rank `rank`'s rows of the transfer's `n` blocks (a rank-read thread): (rows,
        their layout, the rank's head the rows start at, bytes read). Over tcp only the heads this
        rank keeps when that is fewer than the producer rank holds; a producer that does not offer
        that (a previous version) refuses in step, and its whole rows are read instead."""
        steps = rs.steps_of(rank)
        lo, hi = min(s.producer_heads.start for s in steps), max(s.producer_heads.stop for s in steps)
        if isinstance(path, ShmPull):  # each producer rank's own arena, as its ticket names it
            path = self._pull_path(spec, p, rank=rank)
        sliced = path is TCP_PULL and hi - lo < rs.producer_row.heads
        try:
            with self._producer_client(p, rank) as client:
                if sliced:
                    try:
                        row = rs.producer_row.with_heads(hi - lo)
                        return self._read_rows(client, spec, p, n, row, deadline, fault, TCP_HEADS_PULL, (lo, hi))
                    except TransferError as exc:
                        if not (exc.refused and exc.cause is FailureCause.PROTOCOL):
                            raise
                        logger.info("producer rank %d does not send head slices (%s); reading whole rows", rank, exc)
                return self._read_rows(client, spec, p, n, rs.producer_row, deadline, fault, path, None)
        except TransferError as exc:
            addr = f"{p.addrs[rank].host}:{p.addrs[rank].port}"
            raise TransferError(exc.cause, f"producer rank {rank} of {rs.producer_tp} ({addr}): {exc.detail}",
                                refused=exc.refused) from None

    def _read_rows(self, client: StoreClient, spec: RecvSpec, p: TransferParams, n: int, row: RowLayout,
                   deadline: float, fault: str | None, path: PullPath,
                   heads: tuple[int, int] | None) -> tuple[np.ndarray, RowLayout, int, int]:
        layers = range(self.layout.num_layers)
        theirs = np.empty((len(layers) * n, row.row_bytes), np.uint8)
        nbytes = client.read(p.transfer_id, layers, spec.first_block, BlockViews.of_rows(theirs),
                             fingerprint=p.fingerprint, deadline=deadline,
                             verify=self.config.checksum and fault != "corrupt",
                             path=path, token=p.token, release=False, heads=heads)
        if fault == "corrupt":  # test hook: silently, where the data path delivered the bytes
            tamper.corrupt(theirs)
        return theirs, row, heads[0] if heads else 0, nbytes

    def _pull_to_device(self, spec: RecvSpec, p: TransferParams, layers: range, targets: list[int],
                        deadline: float) -> dict[str, int]:
        """GPU-direct nixl: READ the rows straight into the device blocks. client.read returns only
        after NIXL said DONE and the producer answered our Release, so the load is reported done
        after the READ. `verify` is passed as configured: the direct path exists only with
        checksum off (nixl_device.why_not_direct), and refuses a read it is asked to verify."""
        path = self._nixl_device
        assert path is not None
        rows = nixl_device.device_rows(self.geometry, layers, targets)
        with self._producer_client(p, self.layout.tp_rank) as client:
            nbytes = client.read(p.transfer_id, layers, spec.first_block, rows, fingerprint=p.fingerprint,
                                 deadline=deadline, verify=self.config.checksum, path=path, token=p.token)
        return {path.label: nbytes}

    def _load_rows(self, rows: np.ndarray, layers: range | list[int], targets: list[int], deadline: float) -> None:
        """Host rows -> the KV blocks through the loader; returns when the copy is done."""
        try:
            self.loader.load(rows, layers, targets).wait(max(0.0, deadline - time.monotonic()))
        except TimeoutError:  # the buffer stays out of the pool: the copy may still read it
            raise TransferError(FailureCause.TIMEOUT, "copying the KV into the cache blocks missed the "
                                "load deadline") from None
        self.loader.release_buffer(rows)

    def _pull_path(self, spec: RecvSpec, p: TransferParams, direct: bool = True, rank: int | None = None) -> PullPath:
        """The data path of a pull from producer `rank` (default: this rank's peer): the configured
        one, over shm bound to the arena the ticket names for that rank. A ticket that cannot use it
        (shm, but it names no arena for that rank; nixl into a device cache that is not registered
        as VRAM, see _open_nixl_device) goes over tcp, counted and logged: never silently."""
        transport = self.config.transport
        if transport == "nixl" and not direct:
            if not self._warned_nixl_device:  # normally said at start-up, with the reason
                self._warned_nixl_device = True
                logger.warning("transport nixl: the KV cache is in %s memory, not registered with NIXL; pulling "
                               "over tcp into page-locked host memory instead", self.geometry.device)
            self._record("record_path_fallback", "nixl", TCP_PULL.label)
            return TCP_PULL
        arena = kvparams.shm_arena(p, self.layout.tp_rank if rank is None else rank) if transport == "shm" else ""
        if transport == "shm" and not arena:
            logger.warning("request %s: transport shm configured, but the producer's ticket names no shm arena "
                           "for this rank (is the producer on transport shm and this host?); pulling over tcp",
                           spec.req_id)
            self._record("record_path_fallback", ShmPull.label, TCP_PULL.label)
            return TCP_PULL
        return self._nixl() if transport == "nixl" else ShmPull(arena) if transport == "shm" else TCP_PULL

    def _load_landed(self, p: TransferParams, first_block: int, targets: list[int], deadline: float,
                     fault: str | None = None) -> dict[str, int]:
        """Push mode: wait until the producer's push has landed in this worker's store (sealed:
        every layer of every block), then copy it into the KV cache blocks and release it.
        Returns the bytes that landed over each push data path."""
        assert self.landing is not None and self.store is not None
        tid = p.transfer_id
        self.landing.wait(tid, deadline, time.monotonic() + min(FIRST_CHUNK_GRACE_S, self.config.load_timeout_s / 2))
        n = len(targets)
        buf = self.loader.landing_buffer(self._landed_rows_per_read(n))  # page-locked: it goes host->device
        try:
            for group, rows in self._landed_groups(tid, first_block, n, buf, fault):
                try:
                    self.loader.load(rows, group, targets).wait(max(0.0, deadline - time.monotonic()))
                except TimeoutError:
                    raise TransferError(FailureCause.TIMEOUT, "copying the landed KV into the cache blocks "
                                        "missed the load deadline") from None
            self.loader.release_buffer(buf)
            return self.landing.landed_bytes(tid)
        except TransferError as exc:
            if exc.cause is not FailureCause.TIMEOUT:  # (after a timeout the copy may still read it)
                self.loader.release_buffer(buf)
            raise
        finally:
            self._free_landed([tid])

    def _load_fragments(self, spec: RecvSpec, p: TransferParams, rs: Reslice, targets: list[int], deadline: float,
                        fault: str | None) -> dict[str, int]:
        """Push mode, decode TP < prefill TP: each producer rank of the plan pushed the heads it
        serves here as a fragment (push_routes.py). Copy each sealed fragment's heads into this
        rank's rows; a fragment that did not land (refused, lost, never came) is pulled from its
        producer rank instead, which kept its copy (the others let theirs go once landed). The rows
        are loaded only once every rank's heads are in: nothing partial reaches the cache. After a
        failure the landed fragments stay for a retry (the others are remembered as failed, so a
        retry pulls them at once); _pull frees them after a final failure, as drop does."""
        assert self.landing is not None and self.store is not None
        n, layers = len(targets), self.layout.num_layers
        # at most half the time left for the pushes: a pull from the producer must still fit after them
        landed_by = time.monotonic() + (deadline - time.monotonic()) / 2
        first_chunk_by = time.monotonic() + min(FIRST_CHUNK_GRACE_S, self.config.load_timeout_s / 2)
        keys = [fragment_id(p.transfer_id, step.producer_rank) for step in rs.steps]
        mine = self.loader.landing_buffer(layers * n)
        moved: dict[str, int] = {}
        try:
            for step, key in zip(rs.steps, keys):
                try:
                    self._copy_fragment(key, step, rs, spec.first_block, n, mine, landed_by, first_chunk_by, fault)
                    got = self.landing.landed_bytes(key)
                except TransferError as exc:
                    self.landing.abandon(key, exc)  # what still comes is refused; a retry pulls it at once
                    logger.warning("pushed KV of request %s from producer rank %d did not land (%s); pulling it",
                                   spec.req_id, step.producer_rank, exc)
                    self._record("record_push_fallback", exc.cause.value)
                    got = self._pull_fragment(spec, p, rs, step, n, mine, deadline, fault)
                for label, nbytes in got.items():
                    moved[label] = moved.get(label, 0) + nbytes
        except BaseException:
            self.loader.release_buffer(mine)
            raise
        self._free_landed(keys)
        self._load_rows(mine, range(layers), targets, deadline)
        return moved

    def _copy_fragment(self, key: str, step: SliceStep, rs: Reslice, first_block: int, n: int, mine: np.ndarray,
                       deadline: float, first_chunk_by: float, fault: str | None) -> None:
        """Wait for head fragment `key` to be sealed here, copy its heads into `mine`."""
        assert self.landing is not None and self.store is not None
        self.landing.wait(key, deadline, first_chunk_by)
        landed = self.landing.heads_of(key)
        if landed != tuple(step.consumer_heads):  # another plan than ours (another version?): not these heads
            raise TransferError(FailureCause.LAYOUT_MISMATCH, f"fragment {key!r} holds heads {landed}, this rank's "
                                f"plan takes heads {tuple(step.consumer_heads)} from that producer rank")
        row = rs.consumer_row.with_heads(step.consumer_heads.count)
        theirs = np.empty((self._landed_rows_per_read(n), self.store.slot_bytes), np.uint8)
        for group, rows in self._landed_groups(key, first_block, n, theirs, fault):
            # a fragment row sits in the first bytes of its slot
            copy_heads(rows[:, :row.row_bytes], row, HeadRange(0, row.heads),
                       mine[group.start * n:group.stop * n], rs.consumer_row, step.consumer_heads)

    def _landed_rows_per_read(self, n: int) -> int:
        """Rows of an n-block landed entry read per read_into call: whole layers, LANDED_READ_BYTES at most."""
        assert self.store is not None
        return n * max(1, min(self.layout.num_layers, LANDED_READ_BYTES // (n * self.store.slot_bytes)))

    def _landed_groups(self, key: str, first_block: int, n: int, buf: np.ndarray,
                       fault: str | None) -> Iterator[tuple[range, np.ndarray]]:
        """The landed entry `key`'s rows, a group of layers at a time, read into `buf` (layer-major).
        read_into, not pinning: part of a landed entry may sit on NVMe, and DRAM may be too short to
        hold all of it at once. Several layers per call (this runs on the critical path, after the
        last push): per-call costs, not bytes, dominate small prompts."""
        assert self.store is not None
        layers, per_read = self.layout.num_layers, buf.shape[0] // n
        for first in range(0, layers, per_read):
            group = range(first, min(first + per_read, layers))
            rows = buf[:len(group) * n]
            try:
                self.store.read_into(key, list(group), first_block, rows)
            except OSError as exc:  # the landing copy's disk tier failed: pull instead
                raise TransferError(FailureCause.PROTOCOL, f"reading the landed copy {key!r} failed: {exc}") from None
            if fault == "corrupt_landed":  # test hook: the landed copy on its way into the blocks
                tamper.corrupt(rows)
            yield group, rows

    def _pull_fragment(self, spec: RecvSpec, p: TransferParams, rs: Reslice, step: SliceStep, n: int,
                       mine: np.ndarray, deadline: float, fault: str | None) -> dict[str, int]:
        """Producer rank `step.producer_rank`'s slice, pulled over tcp into `mine`."""
        if self.config.transport != "tcp":
            self._record("record_path_fallback", self.config.transport, TCP_PULL.label)
        theirs, row, first_head, got = self._read_rank(spec, p, rs, step.producer_rank, n, deadline, fault, TCP_PULL)
        copy_heads(theirs, row, step.producer_heads.shift(-first_head), mine, rs.consumer_row, step.consumer_heads)
        return {TCP_PULL.label: got}

    def _nixl(self) -> NixlPull:
        """The nixl pull path with this process's NIXL agent, created at the first nixl pull with
        every KV cache layer registered once (pull threads share it)."""
        with self._nixl_lock:
            if self._nixl_pull is None:
                sink = nixl_transport.NixlSink(tag=self.engine_id)
                try:
                    sink.register(self.loader.host_arrays())
                except BaseException:
                    sink.close()
                    raise
                self._nixl_pull = NixlPull(sink=sink)
            return self._nixl_pull

    def _finish(self, req_id: str, error: TransferError | None, bytes_by_path: dict[str, int] | None = None,
                seconds: float = 0.0) -> None:
        with self._lock:
            self.inflight_loads -= 1
            if error is None:
                self._done.add(req_id)
                self._record("record_transfer", bytes_by_path or {}, seconds)
            else:
                self._failed[req_id] = error
                self._record("record_failure", error.cause.value)
                self._record("record_error", req_id, error.cause.value, error.detail)
            self._results_ready.notify_all()
        if error is not None:
            logger.error("KV load for request %s failed: %s", req_id, error)

    def _record(self, what: str, *args: object) -> None:
        with self._lock:  # the forward thread and the pull threads both record
            for stats in (self.stats, self.totals):
                getattr(stats, what)(*args)

    def take_results(self, wait_s: float = 0.0) -> tuple[set[str], dict[str, TransferError]]:
        """Loads done now, and loads failed by the previous call: a failure's cause rides this
        step's stats to the API server, which must have it before the request's error output
        (client_errors.py); one engine step later, on failures only.

        `wait_s` (a step with nothing scheduled, only waiting on loads): wait that long at most for
        a load to finish. Without it the engine loops on empty steps; each one wakes every rank and
        its EngineCore (vLLM's shm queues spin with sched_yield for 1 s after a read), so a TP-2
        decode kept both cores of a 2-vCPU host busy and the producer's store server on one of them
        could not answer a read for seconds (tests/e2e/test_tp_servers.py)."""
        with self._lock:
            if wait_s > 0 and self.inflight_loads > 0 and not (self._done or self._failed or self._failed_ready):
                self._results_ready.wait(wait_s)
            done, failed = self._done, self._failed_ready
            self._done, self._failed_ready, self._failed = set(), self._failed, {}
        return done, failed

    def get_stats(self) -> TieredStats | None:
        store = self._store_report()
        with self._lock:
            if store is not None:
                self.stats.data["store"] = store
            return None if self.stats.is_empty() else self.stats.clone_and_reset()

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
        self._pool.shutdown(wait=True, cancel_futures=False)
        self._rank_reads.shutdown(wait=True, cancel_futures=True)
        self._producers.close()
        self._stager_thread.shutdown(wait=True)
        if self.pusher is not None:
            self.pusher.close()
            self.pusher = None
        for nixl_path in (self._nixl_pull, self._nixl_device):
            if nixl_path is not None:
                nixl_path.close()
        self._nixl_pull = self._nixl_device = None
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
