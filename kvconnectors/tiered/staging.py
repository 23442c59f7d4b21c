"""Producer side: the staging book of the transfers this rank is staging.

After each attention layer the forward thread hands the request's newly computed blocks of that
layer to the staging thread (`save_layer`), which copies them into the host store while the next
layers compute and notes their checksums; `wait_for_save` waits for those copies (vLLM may then
reuse the blocks) and seals the entries whose prompt is complete. The store server serves sealed
entries to consumers; in push mode the push book (pushes.py) streams them out as they are staged.
A transfer whose staging failed is remembered with its cause (`StagingFailures`), which the store
server answers its consumers with.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from kvconnectors.errors import FailureCause, StoreFullError, TransferError
from kvconnectors.logs import get_logger
from kvconnectors.mover import CopyEvent, DeviceOps, Stager
from kvconnectors.mover.geometry import UnsupportedKVCache
from kvconnectors.mover.reslice import RowLayout
from kvconnectors.store import StoreClosedError, TieredStore
from kvconnectors.tiered.config import TieredConfig
from kvconnectors.tiered.layout import KVLayout
from kvconnectors.tiered.links import PeerLinks
from kvconnectors.tiered.metadata import SaveSpec, TieredConnectorMetadata
from kvconnectors.tiered.pushes import PushBook
from kvconnectors.transport.paths import PushPath
from kvconnectors.transport.server import StoreServer

logger = get_logger(__name__)
MAX_FAILURE_MEMORY = 10_000


class StagingFailures:
    """Why staging failed, per transfer (the most recent MAX_FAILURE_MEMORY): the staging book
    writes it, the store server reads it to answer consumers of a transfer that will never seal."""

    def __init__(self) -> None:
        self._by_id: dict[str, TransferError] = {}

    def add(self, tid: str, exc: TransferError) -> None:
        if len(self._by_id) >= MAX_FAILURE_MEMORY:
            self._by_id.pop(next(iter(self._by_id)))
        self._by_id[tid] = exc

    def get(self, tid: str) -> TransferError | None:
        return self._by_id.get(tid)

    def __contains__(self, tid: str) -> bool:
        return tid in self._by_id


class StagingBook:
    def __init__(self, store: TieredStore, stager: Stager, ops: DeviceOps, layout: KVLayout, config: TieredConfig,
                 server: StoreServer, failures: StagingFailures, record: Callable[..., None],
                 links: PeerLinks, push_path: PushPath, row_layout: RowLayout | UnsupportedKVCache,
                 link_bytes_per_s: float | None = None):
        """`link_bytes_per_s`: benchmarks only, pushes emulate a link this slow (pushes.py)."""
        self.store, self.stager, self.ops, self.layout, self.config = store, stager, ops, layout, config
        self.server, self.failures, self._record = server, failures, record
        self._checksums: dict[str, np.ndarray] = {}  # transfer -> layer x block checksums, until sealed
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvc-stage")
        self._copies: list[Future] = []  # this step's copy futures
        self._layers_this_step: dict[str, set[int]] = {}  # transfer -> layers staged in this step
        self._lock = threading.RLock()  # the staging thread, the forward thread and the push sender's
        self.pushes = PushBook(store, layout, row_layout, config, links, push_path, record, on_lost=self.fail,
                               link_bytes_per_s=link_bytes_per_s)

    # ------------------------------------------------------------------ forward thread
    def save_layer(self, meta: TieredConnectorMetadata, layer: int) -> None:
        """Hand `layer`'s new blocks to the staging thread and return (later layers never touch
        this layer's blocks, so they may be copied meanwhile)."""
        after = self.ops.forward_event()  # the copy stream waits for this point of the forward stream
        self._copies.append(self._thread.submit(self._stage_layers, [layer], meta.saves, after))

    def wait_for_save(self, meta: TieredConnectorMetadata) -> None:
        if meta.saves:
            # Layers whose per-layer hook did not run (a replayed full CUDA graph skips them) are
            # staged now, after the forward, in one call per transfer (one all-layer gather on a
            # cross-layer layout); on a CPU engine every hook runs and this finds nothing to do.
            self._copies.append(self._thread.submit(
                self._stage_layers, list(range(self.layout.num_layers)), meta.saves, self.ops.forward_event(), True))
        copies, self._copies = self._copies, []
        for fut in copies:  # after this, every staged byte is in the store: vLLM may reuse the blocks
            fut.result()
        with self._lock:
            self._seal_step(meta)
            self._layers_this_step.clear()

    def drop(self, tid: str) -> None:
        """The request was aborted here: its staging and pushes end, its consumers are told, its
        staged copy goes."""
        with self._lock:  # after the staging thread's current batch, as its pushes are ended
            self._checksums.pop(tid, None)
            self.pushes.abort(tid, TransferError(FailureCause.UNKNOWN_TRANSFER,
                                                 "the request was aborted on the prefill instance"))
        try:
            self.store.release(tid)
        except (TransferError, StoreClosedError):
            pass

    def fail(self, tid: str, exc: TransferError) -> None:
        """Staging of `tid` failed (or its push broke on the wire): remember why, tell its
        consumers, give its slots back."""
        with self._lock:
            logger.error("staging of transfer %s failed: %s", tid, exc)
            self._record("record_staging_failure", exc.cause.value)
            self._checksums.pop(tid, None)
            self.failures.add(tid, exc)
            self.pushes.abort(tid, exc)
            if not isinstance(exc, StoreFullError):
                try:
                    self.store.release(tid)
                except (TransferError, StoreClosedError):  # (a push ending after shutdown)
                    pass
            self.server.notify_sealed()  # wake readers waiting for this transfer

    def close(self) -> None:
        self._thread.shutdown(wait=True)
        self.pushes.close()

    # ------------------------------------------------------------------ staging thread
    def _stage_layers(self, layers: list[int], saves: list[SaveSpec], after: CopyEvent | None,
                      missing_only: bool = False) -> None:
        with self._lock:  # the push sender may fail a transfer meanwhile
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
                    self.fail(spec.transfer_id, TransferError(FailureCause.PROTOCOL, f"internal error: {exc!r}"))

    def _stage_spec(self, layers: list[int], spec: SaveSpec, after: CopyEvent | None) -> None:
        tid = spec.transfer_id
        if tid in self.failures or not spec.block_ids:
            return
        try:
            if tid not in self._checksums:
                self.server.grant(tid, spec.token)  # before the entry exists: it answers only to that token
                self.store.create(tid, self.layout.num_layers, spec.total_blocks)
                self._checksums[tid] = np.zeros((self.layout.num_layers, spec.total_blocks), np.uint64)
                if spec.push_target:
                    self.pushes.start(tid, spec.push_target)
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
            self.fail(tid, exc)
            return
        except (OSError, ValueError, TimeoutError) as exc:  # a disk error or a bad spec fails this transfer
            self.fail(tid, TransferError(FailureCause.PROTOCOL, f"staging error: {exc!r}"))
            return
        n = len(spec.block_ids)
        for i, layer in enumerate(layers):
            self._checksums[tid][layer, spec.first_block:spec.first_block + n] = sums[i]
        self._record("record_staged", copy.nbytes, n * len(layers))
        self.pushes.staged(spec, layers)
        staged = self._layers_this_step.setdefault(tid, set())
        staged.update(layers)
        if spec.seal and len(staged) == self.layout.num_layers:
            # The prompt's last layer is staged: seal it and send its last group (with the seal)
            # from here, not after the forward thread's wait_for_save: one hand-off less between
            # the last layer's compute and the decode instance having everything.
            if self._seal_transfer(spec):
                self.server.notify_sealed()
        else:
            self.pushes.send_full_group(spec, self._checksums[tid])

    # ------------------------------------------------------------------ sealing (lock held)
    def _seal_step(self, meta: TieredConnectorMetadata) -> None:
        sealed = False
        for spec in meta.saves:
            try:
                sealed |= self._finish_step(spec)
            except Exception as exc:  # a bug here must fail one transfer, never the engine's step
                logger.exception("finishing the staging step of %s failed", spec.transfer_id)
                self.fail(spec.transfer_id, TransferError(FailureCause.PROTOCOL, f"internal error: {exc!r}"))
        if sealed:
            self.server.notify_sealed()

    def _finish_step(self, spec: SaveSpec) -> bool:
        """After a step's copies: push its last group, and seal a completed prompt. True if sealed."""
        tid = spec.transfer_id
        if tid in self.failures:
            return False
        if not spec.seal:
            if tid in self._checksums:  # (dropped meanwhile: nothing more to push)
                self.pushes.send_group(spec, self._checksums[tid])  # this step's; the prompt goes on next step
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
            self.fail(tid, TransferError(FailureCause.PROTOCOL, f"seal failed: {exc}"))
            return False
        self.pushes.send_last(spec, sums)
        self._checksums.pop(tid, None)
        return True
