"""Scheduler side of TieredConnector (runs in vLLM's engine-core process).

Producer: for requests carrying `do_remote_decode`, tell the worker which blocks to stage each
step, and on finish hand the client a ticket (`kv_transfer_params`) while freeing the engine's
blocks at once: the staged copy, not the KV cache, serves the consumer.
Consumer: for requests carrying our ticket, ask vLLM to allocate blocks and load the prompt
asynchronously, keep the producer's lease alive while the request waits, and release it
explicitly if the request is aborted first.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvconnectors.errors import TransferError
from kvconnectors.logs import get_logger
from kvconnectors.tiered import params as kvparams
from kvconnectors.tiered.config import TieredConfig
from kvconnectors.tiered.lease_keeper import LeaseKeeper
from kvconnectors.tiered.metadata import (RecvSpec, SaveSpec, TieredConnectorMetadata,
                                          TieredHandshakeMetadata)
from kvconnectors.tiered.tp import fragment_id
from kvconnectors.transport import tamper
from kvconnectors.transport.auth import load_secret
from kvconnectors.transport.client import StoreClient
from kvconnectors.transport.peers import PeerPolicy
from kvconnectors.transport.protocol import parse_target

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = get_logger(__name__)


@dataclass
class _Producing:
    transfer_id: str
    prompt_len: int
    block_ids: list[int] = field(default_factory=list)
    staged_blocks: int = 0       # blocks already handed to the worker in earlier steps
    sealed: bool = False         # the step that completes the prompt has been scheduled
    push_target: str = ""        # push mode: the consumer's landing store (rank 0), "host:port"
    token: str = field(default_factory=kvparams.new_token)  # the transfer's capability, in its ticket


class TieredConnectorScheduler:
    def __init__(self, vllm_config: Any, config: TieredConfig, engine_id: str):
        self.config, self.engine_id = config, engine_id
        self.block_size = vllm_config.cache_config.block_size
        self._engine_policy = getattr(vllm_config.kv_transfer_config, "kv_load_failure_policy", "fail")
        self._addrs: list[kvparams.PeerAddress] = []
        self._fingerprint = ""
        self._kv_heads = 0
        self._shm_paths: list[str] = []  # each rank's shm arena (transport shm), named in every ticket
        self._producing: dict[str, _Producing] = {}
        self._recvs: list[RecvSpec] = []
        self._drops: list[str] = []
        # req -> (producer ranks, tid, token)
        self._waiting_remote: dict[str, tuple[list[tuple[str, int]], str, str]] = {}
        self._warned_push = False
        self._pushed: set[str] = set()  # consumer requests whose KV is pushed into our landing store
        self._tp_size = int(getattr(getattr(vllm_config, "parallel_config", None), "tensor_parallel_size", 1) or 1)
        # consumer requests from a producer of another TP size: a producer rank may serve several of
        # our ranks, so no worker releases it; the lease keeper releases every rank once vLLM reports
        # the load finished (or failed) on all of ours
        self._resliced: dict[str, tuple[list[tuple[str, int]], str, str]] = {}
        self._locator: StoreClient | None = None  # to our own landing store, for hit sources
        self._secret = load_secret(config.secret_file)
        self._compat = config.compat
        self._peers = PeerPolicy.from_setting(config.allowed_peers, (config.bind_host, config.advertise_host))
        self._keeper: LeaseKeeper | None = None
        if vllm_config.kv_transfer_config.is_kv_consumer:
            self._keeper = LeaseKeeper(config.heartbeat_interval_s, self._client, config.connect_timeout_s)

    def _client(self, addr: tuple[str, int]) -> StoreClient:
        """A store client to a ticket's producer (lease renewals and releases) or to this instance's
        own landing store; the address must be in allowed_peers (it came from an HTTP client)."""
        host = self._peers.check(addr[0], addr[1], "kv_transfer_params.kvc.addrs")
        return StoreClient(host, addr[1], compat=self._compat, secret=self._secret,
                           connect_timeout_s=self.config.connect_timeout_s, protection=self.config.wire_protection)

    # ------------------------------------------------------------------ start-up
    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        ranks = sorted(metadata)
        metas = [metadata[r] for r in ranks]
        if not metas or not all(isinstance(m, TieredHandshakeMetadata) for m in metas):
            return
        self._addrs = [kvparams.PeerAddress(self.config.advertise_host or m.host, m.port) for m in metas]
        self._fingerprint = metas[0].fingerprint
        self._kv_heads = metas[0].kv_heads
        self._shm_paths = [m.shm_path for m in metas] if any(m.shm_path for m in metas) else []
        logger.info("TieredConnector store server(s) at %s (layout %s)",
                    ", ".join(f"{a.host}:{a.port}" for a in self._addrs), self._fingerprint)

    # ------------------------------------------------------------------ consumer
    def on_new_request(self, request: "Request") -> None:
        p = request.kv_transfer_params
        if self._keeper is None or not (kvparams.is_ours(p) and p.get("do_remote_prefill")):
            return
        try:
            tp = kvparams.parse(p, None, self.block_size)
        except TransferError:
            return  # reported when the load is attempted
        addrs = [(a.host, a.port) for a in tp.addrs]  # every tensor-parallel rank holds a shard
        self._waiting_remote[request.request_id] = (addrs, tp.transfer_id, tp.token)
        if tp.v >= 4 and tp.tp_size != self._tp_size:
            # another TP size: each rank reads its heads from some producer ranks (or they were pushed
            # here, tiered/tp.py `push_routes`); every producer rank is released once the load is over
            self._resliced[request.request_id] = (addrs, tp.transfer_id, tp.token)
        if tp.push_target and self.config.transfer_mode == "push":
            # Pushed here: the copy that matters is in our own landing stores, under their own lease,
            # which must outlive the request's time in our queue. The producer's staged copy is
            # renewed too: it is what a refused or broken push falls back to. Either may be absent
            # without anything being lost (a bulk push may still be on its way; after a push that
            # landed the producer has let its copy go), so neither counts as a lost lease.
            self._pushed.add(request.request_id)
            own = [(a.host, a.port) for a in self._addrs]
            # decode TP < prefill TP: each producer rank's head fragment lands under its own id
            fragments = ([fragment_id(tp.transfer_id, r) for r in range(tp.tp_size)]
                         if tp.v >= 4 and tp.tp_size > self._tp_size else [])
            self._keeper.track(request.request_id, [], tp.transfer_id, maybe_addrs=own + addrs, token=tp.token,
                               maybe_ids=fragments)
            return
        self._keeper.track(request.request_id, addrs, tp.transfer_id, token=tp.token)

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        p = request.kv_transfer_params
        if not (p and p.get("do_remote_prefill") and kvparams.KEY in p):
            return 0, False
        # The whole prompt comes from the producer (vLLM recomputes the last token itself),
        # asynchronously: the request waits in WAITING_FOR_REMOTE_KVS while the worker pulls.
        count = len(request.prompt_token_ids or ()) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        p = request.kv_transfer_params
        if not p:
            return
        if p.get("do_remote_decode"):
            if request.request_id not in self._producing:
                self._producing[request.request_id] = _Producing(
                    transfer_id=self._transfer_id(request.request_id, p),
                    prompt_len=len(request.prompt_token_ids or ()), push_target=self._push_target(p))
            return
        if not (p.get("do_remote_prefill") and kvparams.KEY in p) or num_external_tokens <= 0:
            return
        p["do_remote_prefill"] = False  # one load per request, also after a preemption
        # Keep renewing until the request finishes: the pull may wait for a free pull thread.
        self._waiting_remote.pop(request.request_id, None)
        prompt = list(request.prompt_token_ids or ())
        local_tokens = len(prompt) - num_external_tokens
        first_block = local_tokens // self.block_size
        block_ids = list(blocks.get_block_ids()[0][first_block:])
        spec = RecvSpec(req_id=request.request_id, params=None, block_ids=block_ids, first_block=first_block)
        try:
            spec.params = kvparams.msgspec.to_builtins(kvparams.parse(p, prompt, self.block_size))
            spec.retries = kvparams.retries_for(p, self.config.failure_policy, self.config.retries,
                                                self._engine_policy)
        except TransferError as exc:
            spec.error_cause, spec.error_message = exc.cause, exc.detail
        self._recvs.append(spec)

    def _transfer_id(self, req_id: str, p: dict) -> str:
        """The staged transfer's id; marked for a test corruption hook when the request asks for
        one (kv_transfer_params kvc_fault) and this instance runs with test_hooks (tamper.py)."""
        tid = f"{self.engine_id}:{req_id}"
        kind = p.get(tamper.PARAM)
        if kind is None:
            return tid
        if not self.config.test_hooks:
            logger.warning("kv_transfer_params.%s=%r ignored: this instance runs without test_hooks",
                           tamper.PARAM, kind)
            return tid
        try:
            return tamper.mark(tid, kind)
        except ValueError as exc:
            logger.error("kv_transfer_params: %s; request %s is staged unmarked", exc, req_id)
            return tid

    def _push_target(self, p: dict) -> str:
        """The landing store to push to, or "" for pull. A request that asks for push without a
        usable target is served in pull mode (its ticket still works) and the reason is logged."""
        mode = p.get("transfer_mode", self.config.transfer_mode)
        if mode == "pull":
            return ""
        target = p.get("push_target")
        try:
            if mode != "push":
                raise ValueError(f"transfer_mode={mode!r}: must be pull or push")
            host, _ = parse_target(target)
            if _is_ip(host) and not self._peers.allows_ip(host):  # names: the worker resolves and checks
                raise ValueError(f"push_target={target!r} is not in allowed_peers (TieredConnector setting)")
        except ValueError as exc:
            if not self._warned_push:
                self._warned_push = True
                logger.warning("kv_transfer_params: %s; staging for pull instead (the proxy passes push_target "
                               "when it runs with --mode push)", exc)
            return ""
        return target

    # ------------------------------------------------------------------ every step
    def build_connector_meta(self, so: "SchedulerOutput") -> TieredConnectorMetadata:
        meta = TieredConnectorMetadata(recvs=self._recvs, drops=self._drops,
                                       idle_step=getattr(so, "total_num_scheduled_tokens", 1) == 0)
        self._recvs, self._drops = [], []
        if not self._producing:
            return meta
        for req in so.scheduled_new_reqs:
            st = self._producing.get(req.req_id)
            if st is not None:
                st.block_ids = list(req.block_ids[0])
                self._add_save(meta, req.req_id, st, req.num_computed_tokens, so.num_scheduled_tokens[req.req_id])
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self._producing.get(req_id)
            if st is None or st.sealed:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                # Preempted and resumed: its blocks were replaced; stage everything again.
                meta.drops.append(st.transfer_id)
                st.transfer_id = f"{st.transfer_id}/r"
                st.block_ids, st.staged_blocks = list(new_ids[0]) if new_ids else [], 0
            elif new_ids is not None:
                st.block_ids.extend(new_ids[0])
            self._add_save(meta, req_id, st, cached.num_computed_tokens[i], so.num_scheduled_tokens[req_id])
        return meta

    def _add_save(self, meta: TieredConnectorMetadata, req_id: str, st: _Producing, num_computed: int,
                  num_scheduled: int) -> None:
        end_tokens = min(num_computed + num_scheduled, st.prompt_len)
        final = end_tokens >= st.prompt_len
        # Stage only whole blocks until the prompt's last step (then its partial tail too): every
        # block is written exactly once, so a layer group already on its way (push) never races
        # a rewrite of the same slots, and no block is copied twice.
        end_block = -(-end_tokens // self.block_size) if final else end_tokens // self.block_size
        first_block = st.staged_blocks
        total = -(-st.prompt_len // self.block_size)
        meta.saves.append(SaveSpec(req_id=req_id, transfer_id=st.transfer_id,
                                   block_ids=st.block_ids[first_block:end_block], first_block=first_block,
                                   total_blocks=total, seal=final,
                                   push_target=st.push_target,
                                   layerwise=st.prompt_len >= self.config.layerwise_min_tokens, token=st.token))
        st.staged_blocks = end_block
        st.sealed = final

    def hit_sources(self, request: "Request", num_tokens: int) -> dict[Any, int]:
        """vLLM's prompt_tokens_cached_by_source: pulled KV comes from a peer (p2p); pushed KV
        is read from this instance's own landing store, split by the tier holding it (host
        memory or disk). Asking costs one loopback round trip per pushed request."""
        from vllm.v1.metrics.cache_hit_source import CacheHitSource

        if request.request_id not in self._pushed or not self._addrs:
            return {CacheHitSource.P2P: num_tokens}
        ticket = request.kv_transfer_params[kvparams.KEY]
        tid, token = ticket["transfer_id"], ticket.get("token", "")
        try:
            if self._locator is None:
                self._locator = self._client((self._addrs[0].host, self._addrs[0].port))
            where = self._locator.locate(tid, time.monotonic() + self.config.connect_timeout_s, token=token)
        except (TransferError, OSError) as exc:  # metrics only: never fail the scheduler step
            logger.debug("could not locate %s in the landing store: %s", tid, exc)
            if self._locator is not None:
                self._locator.close()
                self._locator = None
            return {CacheHitSource.HOST: num_tokens}
        slots = where.dram_slots + where.nvme_slots
        disk = round(num_tokens * where.nvme_slots / slots) if where.found and slots else 0
        return {k: v for k, v in ((CacheHitSource.HOST, num_tokens - disk), (CacheHitSource.DISK, disk)) if v}

    def update_connector_output(self, output: Any) -> None:
        """Loads that finished (or failed) need no more heartbeats."""
        if self._keeper is not None:
            for req_id in getattr(output, "finished_recving", None) or ():
                resliced = self._resliced.pop(req_id, None)
                if resliced is not None:
                    self._keeper.release(req_id, *resliced)
                else:
                    self._keeper.untrack(req_id)

    # ------------------------------------------------------------------ finish
    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict | None]:
        from vllm.v1.request import RequestStatus

        req_id = request.request_id
        st = self._producing.pop(req_id, None)
        if st is not None:
            ok = st.sealed and request.status in (RequestStatus.FINISHED_LENGTH_CAPPED,
                                                  RequestStatus.FINISHED_STOPPED)
            if not ok or not self._addrs:
                self._drops.append(st.transfer_id)  # aborted mid-prefill: give the staging back now
                return False, None
            prompt = list(request.prompt_token_ids or ())
            ticket = kvparams.TransferParams(
                v=kvparams.PARAMS_VERSION, transfer_id=st.transfer_id, addrs=self._addrs,
                num_tokens=len(prompt), num_blocks=-(-len(prompt) // self.block_size), block_size=self.block_size,
                fingerprint=self._fingerprint, prompt_hash=kvparams.prompt_hash(prompt),
                lease_ttl_s=self.config.lease_ttl_s,  # renewed when the entry was sealed, just now
                issued_at=time.time(), transport=self.config.transport,
                shm_path=self._shm_paths[0] if self._shm_paths else "", shm_paths=self._shm_paths,
                push_target=st.push_target, token=st.token, tp_size=len(self._addrs), kv_heads=self._kv_heads)
            # False: the engine's blocks are free now; the staged copy serves the consumer.
            return False, kvparams.producer_params(ticket, self.engine_id)
        waiting = self._waiting_remote.pop(req_id, None)
        if waiting is not None:  # aborted before its load: `waiting` releases every rank below
            self._resliced.pop(req_id, None)
        # A resliced load still under way keeps its entry: its ranks are released when the worker
        # reports the load over (update_connector_output), also for a request aborted meanwhile.
        if req_id in self._pushed:
            self._pushed.discard(req_id)
            if self._keeper is not None:
                self._keeper.untrack(req_id)
            if waiting is not None:  # aborted before its load: free the landed copy now
                self._drops.append(waiting[1])
            return False, None
        if self._keeper is not None:
            if waiting is not None:
                # Aborted before its KV was pulled: tell the producer now instead of at expiry.
                self._keeper.release(req_id, *waiting)
            else:
                self._keeper.untrack(req_id)
        return False, None

    def shutdown(self) -> None:
        if self._locator is not None:
            self._locator.close()
        if self._keeper is not None:
            self._keeper.close()


def _is_ip(host: str) -> bool:
    import ipaddress

    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False
