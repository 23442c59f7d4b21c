"""Producer side of push mode: where each staged transfer goes, and what happens when it landed.

The staging book (staging.py) tells this part what it staged, step by step; this part turns that
into PushJobs for the push sender's thread (transport/push.py): one route per consumer rank this
rank serves (planned by tp.py `push_routes` for the decode's TP size, which `ConsumerSizes` asks
and remembers), layer groups as they fill, the last group with the seal, an abort when staging
failed or the request was dropped. When every route landed, the staged copy is let go (each
consumer rank holds its own, under its own lease). A route refused in step keeps the
staged copy for that consumer's pull; a push broken on the wire is reported through `on_lost`,
because then no consumer will pull it either.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np

from kvconnectors.errors import FailureCause, TransferError
from kvconnectors.logs import get_logger
from kvconnectors.mover.geometry import UnsupportedKVCache
from kvconnectors.mover.reslice import RowLayout
from kvconnectors.store import TieredStore
from kvconnectors.tiered.config import TieredConfig
from kvconnectors.tiered.layout import KVLayout
from kvconnectors.tiered.links import PeerLinks
from kvconnectors.tiered.metadata import SaveSpec
from kvconnectors.tiered.tp import NotPushable, PushRoute, fragment_id, push_routes
from kvconnectors.transport.paths import PushPath
from kvconnectors.transport.protocol import Addr, parse_target
from kvconnectors.transport.push import PushJob, PushSender

logger = get_logger(__name__)
SIZE_TTL_S = 60.0        # a decode instance's TP size is asked again after this (it may have been restarted)
UNREACHABLE_TTL_S = 5.0  # after a failed ask, transfers for that address are staged for pulls this long


class ConsumerSizes:
    """The TP size of the decode instance behind each landing address, asked over the store protocol
    (`ask(host, port) -> tp_size`, 0 for a store that does not say: taken as ours) and remembered."""

    def __init__(self, ask: Callable[[str, int], int], default: int):
        self._ask, self._default = ask, default
        self._lock = threading.Lock()
        self._known: dict[Addr, tuple[float, int | TransferError]] = {}

    def tp_size(self, host: str, port: int) -> int:
        now = time.monotonic()
        with self._lock:
            hit = self._known.get((host, port))
        if hit is not None and hit[0] > now:
            if isinstance(hit[1], TransferError):
                raise hit[1]
            return hit[1]
        try:
            size = self._ask(host, port) or self._default
        except TransferError as exc:
            with self._lock:
                self._known[(host, port)] = (now + UNREACHABLE_TTL_S, exc)
            raise
        with self._lock:
            self._known[(host, port)] = (now + SIZE_TTL_S, size)
        return size


class PushBook:
    def __init__(self, store: TieredStore, layout: KVLayout, row_layout: RowLayout | UnsupportedKVCache,
                 config: TieredConfig, links: PeerLinks, path: PushPath, record: Callable[..., None],
                 on_lost: Callable[[str, TransferError], None], link_bytes_per_s: float | None = None):
        """`on_lost(tid, error)`: a push broke on the wire (called without this part's lock held).
        `link_bytes_per_s`: benchmarks only, the sender emulates a link this slow (bench layerwise)."""
        self.store, self.layout, self.row_layout, self.config = store, layout, row_layout, config
        self._links, self._record, self._on_lost = links, record, on_lost
        self._lock = threading.RLock()
        self._layers: dict[str, list[int]] = {}  # transfer -> staged layers not yet pushed
        self._targets: dict[str, list[PushRoute]] = {}  # transfer -> where its groups go (until sealed)
        self._open: dict[str, dict[Addr, PushRoute]] = {}  # transfer -> routes not finished yet
        self._kept: set[str] = set()  # a route was refused: its consumer rank pulls the staged copy
        self._sizes = ConsumerSizes(self._ask_tp_size, layout.tp_size)
        self._said_not_pushable: set[Addr] = set()
        self.sender = PushSender(store, fingerprint=layout.rows_fingerprint, num_layers=layout.num_layers,
                                 client_factory=links.connect, timeout_s=config.load_timeout_s,
                                 on_done=self._done, path=path, link_bytes_per_s=link_bytes_per_s,
                                 row_layout=row_layout if isinstance(row_layout, RowLayout) else None)

    # ------------------------------------------------------------------ from the staging book
    def start(self, tid: str, target: str) -> None:
        """Push `tid` to the consumer ranks behind `target` (its rank 0's landing store; rank r
        listens on port + r) that this rank serves (tp.py `push_routes`), unless the target is not
        allowed (a typed BAD_PARAMS error naming the field and value), cannot be asked, or the TP
        sizes are served by pulls: then it is staged for a pull only."""
        try:
            host, port = parse_target(target)
            host = self._links.check(host, port, "kv_transfer_params.push_target")
            routes = push_routes(self.layout, self.row_layout, host, port, self._sizes.tp_size(host, port))
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
            with self._lock:
                self._targets[tid] = routes
                self._open[tid] = {r.target: r for r in routes}

    def routes(self, tid: str) -> list[PushRoute]:
        """Where `tid`'s groups go ([]: it is staged for pulls only)."""
        with self._lock:
            return list(self._targets.get(tid, ()))

    def staged(self, spec: SaveSpec, layers: list[int]) -> None:
        """These layers of `spec` are in the store: they go with its next group."""
        with self._lock:
            if spec.transfer_id in self._targets:
                self._layers.setdefault(spec.transfer_id, []).extend(layers)

    def send_full_group(self, spec: SaveSpec, sums: np.ndarray | None) -> None:
        """Layer-wise: send the staged layers once they fill a group (layer_group_size)."""
        with self._lock:
            full = len(self._layers.get(spec.transfer_id, ())) >= self.config.layer_group_size
        if spec.layerwise and full:
            self.send_group(spec, sums)

    def send_group(self, spec: SaveSpec, sums: np.ndarray | None, end: bool = False) -> None:
        """Hand the staged, not yet pushed layers of `spec` to the sender (`sums`: the entry's
        checksums, layer x block); `end`: the transfer's last message (the landing side seals it;
        sent even with no layers left)."""
        with self._lock:
            layers = self._layers.pop(spec.transfer_id, None) or []
        if not (layers or end):
            return
        if not layers:
            self._submit(spec.transfer_id, end=True, token=spec.token)
            return
        n = len(spec.block_ids)
        checksums = (np.concatenate([sums[layer, spec.first_block:spec.first_block + n] for layer in layers])
                     .tolist() if self.config.checksum and sums is not None else None)
        self._submit(spec.transfer_id, layers=layers, first_block=spec.first_block, num_blocks=n,
                     checksums=checksums, end=end, token=spec.token)

    def send_last(self, spec: SaveSpec, sums: np.ndarray | None) -> None:
        """`spec` is sealed here: its last group (below layerwise_min_tokens: every layer), sealing
        the landing copy. After our own seal, because a landed push releases our staged copy."""
        if spec.transfer_id in self._targets:
            self.send_group(spec, sums, end=True)
            with self._lock:
                self._targets.pop(spec.transfer_id, None)

    def abort(self, tid: str, error: TransferError) -> None:
        """No more pushes of `tid`: its consumers are told why now, not at their deadline."""
        with self._lock:
            self._layers.pop(tid, None)
            if tid in self._targets:
                self._submit(tid, abort=error)
            self._targets.pop(tid, None)
            self._open.pop(tid, None)
            self._kept.discard(tid)

    def close(self) -> None:
        self.sender.close()

    # ------------------------------------------------------------------ internals
    def _submit(self, tid: str, **job: object) -> None:
        """One PushJob per route of `tid` (a head fragment under its own id)."""
        for route in self._targets.get(tid, ()):
            wire_id = fragment_id(tid, self.layout.tp_rank) if route.fragment is not None else ""
            self.sender.submit(PushJob(tid, route.target, heads=route.heads, fingerprint=route.fingerprint,
                                       wire_id=wire_id, fragment=route.fragment, **job))

    def _ask_tp_size(self, host: str, port: int) -> int:
        """The TP size of the decode instance whose rank 0 lands on host:port (0: it does not say)."""
        try:
            with self._links.connect(host, port) as client:
                return client.status(time.monotonic() + self.config.connect_timeout_s).tp_size
        except OSError as exc:  # typed, so ConsumerSizes remembers it and staging goes on for a pull
            raise TransferError(FailureCause.PEER_UNREACHABLE, f"landing store {host}:{port}: {exc}") from None

    def _done(self, tid: str, target: Addr, error: TransferError | None) -> None:
        """Push sender thread: the push of a transfer to one consumer rank (`target`) finished
        (error None) or failed. The staged copy goes once every route landed."""
        if error is not None:
            self._record("record_failure", f"push_{error.cause.value}")
            # Broke on the wire: no consumer will pull the staged copy. Refused in step (store full, bad
            # checksum, gave up waiting, ...) or never connected: it keeps it, the consumer pulls instead.
            if error.cause.push_lost and not error.refused:
                self._on_lost(tid, TransferError(error.cause, f"push to the decode instance failed: {error}"))
                return
        with self._lock:
            routes = self._open.get(tid)
            route = routes.pop(target, None) if routes is not None else None
            if route is None:
                return  # failed meanwhile (abort), or dropped
            if error is not None:
                self._kept.add(tid)
            else:
                info = self.store.info(tid) if self.store.contains(tid) else None
                if info is not None:
                    assert route.heads is None or isinstance(self.row_layout, RowLayout)
                    row = self.store.slot_bytes if route.heads is None else (
                        self.row_layout.with_heads(route.heads.count).row_bytes)
                    self._record("record_push", info.num_layers * info.num_blocks * row)
            if routes:
                return  # other consumer ranks still to land
            del self._open[tid]
            if tid in self._kept:
                self._kept.discard(tid)
                return  # a consumer rank was refused and pulls it: its lease keeper (or expiry) ends it
        try:  # every consumer rank holds it now, under its own lease
            self.store.release(tid)
        except TransferError:
            pass
