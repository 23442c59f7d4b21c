"""Push mode between pools of different TP sizes (issue 20): where one producer rank pushes a transfer.

Equal TP sizes: rank r pushes its rows unsliced to the consumer's rank r (landing store port + r).
Another TP size: the decode instance's landing store says its TP size (StatusReply.tp_size, asked
once per address and remembered, `ConsumerSizes`); each producer rank pushes, to every consumer rank
whose `mover.heads.slice_plan` step it serves, the heads of that step, packed into that rank's rows
and presented under that rank's rows fingerprint (`KVLayout.for_rank`), so the landing side checks
them exactly as it checks an equal-TP push. That covers every pairing where one producer rank holds
all of a consumer rank's heads (decode TP >= prefill TP, replicated heads, MLA).

A consumer rank that assembles its heads from several producer ranks (decode TP < prefill TP)
gets one head fragment from each: rows of just the heads that producer rank serves, landed under
the fragment's own id (`fragment_id`: the transfer id and the producer rank) with the fingerprint
of rows that hold that many of the consumer rank's heads (`KVLayout.with_heads`) and the head range
they fill (wire.Push.heads). Each fragment is an ordinary pushed entry on the landing side (its own
owner, lease and seal; a fragment row takes a whole landing slot); the consumer waits for all of
them and copies each one's heads into its rows (landed.LandedReader.load_fragments), or pulls its slices when
any is missing. A producer rank serving one consumer rank through two separate head runs (never
with vLLM's head split) is `NotPushable`, said once per address and no failure: that rank pulls.
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


FRAGMENT_MARK = "/from-rank"


def fragment_id(transfer_id: str, producer_rank: int) -> str:
    """The id producer rank `producer_rank`'s head fragment of `transfer_id` lands under."""
    return f"{transfer_id}{FRAGMENT_MARK}{producer_rank}"


def is_fragment_of(key: str, transfer_id: str) -> bool:
    return key.startswith(transfer_id + FRAGMENT_MARK)


@dataclass(frozen=True)
class PushRoute:
    target: Addr                    # one consumer rank's landing store
    heads: HeadRange | None = None  # the producer-local heads to send; None: whole rows
    fingerprint: str = ""           # the rows fingerprint of what it receives; "": ours (equal TP)
    fragment: HeadRange | None = None  # a head fragment: the consumer rank's heads it fills; None: all


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
    if len({c for c, _ in plan}) < len(plan):
        raise NotPushable(f"{sides}: this prefill rank serves a decode rank two separate runs of heads, "
                          "so that rank pulls its slices")
    routes = []
    for c, step in plan:
        whole = step.producer_heads == HeadRange(0, layout.block_shape[0])
        sent = None if whole else step.producer_heads
        if step.consumer_heads == HeadRange(0, theirs[c].block_shape[0]):
            routes.append(PushRoute((host, port + c), sent, theirs[c].rows_fingerprint))
        else:  # one of several fragments that make up rank c's rows; over tcp (the landing side
            # takes fragment rows shorter than its slots inline only), so always as heads
            rows = theirs[c].with_heads(step.consumer_heads.count).rows_fingerprint
            routes.append(PushRoute((host, port + c), step.producer_heads, rows, step.consumer_heads))
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
