"""Push mode between pools of different TP sizes (issue 20): where one producer rank pushes a transfer.

Equal TP sizes: rank r pushes its rows unsliced to the consumer's rank r (landing store port + r).
Another TP size: the decode instance's landing store says its TP size (StatusReply.tp_size, asked
once per address and remembered, `ConsumerSizes`); each producer rank pushes, to every consumer rank
whose `mover.heads.slice_plan` step it serves, the heads of that step, packed into that rank's rows
and presented under that rank's rows fingerprint (`KVLayout.for_rank`), so the landing side checks
them exactly as it checks an equal-TP push. That covers every pairing where one producer rank holds
all of a consumer rank's heads (decode TP >= prefill TP, replicated heads, MLA). A consumer rank
that assembles its heads from several producer ranks (decode TP < prefill TP) pulls its slices
instead: `NotPushable`, said once per address, is no failure.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvconnectors.errors import FailureCause, TransferError
from kvconnectors.mover.geometry import UnsupportedKVCache
from kvconnectors.mover.heads import HeadRange, HeadSplitError, push_plan
from kvconnectors.mover.reslice import RowLayout
from kvconnectors.tiered.layout import KVLayout

Addr = tuple[str, int]
SIZE_TTL_S = 60.0        # a decode instance's TP size is asked again after this (it may have been restarted)
UNREACHABLE_TTL_S = 5.0  # after a failed ask, transfers for that address are staged for pulls this long


class NotPushable(Exception):
    """This pairing of TP sizes is served by pulls (the consumer pulls its slices); no failure."""


@dataclass(frozen=True)
class PushRoute:
    target: Addr                    # one consumer rank's landing store
    heads: HeadRange | None = None  # the producer-local heads to send; None: whole rows
    fingerprint: str = ""           # that rank's rows fingerprint; "": ours (equal TP)


def push_routes(layout: KVLayout, row: RowLayout | UnsupportedKVCache, host: str, port: int,
                consumer_tp: int) -> list[PushRoute]:
    """The consumer ranks producer rank `layout.tp_rank` pushes to (rank 0 lands on host:port),
    and what it sends each; [] when the consumer ranks read nothing from this rank."""
    if consumer_tp == layout.tp_size:
        return [PushRoute((host, port + layout.tp_rank))]
    sides = (f"prefill TP {layout.tp_size}, decode TP {consumer_tp}, {layout.kv_heads} KV heads")
    if isinstance(row, UnsupportedKVCache):
        raise TransferError(FailureCause.LAYOUT_MISMATCH, f"different TP sizes ({sides}) need head-sliced rows: {row}")
    try:
        plan = push_plan(layout.tp_size, consumer_tp, layout.kv_heads, layout.tp_rank, mla=row.mla)
        theirs = {c: layout.for_rank(consumer_tp, c) for c, _ in plan}
    except HeadSplitError as exc:
        raise TransferError(FailureCause.LAYOUT_MISMATCH, f"cannot split KV heads ({sides}): {exc}") from None
    routes = []
    for c, step in plan:
        if step.consumer_heads != HeadRange(0, theirs[c].block_shape[0]):
            raise NotPushable(f"{sides}: a decode rank assembles its heads from several prefill ranks, so it "
                              "pulls its slices (pushes need one prefill rank holding all of a decode rank's heads)")
        whole = step.producer_heads == HeadRange(0, layout.block_shape[0])
        routes.append(PushRoute((host, port + c), None if whole else step.producer_heads, theirs[c].rows_fingerprint))
    return routes


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
