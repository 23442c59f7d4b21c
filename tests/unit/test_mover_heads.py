"""Head-sliced transfers between prefill and decode pools of different tensor parallelism (issue #20):
vLLM's head split, the slicing plans, and the byte-level re-slicing of host block rows.

The reference is built apart from the code under test: a TP=1 cache with every KV head (random bits),
split by heads into one cache per rank the way vLLM's QKVParallelLinear loads k/v (re-derived here
from its arithmetic), rows taken as the store holds them, re-sliced by the plan, loaded into a fresh
consumer-rank cache by the Loader, and compared as bytes with the TP=1 cache's heads of that rank.
"""

from __future__ import annotations

import pickle
from collections import Counter

import numpy as np
import pytest
import torch

from kvconnectors.errors import FailureCause
from kvconnectors.mover import LAYOUTS, CpuOps, Loader, UnsupportedKVCache, describe_kv_caches
from kvconnectors.mover.heads import (HeadRange, HeadSplitError, SliceStep, head_map, push_plan, serving_ranks,
                                      slice_plan)
from kvconnectors.mover.reslice import (RowLayout, assemble, check_pair, copy_heads, geometry_row_layout,
                                        head_runs, pack_heads, row_layout, unpack_heads)
from kvconnectors.mover.shapes import synthetic_caches

TP_PAIRS = [(1, 2), (2, 1), (2, 4), (4, 2), (1, 4), (4, 1)]   # (producer TP, consumer TP)
HEAD_COUNTS = (1, 2, 4, 8)  # below, equal to and above each TP size of the pairs
L, B, N, C = 2, 6, 4, 8     # layers, blocks, tokens per block, content elements (2 * head_size)
IDS = [4, 0, 3]


