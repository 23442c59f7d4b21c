"""Prefill and decode pools of different tensor parallelism (issue 20): every plan of which heads
move between which ranks, in both directions, over the pure head arithmetic of `mover.heads`.

Equal TP sizes keep the rank-i-to-rank-i path unchanged (no plan, one whole-row route). Different TP
sizes need the same model-wide KV (`KVLayout.fingerprint`) and a layout whose heads can be sliced
(`mover.reslice.geometry_row_layout`); anything else is refused with both sides' TP sizes and KV
head counts, and the layout and dtype when the mover cannot slice it.

Pull (`plan_for` -> `Reslice`): a consumer rank reads the rows of every producer rank in its
`slice_plan` and copies their head runs into its rows (resliced.py).

Push (`push_routes` -> `PushRoute`s): the pusher (pushes.py) learns the decode instance's TP size
from its landing store, then each producer rank pushes, to every consumer rank whose `slice_plan`
step it serves (`mover.heads.push_plan`, so push and pull move the same bytes), the heads of that
step, packed into that rank's rows and presented under that rank's rows fingerprint
(`KVLayout.for_rank`), so the landing side checks them exactly as it checks an equal-TP push. That
covers every pairing where one producer rank holds all of a consumer rank's heads (decode TP >=
prefill TP, replicated heads, MLA).

A consumer rank that assembles its heads from several producer ranks (decode TP < prefill TP) gets
one head fragment from each: rows of just the heads that producer rank serves, landed under the
fragment's own id (`fragment_id`: the transfer id and the producer rank) with the fingerprint of
rows that hold that many of the consumer rank's heads (`KVLayout.with_heads`) and the head range
they fill (wire.Push.heads). Each fragment is an ordinary pushed entry on the landing side (its own
owner, lease and seal; a fragment row takes a whole landing slot); the consumer waits for all of
them and copies each one's heads into its rows (landed.LandedReader.load_fragments), or pulls its
slices when any is missing. A producer rank serving one consumer rank through two separate head
runs (never with vLLM's head split) is `NotPushable`, said once per address and no failure: that
rank pulls.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvconnectors.errors import FailureCause, TransferError
from kvconnectors.mover.geometry import UnsupportedKVCache
from kvconnectors.mover.heads import HeadRange, HeadSplitError, SliceStep, head_map, push_plan, slice_plan
from kvconnectors.mover.reslice import RowLayout
from kvconnectors.tiered.layout import KVLayout
from kvconnectors.tiered.params import TransferParams
from kvconnectors.transport.protocol import Addr


def _mismatch(why: str) -> TransferError:
    return TransferError(FailureCause.LAYOUT_MISMATCH, why)


# ------------------------------------------------------------------------------------------ pull
@dataclass(frozen=True)
class Reslice:
    """A consumer rank's plan: read every (layer, block) row of each producer rank in `ranks`,
    copy the plan's head runs into this rank's rows."""

    producer_tp: int
    steps: tuple[SliceStep, ...]
    producer_row: RowLayout
    consumer_row: RowLayout

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(dict.fromkeys(s.producer_rank for s in self.steps))

    def steps_of(self, rank: int) -> tuple[SliceStep, ...]:
        return tuple(s for s in self.steps if s.producer_rank == rank)

    @property
    def one_source(self) -> bool:
        """One producer rank holds all of this rank's heads: in push mode it pushes them here."""
        return len(self.steps) == 1 and self.steps[0].consumer_heads == HeadRange(0, self.consumer_row.heads)


def producer_side(p: TransferParams) -> str:
    if p.v < 4:
        return f"TP {len(p.addrs)}, KV heads not stated (version {p.v} ticket)"
    return f"TP {p.tp_size}, {p.kv_heads} KV heads"


def plan_for(p: TransferParams, layout: KVLayout, row: RowLayout | UnsupportedKVCache) -> Reslice | None:
    """None: load from producer rank `layout.tp_rank` as is (equal TP, as before issue 20). Else the
    plan. Raises a LAYOUT_MISMATCH TransferError naming both sides when neither can serve."""
    if p.v < 4:  # a previous-version producer: rows fingerprint, and its TP size is the rank count
        if p.fingerprint != layout.rows_fingerprint:
            raise _mismatch(f"producer KV layout {p.fingerprint} ({producer_side(p)}) differs from this "
                            f"consumer's {layout.rows_fingerprint} ({layout.describe_side()}; {layout.describe()})")
        if layout.tp_rank >= len(p.addrs):
            raise _mismatch(f"producer has {len(p.addrs)} ranks, this consumer is rank {layout.tp_rank}")
        return None
    if p.fingerprint != layout.fingerprint:
        raise _mismatch(f"producer KV layout {p.fingerprint} ({producer_side(p)}) differs from this consumer's "
                        f"{layout.fingerprint} ({layout.describe_side()}; {layout.describe_model()})")
    if p.tp_size == layout.tp_size:
        return None
    both = f"producer {producer_side(p)}, this consumer {layout.describe_side()}"
    if isinstance(row, UnsupportedKVCache):
        raise _mismatch(f"different TP sizes need head-sliced transfers ({both}), and {row}")
    try:
        steps = slice_plan(p.tp_size, layout.tp_size, p.kv_heads, layout.tp_rank, mla=row.mla)
        local = 1 if row.mla else head_map(p.kv_heads, p.tp_size)[steps[0].producer_rank].count
    except HeadSplitError as exc:
        raise _mismatch(f"cannot split KV heads between these TP sizes ({both}): {exc}") from None
    return Reslice(p.tp_size, steps, row.with_heads(local), row)


# ------------------------------------------------------------------------------------------ push
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
        raise _mismatch(f"different TP sizes ({sides}) need head-sliced rows: {row}")
    try:
        plan = push_plan(layout.tp_size, consumer_tp, layout.kv_heads, layout.tp_rank, mla=row.mla)
        theirs = {c: layout.for_rank(consumer_tp, c) for c, _ in plan}
    except HeadSplitError as exc:
        raise _mismatch(f"cannot split KV heads ({sides}): {exc}") from None
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
