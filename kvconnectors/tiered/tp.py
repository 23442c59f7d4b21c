"""Prefill and decode pools of different tensor parallelism (issue 20): whether a consumer rank can
load a ticket, and which producer ranks' head slices make up its blocks.

Equal TP sizes keep the rank-i-to-rank-i path unchanged (no plan). Different TP sizes need the same
model-wide KV (`KVLayout.fingerprint`) and a layout whose heads can be sliced
(`mover.reslice.geometry_row_layout`); anything else is refused with both sides' TP sizes and KV
head counts, and the layout and dtype when the mover cannot slice it.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvconnectors.errors import FailureCause, TransferError
from kvconnectors.mover.geometry import UnsupportedKVCache
from kvconnectors.mover.heads import HeadRange, HeadSplitError, SliceStep, head_map, slice_plan
from kvconnectors.mover.reslice import RowLayout
from kvconnectors.tiered.layout import KVLayout
from kvconnectors.tiered.params import TransferParams


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


def _mismatch(why: str) -> TransferError:
    return TransferError(FailureCause.LAYOUT_MISMATCH, why)


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
