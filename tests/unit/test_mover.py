"""kvconnectors.mover on CPU tensors: engine blocks -> Stager -> TieredStore -> read_into -> Loader ->
a second cache, byte for byte, for every KVCacheLayout; the paths inside (all-layer gather, NVMe rows,
an arena that cannot be page-locked), the asynchronous contract, layout detection on GPU-shaped
`meta` caches against vLLM's own stride code, and the start-up refusals.

Bytes are compared as uint8 views (the caches hold random bits, NaNs included): never torch.equal on
floats. The expected bytes come from the logical tensors themselves, not from the geometry under test.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass

import numpy as np
import pytest
import torch
import xxhash

from kvconnectors.errors import FailureCause
from kvconnectors.mover import (LAYOUTS, CpuOps, Loader, Stager, UnsupportedKVCache, describe_kv_caches)
from kvconnectors.mover.shapes import STRIDE_ORDER, synthetic_caches
from kvconnectors.store import TieredStore
from kvconnectors.store.config import StoreConfig

CROSS_LAYER = ("BLHNC", "BLNHC", "BHLNC")
LAYER_FIRST = ("LBHNC", "LBNHC", "LHBNC")
DTYPES = (torch.bfloat16, torch.float32)
# small shapes: 3 layers, 8 blocks of 2 heads x 4 tokens x 8 content
L, B, H, N, C = 3, 8, 2, 4, 8


def caches(layout: str, *, seed: int, layers: int = L, blocks: int = B, heads: int = H, tokens: int = N,
           content: int = C, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    return synthetic_caches(layout, num_layers=layers, num_blocks=blocks, heads=heads, block_size=tokens,
                            content=content, dtype=dtype, seed=seed)


def u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def kernel_ids(ids, splits: int) -> list[int]:
    return [b * splits + k for b in ids for k in range(splits)]


def block_diffs(src: dict, dst: dict, before: dict, ids, splits: int = 1) -> list[str]:
    """What differs: moved blocks of dst vs src, and every other block of dst vs its bytes before."""
    moved = kernel_ids(ids, splits)
    out = []
    for name in src:
        s, d, b = u8(src[name]), u8(dst[name]), before[name]
        for k in range(d.shape[0]):
            want = s[k] if k in moved else b[k]
            if not torch.equal(d[k], want):
                out.append(f"{name} kernel block {k} ({'moved' if k in moved else 'untouched'})")
    return out


def snapshot(cs: dict) -> dict:
    return {name: u8(t).clone() for name, t in cs.items()}


def store_for(block_bytes: int, *, dram_slots: int = 256, nvme_dir=None, nvme_slots: int = 0) -> TieredStore:
    extra = {"nvme_dirs": [str(nvme_dir)], "nvme_bytes": block_bytes * nvme_slots} if nvme_dir is not None else {}
    return TieredStore(StoreConfig(slot_bytes=block_bytes, dram_bytes=block_bytes * dram_slots, dram_prefault=False,
                                   **extra))


@dataclass
class Moved:
    stager: Stager
    sums: np.ndarray       # [num_layers, n] as Stager.complete returned them (layer order 0..L-1)
    rows: np.ndarray       # what store.read_into gave the loader
    nvme_rows: int         # rows of the entry that started on NVMe
    splits: int


class SpyOps(CpuOps):
    """CpuOps that records each gather's (dim, rows) and can refuse to page-lock."""

    def __init__(self, pin: bool = True):
        super().__init__()
        self.pinnable = pin
        self.gathers: list[tuple[int, int]] = []

    def pin(self, array, what):
        return self.pinnable

    def gather(self, src, ids, out, dim=0):
        self.gathers.append((dim, int(ids.numel())))
        super().gather(src, ids, out, dim)


def move(src: dict, dst: dict, ids, *, block_size: int, layout: str, backend: str = "FLASH_ATTN",
         cache_dtype: str = "auto", ops: CpuOps | None = None, store: TieredStore | None = None,
         all_layer_gather: bool | None = None, groups=None, corrupt=None) -> Moved:
    """Stage blocks `ids` of every layer of `src` (in layer groups), seal, read them back and load
    them into the same blocks of `dst`. `corrupt(store, copies)` may tamper between the two."""
    gs = describe_kv_caches(src, block_size=block_size, layout=layout, backend=backend, cache_dtype=cache_dtype)
    gd = describe_kv_caches(dst, block_size=block_size, layout=layout, backend=backend, cache_dtype=cache_dtype)
    assert gs.describe() == gd.describe()
    ops = ops or CpuOps()
    own_store = store is None
    store = store or store_for(gs.block_bytes)
    try:
        stager = Stager(gs, store, ops, all_layer_gather=all_layer_gather)
        nl, n = gs.num_layers, len(ids)
        store.create("t", nl, n)
        sums = np.zeros((nl, n), dtype=np.uint64)
        copies = []
        nvme_rows = 0
        for group in groups or [list(range(nl))]:
            copy = stager.stage("t", group, 0, ids)
            nvme_rows += int(copy.target.nvme_pos.size)
            sums[group] = stager.complete(copy)
            copies.append(copy)
        store.seal("t")
        if corrupt is not None:
            corrupt(store, copies)
        rows = np.empty((nl * n, gs.block_bytes), dtype=np.uint8)
        store.read_into("t", list(range(nl)), 0, rows)
        Loader(gd, ops).load(rows, range(nl), ids).wait(10)
        store.release("t")
        return Moved(stager, sums, rows, nvme_rows, gs.kernel_splits)
    finally:
        if own_store:
            store.close()


