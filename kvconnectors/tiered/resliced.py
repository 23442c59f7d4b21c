"""Consumer side: pulls from a producer pool of another tensor-parallel size.

The plan (tiered/tp.py) names, for this rank, which heads it takes from which producer ranks. The
rows of every producer rank it names are read side by side (threads start on demand), each one's
head runs copied into this rank's rows as they arrive, and loaded only when every rank's slices
are in: the first rank to fail fails the load, named, and nothing partial reaches the cache.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed

import numpy as np

from kvconnectors.errors import FailureCause, TransferError
from kvconnectors.logs import get_logger
from kvconnectors.mover import Loader
from kvconnectors.mover.block_views import BlockViews
from kvconnectors.mover.heads import SliceStep
from kvconnectors.mover.reslice import RowLayout, copy_heads
from kvconnectors.tiered.config import TieredConfig
from kvconnectors.tiered.layout import KVLayout
from kvconnectors.tiered.links import PeerLinks
from kvconnectors.tiered.load import Load
from kvconnectors.tiered.pull_paths import PullPaths
from kvconnectors.tiered.tp import Reslice
from kvconnectors.transport import tamper
from kvconnectors.transport.client import StoreClient
from kvconnectors.transport.paths import TCP_HEADS_PULL, TCP_PULL, PullPath, ShmPull

logger = get_logger(__name__)


class ReslicedReads:
    def __init__(self, layout: KVLayout, config: TieredConfig, links: PeerLinks, paths: PullPaths, loader: Loader,
                 record: Callable[..., None]):
        self.layout, self.config, self._links, self._paths, self.loader = layout, config, links, paths, loader
        self._record = record
        self._reads = ThreadPoolExecutor(max_workers=4 * config.max_concurrent_loads,
                                         thread_name_prefix="kvc-rank-read")

    def pull(self, load: Load, rs: Reslice, deadline: float) -> dict[str, int]:
        """Read every (layer, block) row of each producer rank the plan names, all ranks at once.
        Over tcp a rank of which this one keeps only some heads sends just those (TCP_HEADS_PULL);
        over shm whole rows are copied out of its arena. No release here: a producer rank may serve
        several consumer ranks, so the scheduler's lease keeper releases every rank once all are
        done (shm reads answer "read, keep it"). nixl goes over tcp, counted (its READs need
        registered destinations)."""
        layers = range(self.layout.num_layers)
        transport = self.config.transport
        path = self._paths.for_ticket(load.spec, load.p, rank=rs.ranks[0]) if transport == "shm" else TCP_PULL
        if transport == "nixl":
            self._record("record_path_fallback", transport, TCP_PULL.label)
        mine = self.loader.landing_buffer(len(layers) * load.n)
        reads = {self._reads.submit(self.read_rank, load, rs, rank, deadline, path): rank for rank in rs.ranks}
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
        self.loader.load_and_release(mine, layers, load.targets, deadline)
        return {path.label: nbytes}

    def pull_fragment(self, load: Load, rs: Reslice, step: SliceStep, mine: np.ndarray,
                      deadline: float) -> dict[str, int]:
        """Producer rank `step.producer_rank`'s slice (a head fragment that was not pushed here),
        pulled over tcp into `mine`."""
        if self.config.transport != "tcp":
            self._record("record_path_fallback", self.config.transport, TCP_PULL.label)
        theirs, row, first_head, got = self.read_rank(load, rs, step.producer_rank, deadline, TCP_PULL)
        copy_heads(theirs, row, step.producer_heads.shift(-first_head), mine, rs.consumer_row, step.consumer_heads)
        return {TCP_PULL.label: got}

    def read_rank(self, load: Load, rs: Reslice, rank: int, deadline: float,
                  path: PullPath) -> tuple[np.ndarray, RowLayout, int, int]:
        """Producer rank `rank`'s rows of the transfer's blocks (a rank-read thread): (rows, their
        layout, the rank's head the rows start at, bytes read). Over tcp only the heads this rank
        keeps when that is fewer than the producer rank holds; a producer that does not offer that
        (a previous version) refuses in step, and its whole rows are read instead."""
        steps = rs.steps_of(rank)
        lo, hi = min(s.producer_heads.start for s in steps), max(s.producer_heads.stop for s in steps)
        if isinstance(path, ShmPull):  # each producer rank's own arena, as its ticket names it
            path = self._paths.for_ticket(load.spec, load.p, rank=rank)
        sliced = path is TCP_PULL and hi - lo < rs.producer_row.heads
        try:
            with self._links.producer(load.p, rank) as client:
                if sliced:
                    try:
                        row = rs.producer_row.with_heads(hi - lo)
                        return self._read_rows(client, load, row, deadline, TCP_HEADS_PULL, (lo, hi))
                    except TransferError as exc:
                        if not (exc.refused and exc.cause is FailureCause.PROTOCOL):
                            raise
                        logger.info("producer rank %d does not send head slices (%s); reading whole rows", rank, exc)
                return self._read_rows(client, load, rs.producer_row, deadline, path, None)
        except TransferError as exc:
            addr = f"{load.p.addrs[rank].host}:{load.p.addrs[rank].port}"
            raise TransferError(exc.cause, f"producer rank {rank} of {rs.producer_tp} ({addr}): {exc.detail}",
                                refused=exc.refused) from None

    def _read_rows(self, client: StoreClient, load: Load, row: RowLayout, deadline: float, path: PullPath,
                   heads: tuple[int, int] | None) -> tuple[np.ndarray, RowLayout, int, int]:
        layers = range(self.layout.num_layers)
        theirs = np.empty((len(layers) * load.n, row.row_bytes), np.uint8)
        nbytes = client.read(load.p.transfer_id, layers, load.spec.first_block, BlockViews.of_rows(theirs),
                             fingerprint=load.p.fingerprint, deadline=deadline,
                             verify=self.config.checksum and load.fault != "corrupt",
                             path=path, token=load.p.token, release=False, heads=heads)
        if load.fault == "corrupt":  # test hook: silently, where the data path delivered the bytes
            tamper.corrupt(theirs)
        return theirs, row, heads[0] if heads else 0, nbytes

    def close(self) -> None:
        self._reads.shutdown(wait=True, cancel_futures=True)
