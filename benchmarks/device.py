"""Device benchmark: the mover's Stager (engine KV blocks -> the DRAM arena of a real TieredStore) and
Loader (host rows -> a second cache) on FlashAttention-shaped bf16 caches of an 8B-class model, side by
side with the plain copies they stand in for, in the same run:

  stage    Stager.stage + complete: one batched gather per layer (one for all layers: cross-layer
           layouts on CUDA) on the copy stream into the store's arena slots, xxh3 of every row (layer i
           hashed while layer i+1 copies), commit
  stage_raw  the same with the Stager's checksums off: the mover's own cost, without the integrity
           check (xxh3 is memory-bound on a CPU and holds the GIL: it is most of stage's extra time)
  gather   torch.index_select of the same blocks into a host tensor (page-locked on CUDA)
  load     Loader.load + its event: one batched scatter per layer from page-locked host rows
  scatter  the same rows into the same blocks: index_copy_ on CUDA, numpy fancy assignment on CPU
  CUDA only:
  d2h/h2d  a page-locked host <-> device copy_ of the same bytes: the ceiling the GB/s are put against
  forward  a bf16 matmul loop on the default stream, alone and with staging running beside it on the
           copy stream: how much staging slows the forward pass

Caches: 32 layers x 8 KV heads x 16-token blocks x content 256 (K and V of head 128), bf16: 64 KiB per
(layer, block), one allocation with the strides of the chosen KVCacheLayout
(kvconnectors.mover.shapes.synthetic_caches), seeded random bytes. A transfer moves --blocks scattered
blocks of every layer; the caches hold twice as many. --quick: 4 layers, 8 blocks, 2 rounds.

Timing: on CUDA, CUDA events on the copy stream (stage: recorded before stage() and after complete()
returned, so the host's checksums and commit are in it); on CPU, time.perf_counter. Each round runs the
four paths in a rotated order; warm-up rounds are not timed. GB = 1e9 bytes.

Verified after the timed rounds: the destination's target blocks are scribbled over, then staged, read
back from the store and loaded once more; they must equal the source byte for byte (uint8 views), the
other blocks must be unchanged and every row read back must match the checksum Stager.complete gave.
Exit status 1 with the first differences otherwise. --corrupt (the negative control) flips one byte of
a staged row in the store's arena first: that run must fail.

Imports torch, numpy and kvconnectors.mover / kvconnectors.store (msgspec, xxhash): no vLLM.

LayoutRun (the caches, store, Stager, Loader, the plain copies and their per-path checks) is also
what `kvconnectors bench transfer --paths mover` times, on CPU caches of its preset's geometry.

Usage:  python -m kvconnectors.benchmarks.device --device cpu --quick
        kvconnectors bench device --device cuda --layout all --blocks 256
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
import time
from typing import Any, Callable

import numpy as np

from kvconnectors.benchmarks.common import (DEFAULT_OUT, add_results_argument, bar_chart, fmt, host_info,
                                            module_main, progress, publish, ratio, summarize, table)

# The CUDA paths (CudaOps, page-locked buffers, event timing, the forward-stream check) were written on
# a CPU-only host: set True once a GPU run has checked them.
CUDA_VALIDATED = False
MODEL = {"about": "8B-class (Llama-3-8B-like)", "num_layers": 32, "kv_heads": 8, "head_size": 128,
         "block_size": 16, "content": 256, "dtype": "bfloat16", "backend": "FLASH_ATTN"}
QUICK = {"num_layers": 4, "blocks": 8, "iters": 2, "warmup": 1}
PATHS = ("stage", "stage_raw", "gather", "load", "scatter")
BASELINE = {"stage": "gather", "stage_raw": "gather", "load": "scatter"}
MATMUL_N = 4096


def _layouts(text: str) -> list[str]:
    from kvconnectors.mover.geometry import LAYOUTS  # torch-free names would do, but one source

    if text == "all":
        return list(LAYOUTS)
    out = [x.strip().upper() for x in text.split(",") if x.strip()]
    bad = [x for x in out if x not in LAYOUTS]
    if bad or not out:
        raise ValueError(f"unknown layout(s) {bad or text!r}: choose from {', '.join(LAYOUTS)} or all")
    return out


class Clock:
    """Seconds a call takes: CUDA events on `stream` (recorded around the call, so device work the call
    enqueued there and host work it waited for both count), or perf_counter on CPU."""

    def __init__(self, torch_mod: Any, cuda: bool, stream: Any = None):
        self.torch, self.cuda, self.stream = torch_mod, cuda, stream

    def time(self, fn: Callable[[], Any]) -> float:
        if not self.cuda:
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
        torch = self.torch
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(self.stream)
        fn()
        end.record(self.stream)
        end.synchronize()
        return start.elapsed_time(end) / 1e3


class LayoutRun:
    """Source and destination caches of one layout, a store, a Stager and a Loader, and the plain copies.
    Shared by `bench device` (MODEL's shape, any device) and `bench transfer`'s mover rows (the preset's
    shape on CPU, its block table): `heads`, `block_size`, `content` and `dtype` shape the caches
    (FlashAttention: content = 2 x head size), `ids` are the moved blocks of `cache_blocks` per layer
    (default: a random `blocks` of 2 x blocks)."""

    def __init__(self, layout: str, device: str, num_layers: int, blocks: int, seed: int, *,
                 heads: int = MODEL["kv_heads"], block_size: int = MODEL["block_size"],
                 content: int = MODEL["content"], dtype: Any = None, backend: str = MODEL["backend"],
                 ids: Any = None, cache_blocks: int | None = None):
        import torch

        from kvconnectors.mover import Loader, Stager, describe_kv_caches, ops_for
        from kvconnectors.mover.shapes import synthetic_caches
        from kvconnectors.store import TieredStore
        from kvconnectors.store.config import StoreConfig

        self.torch, self.layout, self.device = torch, layout, device
        self.cuda = device == "cuda"
        self.num_layers, self.blocks = num_layers, blocks
        self.cache_blocks = cache_blocks or 2 * blocks
        shape = dict(num_layers=num_layers, num_blocks=self.cache_blocks, heads=heads, block_size=block_size,
                     content=content, dtype=torch.bfloat16 if dtype is None else dtype, device=device)
        self.src = synthetic_caches(layout, seed=seed, **shape)
        self.dst = synthetic_caches(layout, seed=seed + 1, **shape)
        kw = dict(block_size=block_size, layout=layout, backend=backend, cache_dtype="auto")
        self.g = describe_kv_caches(self.src, **kw)
        self.gd = describe_kv_caches(self.dst, **kw)
        self.ops = ops_for(self.g.device)
        self.rows_n = num_layers * blocks
        self.nbytes = self.rows_n * self.g.block_bytes
        # room for two entries: the one being staged and one more (a kept or verifying entry; ttl: never expires here)
        self.store = TieredStore(StoreConfig(slot_bytes=self.g.block_bytes, dram_bytes=2 * self.nbytes,
                                             lease_ttl_s=86400.0))
        self.stager = Stager(self.g, self.store, self.ops)
        self.loader = Loader(self.gd, self.ops)
        if ids is None:
            ids = np.random.default_rng(seed).permutation(self.cache_blocks)[:blocks]  # a scattered block table
        self.ids_np = np.asarray(ids, dtype=np.int64)
        if self.ids_np.shape != (blocks,) or np.unique(self.ids_np).size != blocks \
                or not 0 <= self.ids_np.min() <= self.ids_np.max() < self.cache_blocks:
            raise ValueError(f"ids must be {blocks} distinct block ids below {self.cache_blocks}")
        self.ids = self.ops.index(self.ids_np)
        self.others_np = np.setdiff1d(np.arange(self.cache_blocks), self.ids_np)
        self.layers = list(range(num_layers))
        inner = tuple(self.g.views[0].shape[1:])
        self.host = torch.empty((num_layers, blocks, *inner), dtype=torch.uint8, pin_memory=self.cuda)
        self.rows = self.loader.landing_buffer(self.rows_n)
        self.rows_t = torch.from_numpy(self.rows).view(num_layers, blocks, *inner)
        self.stream = getattr(self.ops, "stream", None)
        self.clock = Clock(torch, self.cuda, self.stream)
        self._keys = itertools.count()
        self._keep = False  # armed by clear("stage"/"stage_raw"): the next stage keeps its entry for check()
        self.kept: tuple[str, Any, bool] | None = None  # (key, checksums, checksummed) of that entry
        self._untouched: list[Any] | None = None
        # the rows every load moves: one staged entry, read back once
        key = self._stage_entry()
        self.store.read_into(key, self.layers, 0, self.rows)
        self.store.release(key)

    # -------------------------------------------------------------------------------- the paths
    def _stage_entry(self) -> str:
        key = f"e{next(self._keys)}"
        self.store.create(key, self.num_layers, self.blocks)
        self.sums = self.stager.complete(self.stager.stage(key, self.layers, 0, self.ids_np))
        self.store.seal(key)
        return key

    def stage(self) -> float:
        key = f"e{next(self._keys)}"
        self.store.create(key, self.num_layers, self.blocks)  # bookkeeping the connector does up front

        def run() -> None:
            self.sums = self.stager.complete(self.stager.stage(key, self.layers, 0, self.ids_np))
        keep, self._keep = self._keep, False
        try:
            return self.clock.time(run)
        finally:
            self.store.seal(key)
            if keep:
                self._drop_kept()
                self.kept = (key, self.sums, self.stager.checksum)
            else:
                self.store.release(key)

    def stage_raw(self) -> float:
        self.stager.checksum = False
        try:
            return self.stage()
        finally:
            self.stager.checksum = True

    def gather(self) -> float:
        torch = self.torch

        def run() -> None:
            if self.cuda:
                with torch.cuda.stream(self.stream):
                    for layer in self.layers:
                        self.host[layer].copy_(self.g.views[layer].index_select(0, self.ids), non_blocking=True)
            else:
                for layer in self.layers:
                    torch.index_select(self.g.views[layer], 0, self.ids, out=self.host[layer])
        return self.clock.time(run)

    def gather_words(self) -> float:
        """CPU: the plain gather of the same bytes viewed as the widest integer word (what CpuOps.gather
        does), the strongest plain gather we know: the mover's own overhead shows against it."""
        assert not self.cuda, "gather_words is a CPU baseline"

        def run() -> None:  # CpuOps.gather itself, on this thread: no copy thread, no store, no checksums
            for layer in self.layers:
                self.ops.gather(self.g.views[layer], self.ids, self.host[layer])
        return self.clock.time(run)

    def load(self) -> float:
        return self.clock.time(lambda: self.loader.load(self.rows, self.layers, self.ids_np).wait())

    def scatter(self) -> float:
        torch = self.torch

        def run() -> None:
            if self.cuda:
                with torch.cuda.stream(self.stream):
                    for layer in self.layers:
                        self.gd.views[layer].index_copy_(0, self.ids,
                                                         self.rows_t[layer].to(self.device, non_blocking=True))
            else:  # numpy's fancy assignment: the fastest plain CPU scatter (index_copy_ is bytewise on uint8)
                ids = self.ids.numpy()
                for layer in self.layers:
                    self.gd.views[layer].numpy()[ids] = self.rows_t[layer].numpy()
        return self.clock.time(run)

    # -------------------------------------------------------------------------------- per-path checks
    # (bench transfer: clear(path), one timed run of the path, check(path) -> problems, [] when byte-exact)
    MOVED = {"stage": "store", "stage_raw": "store", "gather": "host", "gather_words": "host", "load": "dst",
             "scatter": "dst"}

    def clear(self, path: str) -> None:
        """Make the next run of `path` land on known-wrong bytes, so check() sees what it moved."""
        where = self.MOVED[path]
        if where == "store":
            self._keep = True
        elif where == "host":
            self.host.fill_(0xA5)
        else:
            for v in self.gd.views:
                v.index_fill_(0, self.ids, 0xA5)
            other_ids = self.ops.index(self.others_np)
            self._untouched = [v.index_select(0, other_ids).clone() for v in self.gd.views]
        if self.cuda:
            self.torch.cuda.synchronize()

    def check(self, path: str, corrupt: bool = False) -> list[str]:
        """Problems with what the last run of `path` landed ([] = byte-exact): gather's host tensor and
        stage's entry (read back from the store) must equal the source's blocks (and, checksummed, match
        the sums Stager.complete gave); load's and scatter's destination blocks must equal the rows, the
        other blocks unchanged. corrupt (stage paths; the negative control) flips a byte of the entry first."""
        torch = self.torch
        if self.cuda:
            torch.cuda.synchronize()
        where = self.MOVED[path]
        if where == "host":
            return self._differ(path, [self.g.views[i].index_select(0, self.ids) for i in self.layers],
                                [self.host[i] for i in self.layers], "source")
        if where == "dst":
            problems = self._differ(path, [self.rows_t[i] for i in self.layers],
                                    [self.gd.views[i].index_select(0, self.ids) for i in self.layers], "rows")
            if self._untouched is not None:
                other_ids = self.ops.index(self.others_np)
                problems += [f"{path}: layer {i}: blocks that were not moved changed" for i in self.layers
                             if not torch.equal(self.gd.views[i].index_select(0, other_ids), self._untouched[i])]
            self._untouched = None
            return problems
        if self.kept is None:
            return [f"{path}: no staged entry was kept to check (clear('{path}') before the run)"]
        key, sums, checksummed = self.kept
        if corrupt:
            self.flip_staged(key)
        rows = self.loader.landing_buffer(self.rows_n)
        try:
            self.store.read_into(key, self.layers, 0, rows)
            got = torch.from_numpy(rows).view(self.host.shape)
            problems = self._differ(path, [self.g.views[i].index_select(0, self.ids) for i in self.layers],
                                    [got[i] for i in self.layers], "source")
            if checksummed:
                problems += self._bad_sums(path, rows, sums)
        finally:
            self.loader.release_buffer(rows)
            self._drop_kept()
        return problems

    def flip_staged(self, key: str) -> dict[str, int]:
        """The negative control: flip byte 17 of the middle layer's middle block of a staged entry in the arena."""
        layer, j = self.num_layers // 2, self.blocks // 2
        with self.store.pinned_views(key) as pv:
            slot = pv.slot_index(layer, j)
        self.store.arena_slots()[slot, 17] ^= 0x01
        return {"layer": layer, "block": int(self.ids_np[j]), "byte": 17}

    def _bad_sums(self, what: str, rows: np.ndarray, sums: Any) -> list[str]:
        import xxhash

        n = self.blocks
        bad = [(k // n, int(self.ids_np[k % n])) for k in range(self.rows_n)
               if xxhash.xxh3_64_intdigest(rows[k]) != int(sums.reshape(-1)[k])]
        return [f"{what}: {len(bad)} row(s) read back from the store do not match the checksum Stager.complete "
                f"returned (first: layer {bad[0][0]}, block {bad[0][1]})"] if bad else []

    def _differ(self, what: str, want: list[Any], got: list[Any], of: str) -> list[str]:
        """Per layer, the moved blocks of `got` that are not byte-equal to `want` (uint8 [blocks, ...])."""
        n, torch, out = self.blocks, self.torch, []
        for layer, (w, g) in enumerate(zip(want, got)):
            w, g = w.reshape(n, -1), g.reshape(n, -1)
            if not torch.equal(w, g):  # uint8: exact
                per_block = (w != g).sum(dim=1).cpu().numpy()
                bad = np.flatnonzero(per_block)
                out.append(f"{what}: layer {layer}: {bad.size} of {n} moved blocks differ from the {of} (first: "
                           f"block {int(self.ids_np[bad[0]])}, {int(per_block[bad[0]])} byte(s))")
        return out

    def _drop_kept(self) -> None:
        if self.kept is not None:
            self.store.release(self.kept[0])
            self.kept = None

    # -------------------------------------------------------------------------------- CUDA only
    def peaks(self, iters: int) -> dict[str, float | None]:
        """GB/s of a page-locked host <-> device copy_ of the same bytes, on the copy stream."""
        torch = self.torch
        dev = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
        host = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=True)

        def d2h() -> None:
            with torch.cuda.stream(self.stream):
                host.copy_(dev, non_blocking=True)

        def h2d() -> None:
            with torch.cuda.stream(self.stream):
                dev.copy_(host, non_blocking=True)
        d2h(), h2d()
        out = {}
        for name, fn in (("d2h", d2h), ("h2d", h2d)):
            times = [self.clock.time(fn) for _ in range(max(3, iters))]
            out[f"{name}_gbps"] = self.nbytes / float(np.median(times)) / 1e9
        return out

    def forward_slowdown(self, stage_s: float, reps: int) -> dict[str, Any]:
        """A matmul loop on the default stream, alone and with one staging copy enqueued just before it
        on the copy stream; the loop is sized to last ~1.5x the staging time, so the copy runs inside it."""
        torch = self.torch
        a = torch.randn(MATMUL_N, MATMUL_N, device=self.device, dtype=torch.bfloat16)
        b = torch.randn(MATMUL_N, MATMUL_N, device=self.device, dtype=torch.bfloat16)
        c = torch.empty_like(a)
        fwd = torch.cuda.current_stream()

        def loop(k: int) -> None:
            for _ in range(k):
                torch.matmul(a, b, out=c)

        def timed(k: int, with_stage: bool) -> tuple[float, bool | None]:
            torch.cuda.synchronize()
            key = copy = None
            if with_stage:
                key = f"e{next(self._keys)}"
                self.store.create(key, self.num_layers, self.blocks)
                copy = self.stager.stage(key, self.layers, 0, self.ids_np)  # returns at once: copy stream busy
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(fwd)
            loop(k)
            end.record(fwd)
            end.synchronize()
            inside = None
            if copy is not None:
                inside = copy.event.done()  # the copy had finished when the loop did
                self.stager.complete(copy)
                self.store.seal(key)
                self.store.release(key)
            return start.elapsed_time(end) / 1e3, inside

        loop(3)
        one = timed(10, False)[0] / 10
        k = int(min(20000, max(10, math.ceil(1.5 * stage_s / max(one, 1e-6)))))
        alone, beside, inside = [], [], []
        for _ in range(max(3, reps)):
            alone.append(timed(k, False)[0])
            t, ok = timed(k, True)
            beside.append(t)
            inside.append(ok)
        med_alone, med_beside = float(np.median(alone)), float(np.median(beside))
        return {"matmul": f"{MATMUL_N}x{MATMUL_N} bf16", "matmuls_per_loop": k, "alone_s": med_alone,
                "with_staging_s": med_beside, "slowdown": ratio(med_beside, med_alone),
                "staging_inside_loop": all(bool(x) for x in inside), "raw": {"alone": alone, "with": beside}}

    # -------------------------------------------------------------------------------- verification
    def verify(self, corrupt: bool) -> dict[str, Any]:
        """Scribble the target blocks, stage them, read them back, load them: byte-exact or problems."""
        torch = self.torch
        n = self.blocks
        self.clear("load")  # the destination's target blocks scribbled, the others remembered
        key = f"e{next(self._keys)}"
        self.store.create(key, self.num_layers, n)
        sums = self.stager.complete(self.stager.stage(key, self.layers, 0, self.ids_np))
        self.store.seal(key)
        flipped = self.flip_staged(key) if corrupt else None  # the negative control: one staged byte goes bad
        rows = self.loader.landing_buffer(self.rows_n)
        try:
            self.store.read_into(key, self.layers, 0, rows)
            bad_sums = self._bad_sums("store", rows, sums)
            self.loader.load(rows, self.layers, self.ids_np).wait()
        finally:
            self.loader.release_buffer(rows)
            self.store.release(key)
        if self.cuda:
            torch.cuda.synchronize()
        problems = [p.split(": ", 1)[1] for p in
                    self._differ("dst", [self.g.views[i].index_select(0, self.ids) for i in self.layers],
                                 [self.gd.views[i].index_select(0, self.ids) for i in self.layers], "source")]
        other_ids = self.ops.index(self.others_np)
        problems += [f"layer {i}: blocks that were not moved changed" for i in self.layers
                     if not torch.equal(self.gd.views[i].index_select(0, other_ids), self._untouched[i])]
        self._untouched = None
        problems += [p.split(": ", 1)[1] for p in bad_sums]
        return {"ok": not problems, "problems": problems, "bytes": self.nbytes, "checksummed_rows": self.rows_n,
                "corrupted": flipped}

    def close(self) -> None:
        self._drop_kept()
        self.loader.release_buffer(self.rows)
        self.ops.close()  # CUDA: drains the copy stream and unregisters the arena before it is unmapped
        self.store.close()


def run_layout(layout: str, device: str, num_layers: int, blocks: int, iters: int, warmup: int, seed: int,
               corrupt: bool, bar: Any) -> dict[str, Any]:
    r = LayoutRun(layout, device, num_layers, blocks, seed)
    try:
        fns = {"stage": r.stage, "stage_raw": r.stage_raw, "gather": r.gather, "load": r.load, "scatter": r.scatter}
        times: dict[str, list[float]] = {p: [] for p in PATHS}
        for rnd in range(warmup + iters):
            order = PATHS[rnd % len(PATHS):] + PATHS[:rnd % len(PATHS)]
            for p in order:
                t = fns[p]()
                if rnd >= warmup:
                    times[p].append(t)
            bar.update(1)
        tokens = blocks * MODEL["block_size"]
        paths = {p: {**summarize(times[p], r.nbytes, tokens), "times_s": times[p]} for p in PATHS}
        ratios = {f"{p}_vs_{b}": ratio(paths[p]["gbps_median"], paths[b]["gbps_median"]) for p, b in BASELINE.items()}
        cuda: dict[str, Any] = {}
        if r.cuda:
            peaks = r.peaks(iters)
            cuda = {"peak": peaks,
                    "stage_vs_d2h_peak": ratio(paths["stage"]["gbps_median"], peaks["d2h_gbps"]),
                    "gather_vs_d2h_peak": ratio(paths["gather"]["gbps_median"], peaks["d2h_gbps"]),
                    "load_vs_h2d_peak": ratio(paths["load"]["gbps_median"], peaks["h2d_gbps"]),
                    "scatter_vs_h2d_peak": ratio(paths["scatter"]["gbps_median"], peaks["h2d_gbps"]),
                    "forward": r.forward_slowdown(paths["stage"]["median_s"], iters)}
        verified = r.verify(corrupt)
        bar.update(1)
        return {"layout": layout, "geometry": r.g.describe(), "cross_layer": r.g.cross_layer,
                "all_layer_gather": r.stager.all_layer_gather, "arena_pinned": r.stager.arena_pinned,
                "bytes_per_transfer": r.nbytes, "paths": paths, "ratios": ratios, "cuda": cuda, "verified": verified}
    finally:
        r.close()


def run_device(device: str | None = None, layouts: str = "LBHNC", blocks: int | None = None,
               num_layers: int | None = None, iters: int | None = None, warmup: int | None = None,
               quick: bool = False, seed: int = 0, corrupt: bool = False, out: str | None = None,
               show_progress: bool = True, quiet: bool = False, results_dir: str | None = None) -> dict[str, Any]:
    import torch

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda, but torch.cuda.is_available() is False on this host")
    names = _layouts(layouts)
    num_layers = num_layers or (QUICK["num_layers"] if quick else MODEL["num_layers"])
    blocks = blocks or (QUICK["blocks"] if quick else 128)
    iters = iters or (QUICK["iters"] if quick else 5)
    warmup = QUICK["warmup"] if warmup is None else warmup
    for name, v, low in (("--blocks", blocks, 1), ("--layers", num_layers, 2), ("--iters", iters, 1),
                         ("--warmup", warmup, 0)):
        if v < low:
            raise ValueError(f"{name} must be >= {low}, got {v}")
    t0 = time.monotonic()
    bar = progress(len(names) * (warmup + iters + 1), f"device {device}", show_progress)
    try:
        runs = {name: run_layout(name, device, num_layers, blocks, iters, warmup, seed, corrupt, bar)
                for name in names}
    finally:
        bar.close()
    verified = all(x["verified"]["ok"] for x in runs.values())
    result = {
        "benchmark": "device",
        "config": {"device": device, "device_name": torch.cuda.get_device_name() if device == "cuda" else None,
                   "torch": torch.__version__, "cuda_paths_validated": CUDA_VALIDATED, "model": MODEL,
                   "num_layers": num_layers, "blocks": blocks, "cache_blocks": 2 * blocks,
                   "tokens": blocks * MODEL["block_size"], "iters": iters, "warmup": warmup, "quick": quick,
                   "seed": seed, "corrupt": corrupt, "layouts": names, "gb": "1e9 bytes",
                   "timer": "CUDA events on the copy stream" if device == "cuda" else "time.perf_counter",
                   "checksums": "xxh3 of every row (Stager.complete)"},
        "host": host_info(),
        "layouts": runs,
        "verified": verified,
        "problems": [f"{n}: {p}" for n, x in runs.items() for p in x["verified"]["problems"]],
        "wall_s": time.monotonic() - t0,
    }
    stem = f"device_{device}_{'all' if len(names) == len(_layouts('all')) else '_'.join(names)}_{blocks}b" \
           + ("_corrupt" if corrupt else "")
    return publish(result, out, stem, _plot, render, quiet, results_dir)


def render(result: dict[str, Any]) -> str:
    c = result["config"]
    m = c["model"]
    first = next(iter(result["layouts"].values()))
    slot = first["geometry"]["block_bytes"]
    head = [f"kvconnectors bench device: {c['device']}"
            + (f" ({c['device_name']})" if c.get("device_name") else "") + f", torch {c['torch']}; timer "
            f"{c['timer']}",
            "CUDA paths: " + ("validated on a GPU" if c["cuda_paths_validated"] else
                              "NOT yet validated on a GPU (written on a CPU-only host)")
            + ("" if c["device"] == "cuda" else "; this run used the CPU twin (CpuOps: a copy thread)"),
            f"caches: {m['about']}, {c['num_layers']} layers x {m['kv_heads']} KV heads x {m['block_size']}-token "
            f"blocks x content {m['content']} (head {m['head_size']}, K+V) {m['dtype']} = {slot // 1024} KiB per "
            f"(layer, block); {c['blocks']} of {c['cache_blocks']} blocks per transfer ({c['tokens']} tokens, "
            f"{first['bytes_per_transfer'] / 2**20:.1f} MiB); {c['iters']} timed rounds + {c['warmup']} warm-up"
            + ("; --quick" if c["quick"] else "")]
    rows = []
    notes = {"stage": "Stager.stage+complete -> TieredStore arena, xxh3 of every row",
             "stage_raw": "the same without the checksums: the mover's own cost",
             "gather": "torch.index_select into a host tensor" + (" (page-locked)" if c["device"] == "cuda" else ""),
             "load": "Loader.load + event: one scatter per layer from host rows",
             "scatter": ("index_copy_" if c["device"] == "cuda" else "numpy fancy assignment") + " of the same rows"}
    for name, x in result["layouts"].items():
        for i, p in enumerate(PATHS):
            s = x["paths"][p]
            vs = x["ratios"].get(f"{p}_vs_{BASELINE[p]}") if p in BASELINE else None
            rows.append([name if i == 0 else "", p, s["median_s"] * 1e3, s["gbps_median"], s["gbps_p99"],
                         vs if p in BASELINE else "-", notes[p]])
    t = table(["layout", "path", "ms med", "GB/s med", "GB/s p99", "vs plain", "what"], rows, align="llrrrrl")
    extra = []
    for name, x in result["layouts"].items():
        path = ("one gather for all layers" if x["all_layer_gather"] else "one gather per layer") + \
               ("" if x["arena_pinned"] else "; arena NOT page-locked: every row bounced")
        extra.append(f"{name}: stage {fmt(x['ratios']['stage_vs_gather'])}x the plain gather's GB/s "
                     f"({fmt(x['ratios']['stage_raw_vs_gather'])}x without checksums), load "
                     f"{fmt(x['ratios']['load_vs_scatter'])}x the plain scatter's ({path})")
        cu = x.get("cuda") or {}
        if cu:
            pk, fw = cu["peak"], cu["forward"]
            extra.append(f"  vs page-locked copy_ peak: d2h {fmt(pk['d2h_gbps'])} GB/s (stage "
                         f"{fmt(cu['stage_vs_d2h_peak'])}, gather {fmt(cu['gather_vs_d2h_peak'])}), h2d "
                         f"{fmt(pk['h2d_gbps'])} GB/s (load {fmt(cu['load_vs_h2d_peak'])}, scatter "
                         f"{fmt(cu['scatter_vs_h2d_peak'])})")
            extra.append(f"  forward stream: {fw['matmuls_per_loop']} x {fw['matmul']} matmul "
                         f"{fmt(fw['alone_s'] * 1e3)} ms alone, {fmt(fw['with_staging_s'] * 1e3)} ms with staging "
                         f"beside it: slowdown {fmt(fw['slowdown'], 3)}x (staging done inside the loop: "
                         f"{fmt(fw['staging_inside_loop'])})")
    for name, x in result["layouts"].items():
        v = x["verified"]
        if v["ok"]:
            extra.append(f"verified {name}: {v['bytes'] / 2**20:.1f} MiB byte-exact in the destination, "
                         f"{v['checksummed_rows']} row checksums match")
        else:
            extra.append(f"VERIFY FAILED {name}: " + "; ".join(v["problems"]))
        if v.get("corrupted"):
            f = v["corrupted"]
            extra.append(f"  (--corrupt: flipped byte {f['byte']} of layer {f['layer']} block {f['block']} "
                         "in the arena)")
    files = result.get("files", {})
    if files:
        extra.append(f"JSON {files.get('json')}\nPNG  {files.get('png')}")
    return "\n".join(head + ["", t, ""] + extra)


def _plot(result: dict[str, Any], path: Any) -> None:
    labels, med, low, colors = [], [], [], []
    for name, x in result["layouts"].items():
        for p in PATHS:
            labels.append(f"{name} {p}")
            med.append(x["paths"][p]["gbps_median"])
            low.append(x["paths"][p]["gbps_p99"])
            colors.append("#1f77b4" if p in BASELINE else "#9e9e9e")
    c = result["config"]
    bar_chart(path, labels, med, low, colors,
              title=f"mover on {c['device']}: Stager/Loader vs plain gather/scatter, {c['num_layers']} layers x "
                    f"{c['blocks']} blocks",
              legend=[("mover (Stager / Loader)", "#1f77b4"), ("plain torch copy", "#9e9e9e")])


# ============================================================================== command line
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=["cuda", "cpu"], default=None,
                        help="where the caches live (default: cuda when available, else cpu)")
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK['num_layers']} layers, {QUICK['blocks']} blocks, {QUICK['iters']} rounds: "
                             "a few seconds on a CPU")
    parser.add_argument("--layout", default="LBHNC",
                        help="KVCacheLayout of the caches, a comma list, or all (LBHNC LBNHC LHBNC BLHNC BLNHC BHLNC)")
    parser.add_argument("--blocks", type=int, default=None,
                        help="blocks of every layer per transfer (default 128 = 2048 tokens; --quick 8)")
    parser.add_argument("--layers", type=int, default=None, help="layers (default 32; --quick 4)")
    parser.add_argument("--iters", type=int, default=None, help="timed rounds (default 5; --quick 2)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed rounds first (default 1)")
    parser.add_argument("--seed", type=int, default=0, help="cache contents and block table seed")
    parser.add_argument("--corrupt", action="store_true",
                        help="negative control (tests): flip one staged byte in the store before the verifying "
                             "load; the run must then fail verification and exit 1")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="output directory for the JSON and PNG")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    add_results_argument(parser)


def run(args: argparse.Namespace) -> int:
    try:
        result = run_device(device=args.device, layouts=args.layout, blocks=args.blocks, num_layers=args.layers,
                            iters=args.iters, warmup=args.warmup, quick=args.quick, seed=args.seed,
                            corrupt=args.corrupt, out=args.out, show_progress=not args.no_progress,
                            results_dir=args.results_dir)
    except ValueError as exc:
        print(f"kvconnectors bench device: {exc}", file=sys.stderr)
        return 2
    if not result["verified"]:
        print("kvconnectors bench device: VERIFY FAILED: the bytes moved are not the bytes staged:\n  "
              + "\n  ".join(result["problems"]), file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    return module_main("kvconnectors.benchmarks.device", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