def assert_moved(src: dict, dst: dict, before: dict, ids, m: Moved) -> None:
    diffs = block_diffs(src, dst, before, ids, m.splits)
    assert not diffs, f"{len(diffs)} blocks differ, e.g. {diffs[:4]}"
    n = len(ids)
    for l in range(m.sums.shape[0]):
        for j in range(n):
            assert int(m.sums[l, j]) == xxhash.xxh3_64_intdigest(m.rows[l * n + j]), (l, j)


def roundtrip(layout: str, ids, *, dtype=torch.bfloat16, **kw) -> Moved:
    src, dst = caches(layout, seed=1, dtype=dtype), caches(layout, seed=2, dtype=dtype)
    before = snapshot(dst)
    m = move(src, dst, ids, block_size=N, layout=layout, **kw)
    assert_moved(src, dst, before, ids, m)
    return m


def prompt_blocks(tokens: int, block_size: int, seed: int = 0) -> list[int]:
    """The block table of a prompt of `tokens` tokens: ceil(tokens / block_size) scattered blocks."""
    need = math.ceil(tokens / block_size)
    return np.random.default_rng(seed + tokens).permutation(B)[:need].tolist()


# ============================================================================ 1. byte-exact round trips
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_moves_byte_exact(layout, dtype):
    lists = [[7, 2, 5, 0], [3], list(range(B))]
    for k in (1, 2):  # prompts one token short of, exactly at, and one past a block boundary
        for tokens in (k * N - 1, k * N, k * N + 1):
            ids = prompt_blocks(tokens, N)
            assert len(ids) == math.ceil(tokens / N) == (k if tokens <= k * N else k + 1)
            lists.append(ids)
    for ids in lists:
        roundtrip(layout, ids, dtype=dtype)


def test_random_bits_hold_nans_so_floats_are_compared_as_bytes():
    t = caches("LBHNC", seed=1, dtype=torch.bfloat16, blocks=64)["model.layers.0.self_attn.attn"]
    assert torch.isnan(t).any()  # torch.equal(t, t.clone()) would be False: compare u8 views
    assert not torch.equal(t, t.clone()) and torch.equal(u8(t), u8(t.clone()))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dims", [3, 4])
