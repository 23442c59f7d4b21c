"""Sending side of push mode: one thread per producer worker streams staged layer groups to the
decode instance's landing store while the forward pass computes the later layers.

The forward thread never waits for the network: the stager hands each finished layer group over
as a `PushJob` and returns; jobs of one transfer go out in order on one connection per target
(each Push answered by an Ack), and a final job sends PushEnd. The bytes come from the producer's
own staged copy (pinned while they go out), so vLLM may reuse its KV blocks as soon as
`wait_for_save` has returned.

When a push fails, later jobs of that transfer to that target are skipped and
`on_done(transfer_id, target, error)` is called once, so the worker can decide what the staged copy
is still good for. A job that aborts a transfer (the producer gave up on it) only tells the landing
side; it reports nothing back.

Pools of different TP sizes (issue 20): a job with `heads` sends only those KV heads of each staged
row over tcp (mover.reslice.pack_checked_heads, the tcp head read's own: staged checksums verified,
heads packed, fresh checksums), under the receiving rank's rows fingerprint; the pusher sends one
job per consumer rank it serves (routes: tiered/tp.py).

One Push carries at most `max_push_bytes` (64 MiB): a larger layer group goes as several Pushes
of consecutive block ranges (the last one sealing, when the job does). The landing side lends
each Push a receive buffer from a pool with a fixed cap (landing.py), so bounded messages keep
large prompts pushable and many producers side by side within it.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kvconnectors.errors import FailureCause, StoreFullError, TransferError
from kvconnectors.logs import get_logger
from kvconnectors.mover.heads import HeadRange
from kvconnectors.mover.reslice import RowLayout, pack_checked_heads
from kvconnectors.store import TieredStore
from kvconnectors.transport import wire
from kvconnectors.transport.client import StoreClient
from kvconnectors.transport.paths import TCP_PUSH, PushPath
from kvconnectors.transport.protocol import MAX_PUSH_BYTES, Addr

logger = get_logger(__name__)


@dataclass
class PushJob:
    transfer_id: str
    target: Addr
    layers: list[int] = field(default_factory=list)
    first_block: int = 0
    num_blocks: int = 0
    checksums: list[int] | None = None
    end: bool = False                       # the transfer's last job: seal it (with these layers, if any)
    abort: TransferError | None = None      # send PushEnd(ok=False) with this cause instead
    heads: HeadRange | None = None          # only these (producer-local) KV heads of each row, packed
    fingerprint: str = ""                   # the receiving rank's rows fingerprint (default: the sender's)
    wire_id: str = ""                       # the id it lands under (default: transfer_id; a head fragment's own)
    fragment: HeadRange | None = None       # a head fragment: the receiving rank's heads these rows fill
    token: str = ""                         # the ticket's token: the landed copy answers only to it

    @property
    def landing_id(self) -> str:
        return self.wire_id or self.transfer_id


class PushSender:
    def __init__(self, store: TieredStore, *, fingerprint: str, num_layers: int,
                 client_factory: Callable[[str, int], StoreClient], timeout_s: float,
                 on_done: Callable[[str, Addr, TransferError | None], None], path: PushPath = TCP_PUSH,
                 link_bytes_per_s: float | None = None, max_push_bytes: int = MAX_PUSH_BYTES,
                 row_layout: RowLayout | None = None):
        """`path`: how the groups travel (tcp; NixlPush(source=...): the landing side READs them
        from our arena). `max_push_bytes`: a layer group larger than this goes as several Pushes.
        `row_layout`: how the staged rows hold their heads, for jobs that send some heads only."""
        if max_push_bytes < 1:
            raise ValueError(f"max_push_bytes must be >= 1, got {max_push_bytes}")
        self.store, self.fingerprint, self.num_layers = store, fingerprint, num_layers
        self.max_push_bytes = max_push_bytes
        self.row_layout = row_layout
        self._client_factory = client_factory
        self.timeout_s = timeout_s
        self._on_done = on_done
        self.path = path
        # Benchmarks only: emulate a slower link; a group's bytes arrive when the link would have
        # carried them (jobs queue behind each other, like on a real wire).
        self._link_rate = link_bytes_per_s
        self._link_free_at = 0.0
        self._queue: queue.Queue[PushJob | None] = queue.Queue()
        self._clients: dict[Addr, StoreClient] = {}
        self._failed: dict[tuple[str, Addr], TransferError] = {}  # (transfer, target) -> why
        self._pending = 0
        self._idle = threading.Condition()
        self.pushes = 0
        self.bytes_pushed = 0
        self._thread = threading.Thread(target=self._run, name="kvc-push", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ API (any thread)
    def submit(self, job: PushJob) -> None:
        with self._idle:
            self._pending += 1
        self._queue.put(job)

    def flush(self, timeout_s: float) -> bool:
        """Wait until every submitted job went out (or failed); False at the timeout."""
        deadline = time.monotonic() + timeout_s
        with self._idle:
            while self._pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    @property
    def pending(self) -> int:
        with self._idle:
            return self._pending

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)
        for client in self._clients.values():
            client.close()
        self._clients.clear()

    # ------------------------------------------------------------------ sender thread
    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                self._handle(job)
            except Exception:  # a bug must not kill the sender: fail this transfer, go on
                logger.exception("push job for %s failed unexpectedly", job.transfer_id)
                self._fail(job, TransferError(FailureCause.PROTOCOL, "internal error in the push sender"))
            finally:
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()

    def _handle(self, job: PushJob) -> None:
        tid = job.transfer_id
        failed = self._failed.get((tid, job.target))
        if failed is not None:
            if job.end or job.abort is not None:
                self._failed.pop((tid, job.target), None)  # its last job: forget it
            if job.abort is None or failed.refused:
                return  # the landing side already knows (it refused, or it is the one that failed)
        deadline = time.monotonic() + self.timeout_s
        try:
            try:
                client = self._client(job.target)
            except TransferError as exc:  # nothing was sent: the staged copy is intact for a pull
                raise exc.refusal() from None
            if job.abort is not None or (job.end and not job.layers):
                client.push_end(job.landing_id, deadline, job.abort)
                if job.abort is None:  # an abort is the producer's own decision: nothing to report back
                    self._on_done(tid, job.target, None)
                return
            if job.heads is not None:
                self._push_heads(client, job, deadline)
            else:
                self._push(client, job, deadline)
            if job.end:  # its Push carried seal=True
                self._on_done(tid, job.target, None)
        except TransferError as exc:
            self._fail(job, exc)

    def _parts(self, job: PushJob, total_blocks: int, row_bytes: int | None = None) -> list[dict]:
        """The job's Push headers: block ranges of at most max_push_bytes each (at least one block),
        each with its slice of the job's checksums (layer-major, like the job's); the last one
        seals when the job does. `row_bytes`: bytes per (layer, block) sent (default: a slot)."""
        per_block = len(job.layers) * (row_bytes or self.store.slot_bytes)
        step = max(1, self.max_push_bytes // per_block)
        end = job.first_block + job.num_blocks
        heads = []
        for start in range(job.first_block, end, step):
            n = min(step, end - start)
            off = start - job.first_block
            at = [i * job.num_blocks + off for i in range(len(job.layers))]  # each layer's part
            sums = None if job.checksums is None else [s for a in at for s in job.checksums[a:a + n]]
            heads.append(dict(transfer_id=job.landing_id, num_layers=self.num_layers, total_blocks=total_blocks,
                              fingerprint=job.fingerprint or self.fingerprint, layers=job.layers,
                              first_block=start, num_blocks=n, checksums=sums, seal=job.end and start + n == end,
                              heads=list(job.fragment) if job.fragment is not None else None, token=job.token))
        return heads

    def _push(self, client: StoreClient, job: PushJob, deadline: float) -> None:
        slot = self.store.slot_bytes
        heads = self._parts(job, self.store.info(job.transfer_id).num_blocks)
        try:
            with self.store.pinned_views(job.transfer_id, job.layers, unsealed=True) as pv:
                for head in heads:
                    first, n = head["first_block"], head["num_blocks"]
                    nbytes = len(job.layers) * n * slot
                    self._pace(nbytes)
                    self.path.send(client.push, head, pv, job.layers, first, first + n, nbytes, deadline)
        except StoreFullError:
            # Staged straight to NVMe (DRAM was short): not in the arena, so send it over tcp from
            # a bounce buffer read off the disk tier. (Raised by the pin, before anything was sent.)
            for head in heads:
                first, n = head["first_block"], head["num_blocks"]
                buf = np.empty((len(job.layers) * n, slot), dtype=np.uint8)
                for i, layer in enumerate(job.layers):
                    self.store.read_into(job.transfer_id, layer, first, buf[i * n:(i + 1) * n], unsealed=True)
                self._pace(buf.nbytes)
                client.push(wire.Push(**head, nbytes=buf.nbytes), [memoryview(buf.reshape(-1))], deadline)
        self.pushes += 1
        self.bytes_pushed += len(job.layers) * job.num_blocks * slot

    def _push_heads(self, client: StoreClient, job: PushJob, deadline: float) -> None:
        """Some heads of each staged row: read the rows (they may be on NVMe), check them against
        the checksums they were staged with, pack the heads, checksum what is sent
        (`pack_checked_heads`); over tcp."""
        rl, heads = self.row_layout, job.heads
        if rl is None or heads is None:
            raise TransferError(FailureCause.LAYOUT_MISMATCH, "this producer's rows cannot be sliced by head")
        packed = rl.with_heads(heads.count).row_bytes
        slot = self.store.slot_bytes
        for head in self._parts(job, self.store.info(job.transfer_id).num_blocks, packed):
            first, n = head["first_block"], head["num_blocks"]
            rows = np.empty((len(job.layers) * n, slot), dtype=np.uint8)
            self.store.read_into(job.transfer_id, job.layers, first, rows, unsealed=True)  # layer-major
            out, head["checksums"] = pack_checked_heads(rows, rl, heads, head["checksums"], job.transfer_id)
            self._pace(out.nbytes)
            client.push(wire.Push(**head, nbytes=out.nbytes), [memoryview(out.reshape(-1))], deadline)
        self.pushes += 1
        self.bytes_pushed += len(job.layers) * job.num_blocks * packed

    def _pace(self, nbytes: int) -> None:
        if not self._link_rate:
            return
        now = time.monotonic()
        self._link_free_at = max(now, self._link_free_at) + nbytes / self._link_rate
        if self._link_free_at > now:
            time.sleep(self._link_free_at - now)

    def _drop_client(self, target: Addr) -> None:
        client = self._clients.pop(target, None)
        if client is not None:
            client.close()

    def _client(self, target: Addr) -> StoreClient:
        client = self._clients.get(target)
        if client is None:
            client = self._client_factory(*target)
            self._clients[target] = client
        return client

    def _fail(self, job: PushJob, exc: TransferError) -> None:
        if job.abort is not None:  # best effort: the transfer is already failed here
            logger.info("could not tell %s:%d that transfer %s was abandoned: %s", *job.target,
                        job.transfer_id, exc)
            if exc.cause.breaks_stream:
                self._drop_client(job.target)
            return
        if (exc.cause.breaks_stream and not exc.refused) or exc.cause is FailureCause.AUTH:
            # The stream may be out of step (or a sealed record failed its tag): start afresh. (A refusal
            # answered in step, e.g. store_full, keeps the connection: closing it would fail the other
            # transfers on it.)
            self._drop_client(job.target)
        if not job.end:
            self._failed[(job.transfer_id, job.target)] = exc
            while len(self._failed) > 10_000:
                self._failed.pop(next(iter(self._failed)))
        logger.warning("push of transfer %s to %s:%d failed: %s", job.transfer_id, *job.target, exc)
        self._on_done(job.transfer_id, job.target, exc)