# ------------------------------------------------------------------------------------------- reference
def vllm_heads(total: int, tp: int, rank: int) -> list[int]:
    """Global KV heads of `rank`, as QKVParallelLinear.weight_loader narrows the k/v weight."""
    if tp >= total:
        num_kv_heads, replicas = 1, tp // total
    else:
        num_kv_heads, replicas = total // tp, 1
    start = (rank // replicas) * num_kv_heads
    return list(range(start, start + num_kv_heads))


def full_cache(layout: str, heads: int, *, dtype=torch.bfloat16, tokens: int = N, blocks: int = B,
               seed: int = 1) -> dict[str, torch.Tensor]:
    return synthetic_caches(layout, num_layers=L, num_blocks=blocks, heads=heads, block_size=tokens, content=C,
                            dtype=dtype, seed=seed)


def rank_cache(full: dict[str, torch.Tensor], layout: str, heads: list[int], *, fill_seed: int | None = None):
    """A rank's cache (same layout) holding heads `heads` of `full`; or random bits (fill_seed)."""
    t0 = next(iter(full.values()))
    out = synthetic_caches(layout, num_layers=L, num_blocks=t0.shape[0], heads=len(heads), block_size=t0.shape[2],
                           content=C, dtype=t0.dtype, fill=fill_seed is not None, seed=fill_seed or 0)
    if fill_seed is None:
        for name, t in out.items():
            t.view(torch.uint8)[...] = full[name].view(torch.uint8)[:, heads]
    return out


def rows_of(cs: dict[str, torch.Tensor], g, ids) -> np.ndarray:
    """The store's rows of blocks `ids`, layer after layer: each block's bytes in physical order."""
    return np.concatenate([g.views[l][ids].reshape(len(ids), -1).numpy() for l in range(g.num_layers)])


def describe(cs, layout: str, *, splits: int = 1, backend: str = "FLASH_ATTN"):
    return describe_kv_caches(cs, block_size=next(iter(cs.values())).shape[2] * splits, layout=layout,
                              backend=backend)


def kernel_ids(ids, splits: int) -> list[int]:
    return [b * splits + k for b in ids for k in range(splits)]


def consumer_bytes_match(layout: str, p_tp: int, c_tp: int, heads: int, *, dtype=torch.bfloat16, splits: int = 1,
                         backend: str = "FLASH_ATTN", tamper=None, mode: str = "pull") -> bool:
    """Re-slice every consumer rank's blocks IDS from the producer ranks' rows, load them, and say
    whether each consumer cache's moved blocks equal the TP=1 cache's heads of that rank, byte for byte.
    `tamper(plan) -> plan` may break the plan (negative control)."""
    tokens = N // splits
    full = full_cache(layout, heads, dtype=dtype, tokens=tokens, blocks=B * splits)
    prod_rows, prod_rl = {}, None
    for p in range(p_tp):
        cs = rank_cache(full, layout, vllm_heads(heads, p_tp, p))
        g = describe(cs, layout, splits=splits, backend=backend)
        prod_rows[p], prod_rl = rows_of(cs, g, IDS), geometry_row_layout(g)
    ok = True
    for c in range(c_tp):
        mine = vllm_heads(heads, c_tp, c)
        dst = rank_cache(full, layout, mine, fill_seed=100 + c)  # stale bits until loaded
        g = describe(dst, layout, splits=splits, backend=backend)
        rl = geometry_row_layout(g)
        rows = np.zeros((L * len(IDS), g.block_bytes), dtype=np.uint8)
        if mode == "pull":
            plan = slice_plan(p_tp, c_tp, heads, c)
            assemble(tamper(plan) if tamper else plan, prod_rows, prod_rl, rows, rl)
        else:  # push: each producer rank sends only its slices, packed
            for p in range(p_tp):
                for cr, step in push_plan(p_tp, c_tp, heads, p):
                    if cr == c:
                        unpack_heads(pack_heads(prod_rows[p], prod_rl, step.producer_heads), rows, rl,
                                     step.consumer_heads)
        Loader(g, CpuOps()).load(rows, range(L), IDS).wait(10)
        kids = kernel_ids(IDS, splits)
        for name, t in dst.items():
            want = full[name].view(torch.uint8)[kids][:, mine]
            ok &= torch.equal(t.view(torch.uint8)[kids], want)
    return ok


# ----------------------------------------------------------------------------------------- head maps
@pytest.mark.parametrize("tp", (1, 2, 4, 8))
@pytest.mark.parametrize("heads", (1, 2, 4, 8, 16))
def test_head_map_is_vllm_split(heads, tp):
    got = head_map(heads, tp)
    assert [list(range(*hr)) for hr in got] == [vllm_heads(heads, tp, r) for r in range(tp)]
    if heads < tp:  # replicated: each head on tp / heads consecutive ranks
        assert Counter(hr.start for hr in got) == {h: tp // heads for h in range(heads)}


@pytest.mark.parametrize("heads,tp", [(6, 4), (2, 3), (3, 2)])
def test_head_map_refuses_what_vllm_cannot_split(heads, tp):
    with pytest.raises(HeadSplitError) as e:
        head_map(heads, tp)
    assert e.value.field == "tp_size" and e.value.value == tp and f"total_kv_heads={heads}" in str(e.value)
    assert e.value.cause is FailureCause.LAYOUT_MISMATCH
    twin = pickle.loads(pickle.dumps(e.value))
    assert (type(twin), twin.field, twin.value, str(twin)) == (HeadSplitError, "tp_size", tp, str(e.value))


BAD_ARGS = [({"producer_tp": 0}, "producer_tp"), ({"total_kv_heads": 0}, "total_kv_heads"),
            ({"consumer_rank": 2}, "consumer_rank"), ({"consumer_rank": -1}, "consumer_rank")]


@pytest.mark.parametrize("kw,field", BAD_ARGS)
def test_slice_plan_names_the_bad_argument(kw, field):
    args = {"producer_tp": 2, "consumer_tp": 2, "total_kv_heads": 4, "consumer_rank": 0} | kw
    with pytest.raises(HeadSplitError) as e:
        slice_plan(**args)
    assert e.value.field == field and e.value.value == kw[field]


# -------------------------------------------------------------------------------------------- plans
@pytest.mark.parametrize("heads", HEAD_COUNTS)
@pytest.mark.parametrize("p_tp,c_tp", TP_PAIRS + [(2, 2), (8, 2), (2, 8)])
def test_plan_serves_each_consumer_head_once_from_a_holder(p_tp, c_tp, heads):
    load = Counter()
    for c in range(c_tp):
        mine = vllm_heads(heads, c_tp, c)
        plan = slice_plan(p_tp, c_tp, heads, c)
        served = [h for s in plan for h in range(*s.heads)]
        assert served == mine  # every head once, in consumer order: no duplicate traffic
        for s in plan:
            held = vllm_heads(heads, p_tp, s.producer_rank)
            assert list(range(*s.heads)) == [held[i] for i in range(*s.producer_heads)]
            assert list(range(*s.heads)) == [mine[i] for i in range(*s.consumer_heads)]
            load.update((s.producer_rank, h) for h in range(*s.heads))
        # runs are merged: consecutive steps never come from the same producer rank contiguously
        for a, b in zip(plan, plan[1:]):
            assert not (a.producer_rank == b.producer_rank and a.producer_heads.stop == b.producer_heads.start)
    # a replicated head's readers spread over its replicas: loads differ by at most one
    for h in range(heads):
        replicas = [p for p in range(p_tp) if h in vllm_heads(heads, p_tp, p)]
        counts = [load[(p, h)] for p in replicas]
        assert sum(counts) == len([c for c in range(c_tp) if h in vllm_heads(heads, c_tp, c)])
        assert max(counts) - min(counts) <= 1, (h, counts)


def test_plan_shapes_for_both_directions():
    # P TP > D TP: a consumer rank assembles a block from several producer ranks
    assert slice_plan(4, 2, 8, 1) == (SliceStep(2, HeadRange(0, 2), HeadRange(0, 2), HeadRange(4, 6)),
                                      SliceStep(3, HeadRange(0, 2), HeadRange(2, 4), HeadRange(6, 8)))
    # P TP < D TP: a consumer rank takes a slice of one producer rank's block
    assert slice_plan(2, 4, 8, 3) == (SliceStep(1, HeadRange(2, 4), HeadRange(0, 2), HeadRange(6, 8)),)
    # 2 heads on 4 producer ranks (each head twice), 8 consumer ranks: readers alternate replicas
    assert [slice_plan(4, 8, 2, c)[0].producer_rank for c in range(8)] == [0, 1, 0, 1, 2, 3, 2, 3]
    # one consumer rank reads each replicated head once: the other replicas need not stage
    assert serving_ranks(4, 1, 2) == {0, 2}
    assert serving_ranks(2, 4, 8) == {0, 1}


@pytest.mark.parametrize("p_tp,c_tp", TP_PAIRS)
def test_mla_one_producer_rank_serves_every_consumer_rank(p_tp, c_tp):
    whole = HeadRange(0, 1)
    for c in range(c_tp):
        assert slice_plan(p_tp, c_tp, 1, c, mla=True) == (SliceStep(0, whole, whole, whole),)
    assert serving_ranks(p_tp, c_tp, 1, mla=True) == {0}
    assert [c for c, _ in push_plan(p_tp, c_tp, 1, 0, mla=True)] == list(range(c_tp))
    assert all(push_plan(p_tp, c_tp, 1, p, mla=True) == () for p in range(1, p_tp))


@pytest.mark.parametrize("heads", HEAD_COUNTS)
@pytest.mark.parametrize("p_tp,c_tp", TP_PAIRS)
def test_push_plan_moves_what_the_pull_plans_move(p_tp, c_tp, heads):
    pulled = {(c, s) for c in range(c_tp) for s in slice_plan(p_tp, c_tp, heads, c)}
    pushed = [(c, s) for p in range(p_tp) for c, s in push_plan(p_tp, c_tp, heads, p)]
    assert len(pushed) == len(set(pushed)) and set(pushed) == pulled


# ------------------------------------------------------------------------------ byte-exact re-slicing
@pytest.mark.parametrize("heads", HEAD_COUNTS)
@pytest.mark.parametrize("p_tp,c_tp", TP_PAIRS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_resliced_blocks_are_byte_exact(layout, p_tp, c_tp, heads):
    assert consumer_bytes_match(layout, p_tp, c_tp, heads)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("p_tp,c_tp,heads", [(4, 2, 8), (1, 4, 2), (4, 1, 2)])
def test_pushed_slices_are_byte_exact(layout, p_tp, c_tp, heads):
    assert consumer_bytes_match(layout, p_tp, c_tp, heads, mode="push")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("p_tp,c_tp,heads", [(2, 4, 8), (4, 2, 2)])
def test_float32_and_split_kernel_blocks_reslice_byte_exact(layout, p_tp, c_tp, heads):
    assert consumer_bytes_match(layout, p_tp, c_tp, heads, dtype=torch.float32)
    assert consumer_bytes_match(layout, p_tp, c_tp, heads, splits=2)  # 2 kernel blocks per manager block


@pytest.mark.parametrize("p_tp,c_tp,heads", [(1, 2, 8), (4, 2, 8), (2, 4, 2)])
def test_cpu_attention_head_major_rows_reslice_byte_exact(p_tp, c_tp, heads):
    assert consumer_bytes_match("LBHNC", p_tp, c_tp, heads, backend="CPU_ATTN")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_negative_control_wrong_head_offset_breaks_the_bytes(layout):
    def shifted(plan):  # first step reads one head further into the producer's row (or one back)
        s = plan[0]
        by = 1 if s.producer_heads.start == 0 else -1
        return (SliceStep(s.producer_rank, s.producer_heads.shift(by), s.consumer_heads, s.heads),) + plan[1:]
    assert consumer_bytes_match(layout, 1, 2, 8)
    assert not consumer_bytes_match(layout, 1, 2, 8, tamper=shifted)


def test_negative_control_wrong_row_layout_breaks_the_bytes():
    # NHD rows sliced as if heads led the row: right sizes, wrong bytes
    full = full_cache("LBNHC", 4)
    src = rank_cache(full, "LBNHC", [0, 1, 2, 3])
    g = describe(src, "LBNHC")
    rows = rows_of(src, g, IDS)
    nhd, hnd = geometry_row_layout(g), row_layout("LBHNC", heads=4, tokens=N, content_bytes=2 * C, dtype="bfloat16")
    right, wrong = (np.zeros((rows.shape[0], rows.shape[1] // 2), np.uint8) for _ in range(2))
    copy_heads(rows, nhd, HeadRange(2, 4), right, nhd.with_heads(2), HeadRange(0, 2))
    copy_heads(rows, hnd, HeadRange(2, 4), wrong, hnd.with_heads(2), HeadRange(0, 2))
    want = rows_of(rank_cache(full, "LBNHC", [2, 3]), describe(rank_cache(full, "LBNHC", [2, 3]), "LBNHC"), IDS)
    assert np.array_equal(right, want) and not np.array_equal(wrong, want)


# ------------------------------------------------------------------------------------ runs and copies
@pytest.mark.parametrize("layout,splits,runs,run_bytes", [
    ("LBHNC", 1, 1, 2 * N * 2 * C), ("BHLNC", 1, 1, 2 * N * 2 * C), ("LHBNC", 2, 1, 2 * 2 * (N // 2) * 2 * C),
    ("LBHNC", 2, 2, 2 * (N // 2) * 2 * C), ("LBNHC", 1, N, 2 * 2 * C), ("BLNHC", 2, N, 2 * 2 * C)])
def test_head_runs_strided_for_head_major_gathered_for_nhd(layout, splits, runs, run_bytes):
    full = full_cache(layout, 4, tokens=N // splits, blocks=B * splits)
    g = describe(full, layout, splits=splits)
    rl = geometry_row_layout(g)
    offsets, length = head_runs(rl, HeadRange(1, 3))
    assert (offsets.size, length) == (runs, run_bytes) and rl.heads_outermost == (runs == 1)
    rows = rows_of(full, g, IDS)
    by_runs = np.stack([np.concatenate([r[o:o + length] for o in offsets]) for r in rows])
    assert np.array_equal(pack_heads(rows, rl, HeadRange(1, 3)), by_runs)
    one = pack_heads(rows[:1], rl, HeadRange(1, 3))  # one row of a head-major layout: a contiguous slice
    rows[:1] ^= 0xFF
    assert np.array_equal(one, by_runs[:1]), "pack_heads returned a view: it changed with the rows"
    want = rows_of(rank_cache(full, layout, [1, 2]), describe(rank_cache(full, layout, [1, 2]), layout,
                                                               splits=splits), IDS)
    assert np.array_equal(by_runs, want)  # the runs, concatenated, are the 2-head rank's rows


def test_copy_heads_torch_rows_and_strided_rows_write_through():
    rl = row_layout("LBNHC", heads=4, tokens=N, content_bytes=16, dtype="bfloat16")
    half = rl.with_heads(2)
    src = np.random.default_rng(0).integers(0, 256, (5, rl.row_bytes), dtype=np.uint8)
    ref = np.zeros((5, half.row_bytes), np.uint8)
    copy_heads(src, rl, HeadRange(2, 4), ref, half, HeadRange(0, 2))
    dst_t = torch.zeros((5, half.row_bytes), dtype=torch.uint8)
    copy_heads(torch.from_numpy(src), rl, HeadRange(2, 4), dst_t, half, HeadRange(0, 2))
    assert np.array_equal(dst_t.numpy(), ref)
    # rows of a padded cache: row stride > row bytes; the copy must land in the cache, not a copy of it
    padded = np.zeros((5, half.row_bytes + 64), np.uint8)
    copy_heads(src, rl, HeadRange(2, 4), padded[:, :half.row_bytes], half, HeadRange(0, 2))
    assert np.array_equal(padded[:, :half.row_bytes], ref) and not padded[:, half.row_bytes:].any()


# --------------------------------------------------------------------------------------------- refusals
def test_cpu_attention_token_major_rows_are_refused_naming_layout_and_dtype():
    cs = full_cache("LBNHC", 4)
    g = describe(cs, "LBNHC", backend="CPU_ATTN")
    with pytest.raises(UnsupportedKVCache) as e:
        geometry_row_layout(g)
    msg = str(e.value)
    assert "LBNHC" in msg and "bfloat16" in msg and "CPU_ATTN" in msg
    assert e.value.cause is FailureCause.LAYOUT_MISMATCH
    geometry_row_layout(describe(full_cache("LBHNC", 4), "LBHNC", backend="CPU_ATTN"))  # head-major is fine


@pytest.mark.parametrize("layout,cache_dtype,what", [("unknown", "auto", "layout 'unknown'"),
                                                     ("LNBHC", "auto", "layout 'LNBHC'"),
                                                     ("LBHNC", "fp8_ds_mla", "fp8_ds_mla")])
def test_unsliceable_rows_are_refused(layout, cache_dtype, what):
    with pytest.raises(UnsupportedKVCache) as e:
        row_layout(layout, heads=4, tokens=N, content_bytes=16, dtype="float16", cache_dtype=cache_dtype)
    assert what in str(e.value) and "float16" in str(e.value)


def test_rows_that_differ_in_more_than_heads_are_refused():
    a = row_layout("LBHNC", heads=4, tokens=N, content_bytes=16, dtype="bfloat16")
    check_pair(a, a.with_heads(2))
    for other, field in [(row_layout("LBHNC", heads=2, tokens=2 * N, content_bytes=16, dtype="bfloat16"), "row"),
                         (row_layout("LBHNC", heads=2, tokens=N, content_bytes=16, dtype="float16"), "dtype"),
                         (row_layout("LBNHC", heads=2, tokens=N, content_bytes=16, dtype="bfloat16"), "layout")]:
        with pytest.raises(HeadSplitError) as e:
            check_pair(a, other)
        assert e.value.field == field


def test_bad_batches_are_refused_naming_the_field():
    rl = row_layout("LBHNC", heads=4, tokens=N, content_bytes=16, dtype="bfloat16")
    half = rl.with_heads(2)
    src, dst = np.zeros((3, rl.row_bytes), np.uint8), np.zeros((3, half.row_bytes), np.uint8)
    cases = [
        (lambda: copy_heads(src[:, :-1], rl, HeadRange(0, 2), dst, half, HeadRange(0, 2)), "src"),
        (lambda: copy_heads(src, rl, HeadRange(3, 5), dst, half, HeadRange(0, 2)), "src_heads"),
        (lambda: copy_heads(src, rl, HeadRange(0, 2), dst, half, HeadRange(0, 1)), "dst_heads"),
        (lambda: copy_heads(src, rl, HeadRange(0, 2), dst[:2], half, HeadRange(0, 2)), "dst"),
        (lambda: copy_heads(src.view(np.int8), rl, HeadRange(0, 2), dst, half, HeadRange(0, 2)), "src"),
        (lambda: assemble(slice_plan(2, 1, 4, 0), {0: dst}, half, np.zeros((3, rl.row_bytes), np.uint8), rl),
         "producer_rank"),
        (lambda: assemble(slice_plan(2, 1, 4, 0)[:1], {0: dst, 1: dst}, half, src, rl), "plan"),
        (lambda: unpack_heads(np.zeros((3, 7), np.uint8), dst, half, HeadRange(0, 1)), "packed"),
    ]
    for call, field in cases:
        with pytest.raises(HeadSplitError) as e:
            call()
        assert e.value.field == field, (field, str(e.value))


def test_row_layout_orders_axes_like_the_physical_block():
    def axes(layout, splits=2):
        return [a for a, _ in row_layout(layout, heads=2, tokens=N, content_bytes=8, splits=splits).dims]
    assert axes("LBHNC") == axes("BLHNC") == axes("BHLNC") == ["S", "H", "N", "C"]
    assert axes("LBNHC") == axes("BLNHC") == ["S", "N", "H", "C"]
    assert axes("LHBNC") == ["H", "S", "N", "C"]
    assert isinstance(row_layout("LBHNC", heads=1, tokens=N, content_bytes=8), RowLayout)


def test_a_geometry_whose_axes_contradict_its_layout_is_refused():
    import dataclasses
    g = describe(full_cache("LBHNC", 2), "LBHNC")
    geometry_row_layout(g)
    with pytest.raises(UnsupportedKVCache) as e:  # says NHD, holds [H=2, N=4, C] blocks
        geometry_row_layout(dataclasses.replace(g, layout="LBNHC"))
    assert "LBNHC" in str(e.value) and "bfloat16" in str(e.value)