def test_mla_latent_cache_moves_byte_exact(layout, dims):
    def mla(seed):
        cs = caches(layout, seed=seed, heads=1, content=16)
        return {k: v[:, 0] for k, v in cs.items()} if dims == 3 else cs  # [B, N, C] or [B, 1, N, C]
    src, dst = mla(1), mla(2)
    assert next(iter(src.values())).dim() == dims
    g = describe_kv_caches(src, block_size=N, layout=layout, backend="FLASHMLA")
    assert g.mla and g.block_shape == (1, N, 16) and g.block_bytes == N * 16 * 2
    before = snapshot(dst)
    ids = [6, 1, 3]
    m = move(src, dst, ids, block_size=N, layout=layout, backend="FLASHMLA")
    assert_moved(src, dst, before, ids, m)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_kernel_block_splitting_moves_manager_blocks_byte_exact(layout):
    # vLLM split each 4-token manager block into 2 kernel blocks of 2 tokens: tensors hold 16 kernel blocks
    src, dst = caches(layout, seed=1, tokens=N // 2, blocks=2 * B), caches(layout, seed=2, tokens=N // 2, blocks=2 * B)
    g = describe_kv_caches(src, block_size=N, layout=layout, backend="FLASH_ATTN")
    shape0 = next(iter(src.values())).shape[0]
    assert g.kernel_splits == 2 and g.num_blocks == shape0 // 2 == B
    assert g.block_bytes == H * N * C * 2  # a manager block: both kernel blocks
    before = snapshot(dst)
    ids = [7, 2, 5, 0]
    m = move(src, dst, ids, block_size=N, layout=layout)
    assert m.splits == 2
    assert_moved(src, dst, before, ids, m)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layer_groups_staged_out_of_order_land_in_their_layers(layout):
    roundtrip(layout, [7, 2, 5, 0], groups=[[2], [0, 1]])


@pytest.mark.parametrize("layout", ("LBHNC", "BLHNC"))
def test_loader_direct_rows_are_the_cache_blocks(layout):
    cs = caches(layout, seed=1)
    g = describe_kv_caches(cs, block_size=N, layout=layout)
    loader = Loader(g, CpuOps())
    assert loader.direct  # host cache, one run per block
    views = loader.direct_rows([2, 0], [5, 1])
    addrs = views.addrs()
    names = list(cs)
    for v, a, (layer, b) in zip(views, addrs, [(2, 5), (2, 1), (0, 5), (0, 1)]):
        blk = u8(cs[names[layer]])[b]
        assert bytes(v) == blk.contiguous().numpy().tobytes() and int(a) == blk.data_ptr()
    views[0][0] = views[0][0] ^ 0xFF  # writable, and it is the cache itself
    assert int(u8(cs[names[2]])[5].reshape(-1)[0]) == views[0][0]


# ============================================================================ 2. the all-layer gather
@pytest.mark.parametrize("layout", CROSS_LAYER)
def test_all_layer_gather_is_taken_and_byte_exact(layout):
    ops = SpyOps()
    m = roundtrip(layout, [7, 2, 5, 0], ops=ops, all_layer_gather=True)
    assert m.stager.all_layer_gather
    assert ops.gathers == [(1, 4)], ops.gathers  # one gather over the block dim of [L, B, ...]: every layer


@pytest.mark.parametrize("layout", CROSS_LAYER)
def test_all_layer_gather_falls_back_per_layer_for_a_layer_group(layout):
    ops = SpyOps()
    m = roundtrip(layout, [7, 2, 5, 0], ops=ops, all_layer_gather=True, groups=[[0, 1], [2]])
    assert m.stager.all_layer_gather and ops.gathers == [(0, 4)] * 3


@pytest.mark.parametrize("layout", LAYER_FIRST)
def test_all_layer_gather_is_off_for_layer_first_layouts(layout):
    ops = SpyOps()
    m = roundtrip(layout, [7, 2, 5, 0], ops=ops, all_layer_gather=True)
    assert not m.stager.all_layer_gather
    assert [d for d, _ in ops.gathers] == [0] * L


@pytest.mark.parametrize("layout", CROSS_LAYER)
def test_cpu_default_stages_cross_layer_per_layer(layout):
    g = describe_kv_caches(caches(layout, seed=1), block_size=N, layout=layout)
    with store_for(g.block_bytes) as store:
        assert g.cross_layer and not Stager(g, store, CpuOps()).all_layer_gather


# ============================================================================ 3. NVMe rows, unpinned arena
@pytest.mark.parametrize("layout", LAYOUTS)
def test_rows_that_start_on_nvme_move_byte_exact(layout, tmp_path):
    g = describe_kv_caches(caches(layout, seed=1), block_size=N, layout=layout)
    for pin in (True, False):
        for groups in (None, [[2], [0, 1]]):
            with store_for(g.block_bytes, dram_slots=5, nvme_dir=tmp_path, nvme_slots=256) as store:
                m = roundtrip(layout, [7, 2, 5, 0], ops=SpyOps(pin=pin), store=store, all_layer_gather=True,
                              groups=groups)
                assert m.nvme_rows == L * 4 - 5  # 12 rows: 5 in DRAM, the tail on NVMe
                assert m.stager.arena_pinned is pin
                assert store.stats.snapshot()["bytes_written_nvme"] == m.nvme_rows * g.block_bytes


@pytest.mark.parametrize("layout", LAYOUTS)
def test_unpinned_arena_bounces_every_row_byte_exact(layout):
    ops = SpyOps(pin=False)
    m = roundtrip(layout, [7, 2, 5, 0], ops=ops, all_layer_gather=True)
    assert not m.stager.arena_pinned and not m.nvme_rows
    assert all(d == 0 for d, _ in ops.gathers)  # nothing lands in the arena directly: per-layer into the bounce


# ============================================================================ 4. negative controls
def _flip_staged_byte(layer: int, j: int, n: int):
    def corrupt(store: TieredStore, copies) -> None:
        target = copies[0].target
        slot = int(target.loc[layer * n + j])
        assert slot >= 0  # in DRAM
        store.arena_slots()[slot, 3] ^= 0x01
    return corrupt


@pytest.mark.parametrize("layout", ("LBHNC", "BHLNC"))
def test_a_flipped_byte_breaks_the_checksum_and_the_comparison(layout):
    src, dst = caches(layout, seed=1), caches(layout, seed=2)
    before = snapshot(dst)
    ids = [7, 2, 5, 0]
    m = move(src, dst, ids, block_size=N, layout=layout, corrupt=_flip_staged_byte(1, 2, len(ids)))
    bad = 1 * len(ids) + 2
    assert int(m.sums[1, 2]) != xxhash.xxh3_64_intdigest(m.rows[bad])  # the checksum catches it
    for k in range(m.rows.shape[0]):  # ... and only it
        if k != bad:
            assert int(m.sums.reshape(-1)[k]) == xxhash.xxh3_64_intdigest(m.rows[k])
    diffs = block_diffs(src, dst, before, ids)
    assert diffs == ["model.layers.1.self_attn.attn kernel block 5 (moved)"]
    with pytest.raises(AssertionError, match="1 blocks differ"):
        assert_moved(src, dst, before, ids, m)


def test_a_skipped_block_is_seen_by_the_comparison():
    src, dst = caches("LBHNC", seed=1), caches("LBHNC", seed=2)
    before = snapshot(dst)
    move(src, dst, [7, 2], block_size=N, layout="LBHNC")
    assert block_diffs(src, dst, before, [7, 2, 5]) == [f"model.layers.{i}.self_attn.attn kernel block 5 (moved)"
                                                        for i in range(L)]
    u8(dst["model.layers.0.self_attn.attn"])[0, 0, 0, 0] ^= 0x80  # an untouched block scribbled on
    assert "model.layers.0.self_attn.attn kernel block 0 (untouched)" in block_diffs(src, dst, before, [7, 2])


# ============================================================================ 5. the asynchronous contract
class GatedOps(CpuOps):
    """Copies that wait for a gate (deterministic), or sleep (a slow device)."""

    def __init__(self, sleep_s: float = 0.0):
        super().__init__()
        self.gate = threading.Event()
        self.sleep_s = sleep_s
        if sleep_s:
            self.gate.set()

    def gather(self, src, ids, out, dim=0):
        assert self.gate.wait(20)
        time.sleep(self.sleep_s)
        super().gather(src, ids, out, dim)

    def scatter(self, rows, dst, ids):
        assert self.gate.wait(20)
        time.sleep(self.sleep_s)
        super().scatter(rows, dst, ids)


def _geoms(layout="LBHNC"):
    src, dst = caches(layout, seed=1), caches(layout, seed=2)
    return src, dst, describe_kv_caches(src, block_size=N, layout=layout), describe_kv_caches(dst, block_size=N,
                                                                                              layout=layout)


def test_stage_returns_at_once_and_complete_waits_for_a_slow_copy():
    sleep = 0.3
    src, dst, gs, gd = _geoms()
    ops = GatedOps(sleep_s=sleep)
    with store_for(gs.block_bytes) as store:
        stager = Stager(gs, store, ops)
        store.create("t", L, 2)
        t0 = time.monotonic()
        copy = stager.stage("t", range(L), 0, [5, 1])
        staged = time.monotonic() - t0
        assert not copy.event.done()
        assert staged < sleep / 2, f"stage() took {staged:.3f}s with a {sleep}s copy behind it"
        sums = stager.complete(copy)
        assert copy.event.done() and time.monotonic() - t0 >= L * sleep  # one sleeping gather per layer
        store.seal("t")
        rows = np.empty((L * 2, gs.block_bytes), np.uint8)
        store.read_into("t", list(range(L)), 0, rows)
        assert [int(x) for x in sums.reshape(-1)] == [xxhash.xxh3_64_intdigest(r) for r in rows]
        before = snapshot(dst)
        t0 = time.monotonic()
        ev = Loader(gd, ops).load(rows, range(L), [5, 1])
        assert time.monotonic() - t0 < sleep / 2 and not ev.done()
        ev.wait(10)
        assert time.monotonic() - t0 >= L * sleep
        assert not block_diffs(src, dst, before, [5, 1])


def test_nothing_lands_before_the_event_says_so():
    src, dst, gs, gd = _geoms("BLHNC")
    ops = GatedOps()
    with store_for(gs.block_bytes) as store:
        stager = Stager(gs, store, ops)
        store.create("t", L, 2)
        copy = stager.stage("t", range(L), 0, [5, 1])
        done = threading.Event()
        worker = threading.Thread(target=lambda: (stager.complete(copy), done.set()), daemon=True)
        worker.start()
        assert not done.wait(0.2) and not copy.event.done()  # complete() blocks while the copy cannot run
        ops.gate.set()
        worker.join(10)
        assert done.is_set()
        store.seal("t")
        rows = np.empty((L * 2, gs.block_bytes), np.uint8)
        store.read_into("t", list(range(L)), 0, rows)
        ops.gate.clear()
        before = snapshot(dst)
        ev = Loader(gd, ops).load(rows, range(L), [5, 1])
        time.sleep(0.1)
        assert not ev.done() and not block_diffs(src, dst, before, [])  # dst untouched until the event
        with pytest.raises(TimeoutError):
            ev.wait(0.05)
        ops.gate.set()
        ev.wait(10)
        assert not block_diffs(src, dst, before, [5, 1])


class StreamTrackingOps(CpuOps):
    """Records which thread made each index tensor: on CUDA the thread that runs a copy is the one
    inside the copy stream's context, so an index made elsewhere is copied on the wrong stream."""

    def __init__(self):
        super().__init__(name="kvc-copy-tracked")
        self.index_threads: list[str] = []

    def index(self, ids):
        self.index_threads.append(threading.current_thread().name)
        return super().index(ids)


@pytest.mark.parametrize("layout", ["LBHNC", "BLHNC"])
def test_block_ids_reach_the_device_on_the_copy_stream(layout):
    """Stager and Loader make the index tensor inside an enqueued copy (once per stage or load),
    never on the caller's stream, where the copy stream would not wait for it."""
    src, dst, gs, gd = _geoms(layout)
    ops = StreamTrackingOps()
    with store_for(gs.block_bytes) as store:
        stager = Stager(gs, store, ops, all_layer_gather=layout == "BLHNC")
        store.create("t", L, 2)
        stager.complete(stager.stage("t", range(L), 0, [5, 1]))
        assert ops.index_threads and all(t.startswith("kvc-copy-tracked") for t in ops.index_threads), ops.index_threads
        assert len(ops.index_threads) == 1, "one index per stage, shared by its layers"
        store.seal("t")
        rows = np.empty((L * 2, gs.block_bytes), np.uint8)
        store.read_into("t", list(range(L)), 0, rows)
        ops.index_threads.clear()
        Loader(gd, ops).load(rows, range(L), [5, 1]).wait(10)
        assert ops.index_threads == [ops.index_threads[0]] and ops.index_threads[0].startswith("kvc-copy-tracked")
    ops.close()


def test_a_timed_out_complete_keeps_the_slots_until_the_copy_is_done():
    """Regression: complete(timeout_s) used to give up the write target on TimeoutError and mark the
    copy completed, so abandon() returned at once and a released entry's slots went to the next entry
    while the copy was still writing them (the late copy overwrote that entry's bytes)."""
    src, dst, gs, gd = _geoms()
    ops = GatedOps()
    with store_for(gs.block_bytes, dram_slots=2 * L) as store:  # exactly one entry of L x 2 fits twice
        stager = Stager(gs, store, ops)
        store.create("a", L, 2)
        copy = stager.stage("a", range(L), 0, [5, 1])
        with pytest.raises(TimeoutError):
            stager.complete(copy, timeout_s=0.05)
        gone = threading.Event()
        worker = threading.Thread(target=lambda: (stager.abandon(copy), gone.set()), daemon=True)
        worker.start()
        assert not gone.wait(0.2), "abandon() returned while the copy was still running"
        ops.gate.set()
        worker.join(10)
        assert gone.is_set()
        store.release("a")
        store.create("b", L, 2)
        other = np.full((L * 2, gs.block_bytes), 0x5A, np.uint8)
        store.write("b", list(range(L)), 0, other)
        store.seal("b")
        out = np.empty_like(other)
        store.read_into("b", list(range(L)), 0, out)
        assert np.array_equal(out, other)
        # and a timed-out complete() can simply be called again
        ops.gate.clear()
        store.release("b")
        store.create("c", L, 2)
        copy = stager.stage("c", range(L), 0, [5, 1])
        with pytest.raises(TimeoutError):
            stager.complete(copy, timeout_s=0.05)
        ops.gate.set()
        sums = stager.complete(copy, timeout_s=10)
        store.seal("c")
        store.read_into("c", list(range(L)), 0, out)
        assert [int(x) for x in sums.reshape(-1)] == [xxhash.xxh3_64_intdigest(r) for r in out]


class LayerGatedOps(CpuOps):
    """Each layer's gather waits for its own gate: the test lets the copy stream go layer by layer."""

    def __init__(self, layers: int):
        super().__init__()
        self.gates = [threading.Event() for _ in range(layers)]
        self.calls = 0

    def gather(self, src, ids, out, dim=0):
        gate = self.gates[self.calls]
        self.calls += 1
        assert gate.wait(20)
        super().gather(src, ids, out, dim)


def test_complete_checksums_each_layer_while_later_layers_are_still_copying(monkeypatch):
    """The checksum pass runs beside the copy stream: layer 0's rows are hashed while layer 1 has not
    been copied yet (a complete() that waited for the whole copy first would hash nothing here)."""
    import kvconnectors.mover.stager as stager_mod

    src, dst, gs, gd = _geoms()
    ops = LayerGatedOps(L)
    hashed: list[int] = []
    import xxhash
    real = xxhash.xxh3_64_intdigest
    real_rows = stager_mod.hash_rows

    def counting_rows(rows, out):
        hashed.extend([1] * len(rows))
        real_rows(rows, out)
    monkeypatch.setattr(stager_mod, "hash_rows", counting_rows)
    with store_for(gs.block_bytes) as store:
        stager = Stager(gs, store, ops)
        store.create("t", L, 2)
        copy = stager.stage("t", range(L), 0, [5, 1])
        ops.gates[0].set()
        with pytest.raises(TimeoutError):  # layer 1 cannot be copied: complete() stops there...
            stager.complete(copy, timeout_s=0.3)
        assert len(hashed) == 2, f"{len(hashed)} rows hashed while only layer 0 (2 rows) was copied"
        for gate in ops.gates:
            gate.set()
        sums = stager.complete(copy, timeout_s=10)  # ...and goes on from layer 1, not from the start
        assert len(hashed) == 2 * L
        store.seal("t")
        rows = np.empty((L * 2, gs.block_bytes), np.uint8)
        store.read_into("t", list(range(L)), 0, rows)
        assert [int(x) for x in sums.reshape(-1)] == [real(r) for r in rows]


def test_a_failed_layer_copy_gives_every_slot_back_once_the_stream_is_done():
    src, dst, gs, gd = _geoms()

    class FailingOps(CpuOps):
        calls = 0

        def gather(self, src, ids, out, dim=0):
            FailingOps.calls += 1
            if FailingOps.calls == 2:
                raise RuntimeError("device error on layer 1")
            super().gather(src, ids, out, dim)
    with store_for(gs.block_bytes, dram_slots=2 * L) as store:
        stager = Stager(gs, store, FailingOps())
        store.create("t", L, 2)
        copy = stager.stage("t", range(L), 0, [5, 1])
        with pytest.raises(RuntimeError, match="layer 1"):
            stager.complete(copy, timeout_s=10)
        assert all(e.done() for e in copy.layer_events)
        store.release("t")
        store.create("u", L, 2)  # the whole arena is free again: a second entry of the same size fits
        store.write("u", list(range(L)), 0, np.zeros((2 * L, gs.block_bytes), np.uint8))


# ============================================================================ 6. layouts on GPU shapes
GPU = dict(num_layers=32, num_blocks=1000, heads=8, block_size=16, content=256, dtype=torch.bfloat16, device="meta")
PAGE = 8 * 16 * 256 * 2  # 64 KiB: one (layer, block) of an 8B-class model


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpu_shaped_meta_caches_are_detected(layout):
    cs = synthetic_caches(layout, **GPU)
    views = list(cs.values())
    for claimed in (layout, "unknown"):
        g = describe_kv_caches(cs, block_size=16, layout=claimed, backend="FLASH_ATTN", cache_dtype="auto")
        assert (g.device, g.layout, g.num_layers, g.num_blocks) == ("meta", layout, 32, 1000)
        assert g.block_bytes == PAGE and g.block_shape == (8, 16, 256) and g.kernel_splits == 1
        assert g.cross_layer is (layout in CROSS_LAYER)
        assert (g.runs, g.run_bytes) == ((8, PAGE // 8) if layout in ("LHBNC", "BHLNC") else (1, PAGE))
        assert g.block_stride == (32 * PAGE if layout in CROSS_LAYER else PAGE if layout in ("LBHNC", "LBNHC")
                                  else PAGE // 8)
    # one allocation, one strided view per layer (as_strided, as vLLM's create_kv_cache_views)
    base = views[0]._base
    assert base is not None and base.dim() == 1 and all(v._base is base for v in views)
    step = views[1].storage_offset() - views[0].storage_offset()
    assert all(v.storage_offset() == i * step for i, v in enumerate(views))
    if layout in CROSS_LAYER:
        assert all(not v.is_contiguous() for v in views)
        assert step < views[0].stride(0)  # layers interleave inside a block's run
    else:
        assert step == 1000 * PAGE // 2


def test_gpu_shapes_match_vllms_own_strides_and_views():
    """synthetic_caches must be what vLLM allocates: vllm.v1.kv_cache_interface computes the same
    byte strides per layout, and create_kv_cache_views builds the same views of a raw buffer."""
    from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheTensor, MLAAttentionSpec,
                                            compute_layout_strides, create_kv_cache_views)
    from vllm.v1.kv_cache_layout import KVCacheLayout

    assert {x.name: x.value for x in KVCacheLayout} == STRIDE_ORDER
    spec = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    mla = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    cases = [(spec, dict(GPU), None)]
    cases.append((mla, dict(GPU, heads=1, content=576), None))
    cases.append((spec, dict(GPU, block_size=8, num_blocks=2000), 8))  # kernel blocks of 8 tokens
    for s, shape, kernel in cases:
        for layout in LAYOUTS:
            if kernel and layout not in ("LBHNC", "LBNHC"):
                continue  # vLLM refuses to split blocks that are not dense pages
            kl = KVCacheLayout[layout]
            ours = synthetic_caches(layout, **shape)
            names = list(ours)
            v0 = u8(ours[names[0]])
            strides = compute_layout_strides(s, 1000, 32, kl, kernel_block_size=kernel)
            layer_step = (ours[names[1]].storage_offset() - ours[names[0]].storage_offset()) * 2
            assert (layer_step, *v0.stride()) == strides, (layout, s, kernel)
            raw = torch.empty(32 * 1000 * s.page_size_bytes, dtype=torch.int8, device="meta")
            kt = KVCacheTensor(size=raw.numel(), layers=names, layer_stride=strides[0],
                               block_stride=strides[1] * (2 if kernel else 1))
            theirs = create_kv_cache_views(raw, s, 1000, kl, kt, kernel_block_size=kernel)
            for mine, vl in zip(ours.values(), theirs):
                assert (vl.shape, vl.stride(), vl.storage_offset(), vl.dtype) == \
                       (mine.shape, mine.stride(), mine.storage_offset(), mine.dtype), (layout, kernel)
            backend = "FLASHMLA" if s is mla else "FLASH_ATTN"
            gv = describe_kv_caches(dict(zip(names, theirs)), block_size=16, layout=layout, backend=backend)
            go = describe_kv_caches(ours, block_size=16, layout=layout, backend=backend)
            assert gv.describe() == go.describe() and gv.block_stride == go.block_stride
            assert gv.num_blocks == 1000 and gv.kernel_splits == (2 if kernel else 1)


@pytest.mark.parametrize("layout", CROSS_LAYER)
def test_one_layer_of_a_cross_layer_layout_is_accepted(layout):
    """Regression: with one layer the strides of BLHNC are those of LBHNC, and the detector refused
    vLLM's layout name ("strides say LBHNC, vLLM says BLHNC") for a one-layer cache group."""
    cs = caches(layout, seed=1, layers=1)
    g = describe_kv_caches(cs, block_size=N, layout=layout, backend="FLASH_ATTN")
    assert g.layout == layout and not g.cross_layer
    dst = caches(layout, seed=2, layers=1)
    before = snapshot(dst)
    m = move(cs, dst, [6, 2], block_size=N, layout=layout)
    assert_moved(cs, dst, before, [6, 2], m)
    with pytest.raises(UnsupportedKVCache, match="strides say layout"):  # a real mismatch still fails
        describe_kv_caches(caches(layout, seed=1), block_size=N, layout="LBHNC")


# ============================================================================ 7. refusals at start-up
def _refused(cs, *, layout="LBHNC", backend="FLASH_ATTN", cache_dtype="auto") -> str:
    with pytest.raises(UnsupportedKVCache) as exc:
        describe_kv_caches(cs, block_size=N, layout=layout, backend=backend, cache_dtype=cache_dtype)
    assert exc.value.cause is FailureCause.LAYOUT_MISMATCH
    msg = str(exc.value)
    assert f"attention backend {backend}" in msg and f"KV cache layout {layout}" in msg \
        and f"kv_cache_dtype {cache_dtype}" in msg, msg
    return msg


def test_unknown_backend_is_refused():
    msg = _refused(caches("BLNHC", seed=1), layout="BLNHC", backend="TURBOQUANT")
    assert "attention backend TURBOQUANT is not supported" in msg and "FLASH_ATTN" in msg


@pytest.mark.parametrize("cache_dtype", ["fp8_per_token_head", "nvfp4", "fp8_ds_mla"])
def test_cache_dtypes_with_scales_in_the_pages_are_refused(cache_dtype):
    msg = _refused(caches("LHBNC", seed=1, dtype=torch.uint8), layout="LHBNC", cache_dtype=cache_dtype)
    assert f"kv_cache_dtype {cache_dtype} keeps dynamic scales" in msg


def test_integer_cache_is_refused():
    msg = _refused(caches("LBHNC", seed=1, dtype=torch.int32))
    assert "dtype torch.int32" in msg


@pytest.mark.parametrize("layout", ("LBHNC", "BLHNC"))
def test_non_uniform_layers_are_refused(layout):
    cs = caches(layout, seed=1)
    odd = caches("LBHNC", seed=1, layers=1, heads=1)  # one layer with half the heads
    cs["model.layers.2.self_attn.attn"] = next(iter(odd.values()))
    msg = _refused(cs, layout=layout)
    assert "non-uniform layers" in msg and "model.layers.2.self_attn.attn" in msg and "torch.bfloat16" in msg


@pytest.mark.parametrize("cache_dtype,dtype", [("fp8", torch.uint8), ("fp8", torch.float8_e4m3fn),
                                               ("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)])
@pytest.mark.parametrize("layout", ("LBHNC", "BHLNC"))
def test_fp8_per_tensor_caches_are_accepted_and_byte_exact(layout, cache_dtype, dtype):
    src, dst = caches(layout, seed=1, dtype=dtype), caches(layout, seed=2, dtype=dtype)
    g = describe_kv_caches(src, block_size=N, layout=layout, backend="FLASH_ATTN", cache_dtype=cache_dtype)
    assert g.block_bytes == H * N * C and g.cache_dtype == cache_dtype
    before = snapshot(dst)
    m = move(src, dst, [7, 2, 5, 0], block_size=N, layout=layout, cache_dtype=cache_dtype)
    assert_moved(src, dst, before, [7, 2, 5, 0], m)


@pytest.mark.parametrize("shape, dtype, word", [
    ((6, 4, 256), torch.bfloat16, torch.int64),   # a typical row: 8-byte words
    ((6, 4, 6), torch.bfloat16, torch.int32),     # 12-byte rows: 4-byte words
    ((6, 4, 3), torch.bfloat16, torch.bfloat16),  # 6-byte rows: no wider word divides them
    ((6, 4, 8), torch.float32, torch.int64),
    ((6, 4, 8), torch.uint8, torch.int64),
])
def test_cpu_gather_moves_rows_as_the_widest_word_byte_exact(shape, dtype, word) -> None:
    """CpuOps.gather copies the same bytes whatever word it picks, including strided views and views
    whose offset only a narrower word divides."""
    from kvconnectors.mover.device import CpuOps, same_words

    gen = torch.Generator().manual_seed(1)
    base = torch.randint(0, 255, (2, *shape[:-1], shape[-1] * torch.empty((), dtype=dtype).element_size()),
                         dtype=torch.uint8, generator=gen)
    src = base.view(dtype)[1]  # an offset view, like one layer of a K/V-split cache
    assert same_words(src, torch.empty_like(src))[0].dtype == word
    ids = torch.tensor([4, 0, 2])
    ops = CpuOps()
    try:
        out = torch.empty((3, *shape[1:]), dtype=dtype)
        ops.enqueue(lambda: ops.gather(src, ids, out)).wait()
        assert torch.equal(out.view(torch.uint8), src.index_select(0, ids).view(torch.uint8))
        odd = src[:, :, 1:]  # the last dim now starts mid-word: a narrower word (or none) is used
        out_odd = torch.empty((3, *odd.shape[1:]), dtype=dtype)
        ops.enqueue(lambda: ops.gather(odd, ids, out_odd)).wait()
        assert torch.equal(out_odd.view(torch.uint8), odd.index_select(0, ids).contiguous().view(torch.uint8))
    finally:
        ops.close()


class _FakeCudart:
    """torch.cuda.cudart() stand-in: cudaHostRegister answers `err` (2 = cudaErrorMemoryAllocation)."""

    def __init__(self, err: int):
        self.err, self.registered, self.unregistered = err, [], []

    def cudaHostRegister(self, ptr, nbytes, flags):
        self.registered.append((ptr, nbytes))
        return self.err

    def cudaHostUnregister(self, ptr):
        self.unregistered.append(ptr)
        return 0


def _cuda_ops_without_a_gpu():
    """A CudaOps whose pin() runs as on a GPU host (its constructor needs a device; pin does not)."""
    from types import SimpleNamespace

    from kvconnectors.mover.device import CudaOps

    ops = CudaOps.__new__(CudaOps)
    ops._pinned, ops._lock, ops._warned = [], threading.Lock(), set()
    ops.stream = SimpleNamespace(synchronize=lambda: None)
    return ops


def test_an_arena_that_cannot_be_page_locked_is_said_once_naming_the_memlock_limit(monkeypatch, caplog):
    """cudaHostRegister refused (RLIMIT_MEMLOCK, a container's memlock limit): pin() says False, one
    WARNING names what, its size, the error and the RLIMIT_MEMLOCK value with how to raise it; asked
    again for the same memory it says nothing more; nothing is left to unregister."""
    import logging
    import resource

    fake = _FakeCudart(err=2)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(resource, "getrlimit", lambda which: (65536, 65536) if which == resource.RLIMIT_MEMLOCK
                        else (1024, 1024))
    ops = _cuda_ops_without_a_gpu()
    arena = np.zeros(1 << 16, np.uint8)
    with caplog.at_level(logging.WARNING, logger="kvconnectors"):
        assert ops.pin(arena, "the store's DRAM arena") is False
        assert ops.pin(arena, "the store's DRAM arena") is False
    lines = [r.getMessage() for r in caplog.records if "cannot page-lock" in r.getMessage()]
    assert len(lines) == 1, lines
    for part in ("the store's DRAM arena", "65536 B", "error 2", "RLIMIT_MEMLOCK is 65536 B", "ulimit -l",
                 "bounce"):
        assert part in lines[0], (part, lines[0])
    ops.close()
    assert fake.unregistered == []


def test_a_page_locked_arena_is_unregistered_at_close(monkeypatch):
    fake = _FakeCudart(err=0)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    ops = _cuda_ops_without_a_gpu()
    arena = np.zeros(4096, np.uint8)
    assert ops.pin(arena, "the store's DRAM arena") is True
    assert fake.registered == [(arena.ctypes.data, 4096)]
    ops.close()
    assert fake.unregistered == [arena.ctypes.data]
