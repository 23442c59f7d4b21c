"""Which KV heads each tensor-parallel rank holds, and which producer rank serves each consumer head.

vLLM splits KV heads the way `QKVParallelLinear` (vllm/model_executor/layers/linear.py) loads the
k/v weights: with `total_kv_heads >= tp` rank r holds `total_kv_heads // tp` consecutive heads from
`r * total_kv_heads // tp`; with fewer heads than ranks each head is replicated on
`num_kv_head_replicas = tp // total_kv_heads` consecutive ranks (rank r holds head
`r // num_kv_head_replicas`). Both divisions must be exact (vLLM's `divide` asserts it).

A plan is pure integers: no tensors, no vLLM. The byte-level copy that follows a plan is in
`kvconnectors.mover.reslice`; the connector's plans for both directions are made in `tiered/tp.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from kvconnectors.mover.geometry import UnsupportedKVCache


class HeadSplitError(UnsupportedKVCache):
    """Heads cannot be split or planned as asked; names the offending field and its value."""

    def __init__(self, field: str, value: object, why: str):
        self.field, self.value = field, value
        super().__init__(f"{field}={value!r}: {why}")


class HeadRange(NamedTuple):
    """Heads [start, stop) (global, or local to one rank's cache, as the holder says)."""

    start: int
    stop: int

    @property
    def count(self) -> int:
        return self.stop - self.start

    def shift(self, by: int) -> HeadRange:
        return HeadRange(self.start + by, self.stop + by)


@dataclass(frozen=True)
class SliceStep:
    """Copy heads `producer_heads` of producer rank `producer_rank`'s block rows into heads
    `consumer_heads` of the consumer rank's rows (both local to that rank's cache); `heads` is the
    same run in the model's global head numbering."""

    producer_rank: int
    producer_heads: HeadRange
    consumer_heads: HeadRange
    heads: HeadRange


def _positive(field: str, value: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise HeadSplitError(field, value, "must be a positive integer")
    return value


def _rank(field: str, value: int, size: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < size:
        raise HeadSplitError(field, value, f"must be a rank in [0, {size})")
    return value


def head_map(total_kv_heads: int, tp_size: int) -> tuple[HeadRange, ...]:
    """Per rank, the global KV heads it holds (vLLM's split, replication included)."""
    _positive("total_kv_heads", total_kv_heads)
    _positive("tp_size", tp_size)
    if total_kv_heads >= tp_size:
        if total_kv_heads % tp_size:
            raise HeadSplitError("tp_size", tp_size, f"does not divide total_kv_heads={total_kv_heads} "
                                 "(vLLM requires it)")
        per = total_kv_heads // tp_size
        return tuple(HeadRange(r * per, (r + 1) * per) for r in range(tp_size))
    if tp_size % total_kv_heads:
        raise HeadSplitError("tp_size", tp_size, f"is not a multiple of total_kv_heads={total_kv_heads} "
                             "(vLLM replicates each head on tp_size / total_kv_heads ranks)")
    replicas = tp_size // total_kv_heads
    return tuple(HeadRange(r // replicas, r // replicas + 1) for r in range(tp_size))


def _holders(ranges: tuple[HeadRange, ...], head: int) -> list[int]:
    return [r for r, hr in enumerate(ranges) if hr.start <= head < hr.stop]


def slice_plan(producer_tp: int, consumer_tp: int, total_kv_heads: int, consumer_rank: int, *,
               mla: bool = False) -> tuple[SliceStep, ...]:
    """What consumer rank `consumer_rank` gathers: each of its heads exactly once, in runs of
    consecutive heads from one producer rank, ordered by consumer head.

    A head replicated on several producer ranks is served by one of them: the k-th consumer rank
    that needs the head (in rank order) takes replica k mod replicas, so the consumer ranks that
    share a head spread over its producer replicas and no byte crosses twice. MLA: the latent is
    the same on every rank, so producer rank 0 serves every consumer rank (the other producer
    ranks need not stage anything)."""
    _positive("producer_tp", producer_tp)
    _positive("consumer_tp", consumer_tp)
    _rank("consumer_rank", consumer_rank, consumer_tp)
    if mla:
        whole = HeadRange(0, 1)
        return (SliceStep(0, whole, whole, whole),)
    prod = head_map(total_kv_heads, producer_tp)
    cons = head_map(total_kv_heads, consumer_tp)
    mine = cons[consumer_rank]
    steps: list[SliceStep] = []
    for head in range(mine.start, mine.stop):
        replicas = _holders(prod, head)
        k = _holders(cons, head).index(consumer_rank)
        p = replicas[k % len(replicas)]
        local_p = head - prod[p].start
        local_c = head - mine.start
        last = steps[-1] if steps else None
        if last is not None and last.producer_rank == p and last.producer_heads.stop == local_p:
            steps[-1] = SliceStep(p, HeadRange(last.producer_heads.start, local_p + 1),
                                  HeadRange(last.consumer_heads.start, local_c + 1),
                                  HeadRange(last.heads.start, head + 1))
        else:
            steps.append(SliceStep(p, HeadRange(local_p, local_p + 1), HeadRange(local_c, local_c + 1),
                                   HeadRange(head, head + 1)))
    return tuple(steps)


def push_plan(producer_tp: int, consumer_tp: int, total_kv_heads: int, producer_rank: int, *,
              mla: bool = False) -> tuple[tuple[int, SliceStep], ...]:
    """What producer rank `producer_rank` pushes: (consumer rank, step) for every step of every
    consumer rank's `slice_plan` it serves, so push and pull move the same bytes."""
    _rank("producer_rank", producer_rank, _positive("producer_tp", producer_tp))
    return tuple((c, step) for c in range(_positive("consumer_tp", consumer_tp))
                 for step in slice_plan(producer_tp, consumer_tp, total_kv_heads, c, mla=mla)
                 if step.producer_rank == producer_rank)


def serving_ranks(producer_tp: int, consumer_tp: int, total_kv_heads: int, *,
                  mla: bool = False) -> frozenset[int]:
    """Producer ranks some consumer rank reads from (the others need not stage their blocks)."""
    return frozenset(step.producer_rank for c in range(_positive("consumer_tp", consumer_tp))
                     for step in slice_plan(producer_tp, consumer_tp, total_kv_heads, c, mla=mla))
