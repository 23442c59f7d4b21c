"""Consumer side: one request's load, from its ticket to its KV cache blocks.

Off the forward thread (a pool of max_concurrent_loads pull threads), under the load deadline:
push mode first waits for the pushed copy to land here (landed.py); another TP size reads the
producer ranks the plan names (resliced.py); otherwise the producer's rows go straight into the
blocks (host caches), through page-locked host rows (device caches), or by GPU-direct READs (nixl
into a cache registered as VRAM). Transient faults are tried again within the one deadline under
failure_policy "retry"; every outcome, done or failed with its cause, goes to the results
(results.py) for vLLM's kv_load_failure_policy, and after a final failure the producer's entry is
released now rather than at its lease's end.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import msgspec

from kvconnectors.errors import FailureCause, TransferError
from kvconnectors.logs import get_logger
from kvconnectors.mover import BlockGeometry, Loader
from kvconnectors.mover.block_views import BlockViews
from kvconnectors.mover.reslice import RowLayout
from kvconnectors.mover.geometry import UnsupportedKVCache
from kvconnectors.tiered.config import TieredConfig
from kvconnectors.tiered.landed import LandedReader
from kvconnectors.tiered.layout import KVLayout
from kvconnectors.tiered.links import PeerLinks
from kvconnectors.tiered.load import Load
from kvconnectors.tiered.metadata import RecvSpec
from kvconnectors.tiered.params import TransferParams
from kvconnectors.tiered.pull_paths import PullPaths
from kvconnectors.tiered.resliced import ReslicedReads
from kvconnectors.tiered.results import LoadResults
from kvconnectors.tiered.tp import plan_for
from kvconnectors.transport import nixl_device, tamper
from kvconnectors.transport.paths import NixlPull, ShmPull

logger = get_logger(__name__)


class Puller:
    def __init__(self, layout: KVLayout, geometry: BlockGeometry, row_layout: RowLayout | UnsupportedKVCache,
                 config: TieredConfig, links: PeerLinks, paths: PullPaths, loader: Loader, results: LoadResults,
                 resliced: ReslicedReads, landed: LandedReader | None):
        self.layout, self.geometry, self.row_layout, self.config = layout, geometry, row_layout, config
        self._links, self.paths, self.loader, self.results = links, paths, loader, results
        self._resliced, self._landed = resliced, landed
        self._pool = ThreadPoolExecutor(max_workers=config.max_concurrent_loads, thread_name_prefix="kvc-pull")

    def submit(self, spec: RecvSpec) -> None:
        self.results.started()
        self._pool.submit(self._pull, spec)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=False)

    # ------------------------------------------------------------------ a pull thread
    def _pull(self, spec: RecvSpec) -> None:
        start = time.monotonic()
        deadline = start + self.config.load_timeout_s
        try:
            by_path = self._with_retries(spec, deadline)
        except TransferError as exc:
            self.results.finish(spec.req_id, exc)  # report first: the release below may wait on a dead peer
            self._free_fragments(spec)  # head fragments kept for a retry
            self._give_back(spec, exc)
        except Exception as exc:  # a bug must fail the request, not strand it
            logger.exception("unexpected error pulling KV for %s", spec.req_id)
            self.results.finish(spec.req_id, TransferError(FailureCause.PROTOCOL, f"internal error: {exc!r}"))
            self._free_fragments(spec)
        else:
            self.results.finish(spec.req_id, None, by_path, time.monotonic() - start)

    def _free_fragments(self, spec: RecvSpec) -> None:
        tid = spec.params.get("transfer_id") if isinstance(spec.params, dict) else None
        if self._landed is not None and isinstance(tid, str):
            self._landed.free_fragments(tid)

    def _give_back(self, spec: RecvSpec, exc: TransferError) -> None:
        """After a final failure, release the producer's entry now (best effort) instead of
        leaving it to the lease: this request will never read it (vLLM fails or recomputes)."""
        if spec.params is None or exc.cause.nothing_to_release:
            return
        try:
            p = msgspec.convert(spec.params, TransferParams)
            if p.v >= 4 and p.tp_size != self.layout.tp_size:
                return  # resliced: the scheduler's lease keeper releases every producer rank
            with self._links.producer(p, min(self.layout.tp_rank, len(p.addrs) - 1)) as client:
                client.release(p.transfer_id, time.monotonic() + self.config.connect_timeout_s, token=p.token)
        except (TransferError, OSError, msgspec.ValidationError) as release_exc:
            logger.warning("could not release transfer for %s after its failure (it will expire): %s",
                           spec.req_id, release_exc)

    def _with_retries(self, spec: RecvSpec, deadline: float) -> dict[str, int]:
        """failure_policy "retry": transient faults (peer gone, timeout, bad bytes, protocol) are
        tried again with exponential back-off inside the one load deadline; the producer keeps
        its entry until a pull succeeds, so a retry reads the same bytes."""
        backoff = self.config.retry_backoff_s
        for attempt in range(spec.retries + 1):
            # Each attempt gets an even share of the time left, so a silent peer cannot eat it all.
            attempt_deadline = time.monotonic() + (deadline - time.monotonic()) / (spec.retries + 1 - attempt)
            try:
                return self._into_cache(spec, attempt_deadline)
            except TransferError as exc:
                left = deadline - time.monotonic()
                if attempt == spec.retries or not exc.cause.transient or left <= backoff:
                    raise
                logger.warning("KV load for %s failed (%s), retry %d/%d in %.2fs", spec.req_id, exc,
                               attempt + 1, spec.retries, backoff)
                self.results.record("record_retry", exc.cause.value)
                time.sleep(backoff)
                backoff *= 2
        raise AssertionError("unreachable")

    def _into_cache(self, spec: RecvSpec, deadline: float) -> dict[str, int]:
        """Load one request's KV into its blocks; returns the bytes each data path carried."""
        if spec.error_cause is not None:
            raise TransferError(spec.error_cause, spec.error_message)
        p = msgspec.convert(spec.params, TransferParams)
        reslice = plan_for(p, self.layout, self.row_layout)  # checked before any byte lands in the KV cache
        num_blocks = p.num_blocks - spec.first_block
        if num_blocks <= 0:
            return {}
        if len(spec.block_ids) < num_blocks:
            raise TransferError(FailureCause.LAYOUT_MISMATCH,
                                f"{len(spec.block_ids)} local blocks allocated for {num_blocks} remote blocks")
        load = Load(spec, p, spec.block_ids[:num_blocks], tamper.kind_of(p.transfer_id, self.config.test_hooks))
        # Pushed here: this rank's rows (at another TP size when one producer rank holds all its
        # heads), or head fragments from several producer ranks (tp.py `push_routes`, pulled one by one
        # where missing); when they did not land, pull.
        if p.push_target and self._landed is not None and reslice is not None and not reslice.one_source:
            return self._landed.load_fragments(load, reslice, deadline)
        if p.push_target and self._landed is not None:
            try:
                # at most half the time left: a pull from the producer must still fit after it
                return self._landed.load(load, time.monotonic() + (deadline - time.monotonic()) / 2)
            except TransferError as exc:
                self._landed.abandon(p.transfer_id, exc)
                # It did not land here (refused, producer lost, never came): the producer still
                # holds its staged copy unless the push broke on the wire; its answer decides.
                logger.warning("pushed KV for request %s did not land (%s); pulling it from the producer",
                               spec.req_id, exc)
                self.results.record("record_push_fallback", exc.cause.value)
        if reslice is not None:
            return self._resliced.pull(load, reslice, deadline)
        if self.paths.device is not None and load.fault is None:  # a test-hook fault needs host rows to corrupt
            return self._to_device(load, deadline)
        return self._from_producer(load, deadline)

    def _from_producer(self, load: Load, deadline: float) -> dict[str, int]:
        """Host caches with whole-run blocks (vLLM's CPU backend): bytes land in the blocks
        themselves. Device caches: in page-locked host rows, then one scatter per layer."""
        p, layers = load.p, range(self.layout.num_layers)
        dest = self.loader.direct_rows(layers, load.targets)
        staged = None if dest is not None else self.loader.landing_buffer(self.layout.num_layers * load.n)
        if staged is not None:
            dest = BlockViews.of_rows(staged)
        path = self.paths.for_ticket(load.spec, p, direct=staged is None)
        # shm copies by address into any of them; a nixl READ only into the cache its agent registered
        by_address = isinstance(path, ShmPull) or (isinstance(path, NixlPull) and staged is None)
        dest_addrs = dest.addrs() if by_address else None
        with self._links.producer(p, self.layout.tp_rank) as client:
            nbytes = client.read(p.transfer_id, layers, load.spec.first_block, dest,
                                 fingerprint=p.fingerprint, deadline=deadline,
                                 verify=self.config.checksum and load.fault != "corrupt",
                                 path=path, dest_addrs=dest_addrs, token=p.token)
            if load.fault == "corrupt":  # test hook: silently, where the data path delivered the bytes
                tamper.corrupt(dest)
            if staged is not None:  # reported done only once the copy into the blocks is
                self.loader.load_and_release(staged, layers, load.targets, deadline)
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

    def _to_device(self, load: Load, deadline: float) -> dict[str, int]:
        """GPU-direct nixl: READ the rows straight into the device blocks. client.read returns only
        after NIXL said DONE and the producer answered our Release, so the load is reported done
        after the READ. `verify` is passed as configured: the direct path exists only with
        checksum off (nixl_device.why_not_direct), and refuses a read it is asked to verify."""
        path = self.paths.device
        assert path is not None
        layers = range(self.layout.num_layers)
        rows = nixl_device.device_rows(self.geometry, layers, load.targets)
        with self._links.producer(load.p, self.layout.tp_rank) as client:
            nbytes = client.read(load.p.transfer_id, layers, load.spec.first_block, rows,
                                 fingerprint=load.p.fingerprint, deadline=deadline, verify=self.config.checksum,
                                 path=path, token=load.p.token)
        return {path.label: nbytes}
