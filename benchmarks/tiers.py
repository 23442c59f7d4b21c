"""Tier benchmark: the TieredStore's spill (DRAM -> NVMe) and restore (NVMe -> DRAM) throughput beside
raw O_DIRECT writes and reads of the same bytes, in the same run, on the same filesystem.

Store side (public API only for the timing; stats are a cross-check):
  fill     create / write each layer / seal entries until the DRAM arena is full (not timed)
  spill    create as many bytes of new entries again: each create() spills the oldest sealed idle
           entries to NVMe. Timed: the wall clock of those create() calls (victim choice, extent
           allocation, the I/O, the bookkeeping -- all of the store's spill work), not the staging
           memcpys between them. GB/s = delta spill_bytes / summed create() time.
  restore  release the new entries (DRAM is free again), drop the NVMe file's page cache, then
           pinned_views() each spilled entry, which brings it back into DRAM. Timed: the wall clock
           of entering each pinned_views() (all of the restore). The restored bytes are checked.
  The store's own spill_seconds / restore_seconds (its I/O timers) are reported as a diagnostic.
Raw side: the same number of bytes written, then read back cold, with os.pwritev / os.preadv on a
file of the same size as the store's extent file, opened in the store's NVMe mode (O_DIRECT exactly
when the store got O_DIRECT), in I/Os of the store's largest coalesced I/O (max_io_bytes), with
io_threads I/Os in flight (a thread pool, as the store's NVMe tier does). Timed: the I/O loop only.

Same memory on both sides: the raw buffer is a private anonymous mapping with the same transparent-
huge-page hint as the store's DRAM arena. (A shared anonymous mapping -- mmap.mmap(-1, n)'s default --
is shmem, which gets no THP with shmem_enabled=never: O_DIRECT then pins 4 KiB pages, and the block
layer splits each I/O into more, smaller requests. On a virtio disk that made the raw side ~1.6x
slower and the store look faster than the disk.) The mapping kind and THP state of both buffers are
read from /proc/self/smaps and recorded; the run's "fairness" checks require the same bytes on both
sides in every round, the same NVMe mode (direct/buffered) and the same kind of memory, else the
store / raw ratios are reported as invalid.

Cold reads: before each restore / raw read, the files' cached pages are dropped with
posix_fadvise(POSIX_FADV_DONTNEED) (after fdatasync). With O_DIRECT (the store's default wherever the
filesystem accepts it) the page cache is bypassed anyway, so this only matters in buffered mode.

Each round runs the store, the raw baseline and a diagnostic raw variant that waits for each entry's
worth of I/Os before the next (the store keeps I/Os in flight only within one call; for writes it also
does an entry's staging memcpy between waves, off the clock, as the spill phase does), in an order
rotated every round, so drift on a shared box hits all alike. A warm-up round comes first (untimed):
the first writes land in fallocated-but-unwritten extents, which costs extent conversions.

Usage:  python -m kvconnectors.benchmarks.tiers --bytes 256MiB --rounds 3
        kvconnectors bench tiers --dir /mnt/nvme0/tmp
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import numpy as np

from kvconnectors.benchmarks.common import (DEFAULT_OUT, add_results_argument, bar_chart, host_info, module_main,
                                            progress, publish, ratio, table)
from kvconnectors.benchmarks.models import PRESETS
from kvconnectors.store.buffers import aligned_zeros

TARGET = 0.8


def _aligned(nbytes: int) -> tuple[mmap.mmap, np.ndarray]:
    """Page-aligned memory of the same kind as the store's DRAM arena (kvconnectors.store.arena without
    shm_name): a *private* anonymous mapping with the transparent-huge-page hint, faulted in now. Not
    mmap.mmap(-1, n)'s default MAP_SHARED: that is shmem, which gets 4 KiB pages (no THP unless
    shmem_enabled allows it), and O_DIRECT from 4 KiB pages is markedly slower (more pages to pin, more
    and smaller block requests) -- a handicap the store's arena does not have. The store's own helper,
    so the two sides cannot drift apart."""
    return aligned_zeros(nbytes)


def memory_backing(address: int, nbytes: int) -> dict[str, Any] | None:
    """What backs [address, address + nbytes): from /proc/self/smaps, the mappings it lies in --
    private or shared, THP-eligible, the huge-page hint, and those mappings' AnonHugePages / Rss (whole
    mappings: the kernel may merge neighbours of the same kind). None where smaps is unavailable."""
    import re

    try:
        text = open("/proc/self/smaps").read()
    except OSError:
        return None
    end = address + nbytes
    found: list[dict[str, Any]] = []
    cur: dict[str, Any] | None = None
    for line in text.splitlines():
        m = re.match(r"^([0-9a-f]+)-([0-9a-f]+) (\S{4}) ", line)
        if m:
            lo, hi = int(m.group(1), 16), int(m.group(2), 16)
            cur = None
            if lo < end and hi > address:
                cur = {"shared": m.group(3)[3] == "s", "path": line.split()[5] if len(line.split()) > 5 else "",
                       "rss": 0, "huge": 0, "thp_eligible": False, "hint": False}
                found.append(cur)
            continue
        if cur is None:
            continue
        key, _, val = line.partition(":")
        if key == "Rss":
            cur["rss"] = int(val.split()[0]) * 1024
        elif key in ("AnonHugePages", "ShmemPmdMapped", "FilePmdMapped"):
            cur["huge"] += int(val.split()[0]) * 1024
        elif key == "THPeligible":
            cur["thp_eligible"] = val.strip() == "1"
        elif key == "VmFlags":
            cur["hint"] = "hg" in val.split()
    if not found:
        return None
    shared = {f["shared"] for f in found}
    rss, huge = sum(f["rss"] for f in found), sum(f["huge"] for f in found)
    return {"kind": ("shared" if shared == {True} else "private" if shared == {False} else "mixed"),
            "file": ",".join(sorted({f["path"] for f in found if f["path"]})) or "anonymous",
            "thp_eligible": all(f["thp_eligible"] for f in found), "thp_hint": all(f["hint"] for f in found),
            "huge_fraction_of_rss": (huge / rss) if rss else 0.0}


def drop_cache(fd: int) -> None:
    """Write back and drop an open file's cached pages (a no-op for O_DIRECT data, which skips the cache)."""
    os.fdatasync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


class RawFile:
    """A preallocated file driven like the store drives its extent file: pwritev/preadv of up to
    `io_bytes` per I/O, `threads` I/Os in flight, O_DIRECT when the filesystem accepts it."""

    def __init__(self, path: str, size: int, io_bytes: int, threads: int, o_direct: object):
        self.path, self.size, self.io_bytes = path, size, io_bytes
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        os.posix_fallocate(self.fd, 0, size)
        self.direct, self.mode_reason = False, "o_direct=false"
        self.io_fd = self.fd
        if o_direct is not False and hasattr(os, "O_DIRECT"):
            try:
                dfd = os.open(path, os.O_RDWR | os.O_DIRECT | os.O_CLOEXEC)
                m, probe = _aligned(mmap.PAGESIZE)
                try:
                    os.pwritev(dfd, [probe], 0)
                    os.preadv(dfd, [probe], 0)
                finally:
                    del probe
                    m.close()
                self.io_fd, self.direct, self.mode_reason = dfd, True, "O_DIRECT accepted"
            except OSError as exc:
                if o_direct is True:
                    raise
                self.mode_reason = f"O_DIRECT refused: {exc.strerror}"
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="raw-io")

    def io(self, buf: np.ndarray, write: bool, wave_bytes: int | None = None,
           between: Callable[[], None] | None = None) -> float:
        """Move buf (page-aligned) to/from file offset 0 in io_bytes pieces; returns seconds of I/O. With
        `wave_bytes`, wait for all I/Os of each wave_bytes stretch before starting the next (the
        store's pattern: its I/Os are in flight together only within one call, i.e. one entry); with
        `between` too, call it before each wave, off the clock (the staging the store does between spills)."""
        mv = memoryview(buf).cast("B")
        fn = os.pwritev if write else os.preadv

        def one(off: int, n: int) -> None:
            done = 0
            while done < n:
                k = fn(self.io_fd, [mv[off + done:off + n]], off + done)
                if k <= 0:
                    raise OSError(f"{fn.__name__} moved {k} bytes at offset {off + done}")
                done += k

        wave = wave_bytes or len(mv)
        spent = 0.0
        for w0 in range(0, len(mv), wave):
            if between is not None:
                between()
            w1 = min(len(mv), w0 + wave)
            t0 = time.perf_counter()
            futures = [self.pool.submit(one, off, min(self.io_bytes, w1 - off)) for off in range(w0, w1, self.io_bytes)]
            for f in futures:
                f.result()
            spent += time.perf_counter() - t0
        return spent

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        if self.io_fd != self.fd:
            os.close(self.io_fd)
        os.close(self.fd)


def _rotate(items: list, r: int) -> list:
    k = r % len(items)
    return items[k:] + items[:k]


def _stamp(base: np.ndarray, i: int) -> np.ndarray:
    """The entry's bytes: the shared random block with the entry number in the first 8 bytes of each slot."""
    base[:, :, :8] = np.frombuffer(int(i).to_bytes(8, "little"), dtype=np.uint8)
    return base


def run_tiers(nbytes: int = 256 << 20, preset: str = "8b", block_tokens: int = 16, entry_tokens: int = 256,
              io_threads: int = 4, rounds: int = 3, directory: str | None = None, out: str | None = None,
              o_direct: object = "auto", max_io_bytes: int = 8 << 20, show_progress: bool = True,
              quiet: bool = False, seed: int = 0, warmup: int = 1, results_dir: str | None = None) -> dict[str, Any]:
    from kvconnectors.store import StoreConfig, TieredStore
    from kvconnectors.store.sizes import format_size

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    if warmup < 0 or rounds < 1 or io_threads < 1 or block_tokens < 1 or entry_tokens < block_tokens:
        raise ValueError("rounds, io-threads, block-tokens >= 1 and entry-tokens >= block-tokens")
    p = PRESETS[preset]
    slot = p.token_bytes_per_layer * block_tokens
    blocks = entry_tokens // block_tokens
    entry_bytes = p.num_layers * blocks * slot
    n_entries = max(1, nbytes // entry_bytes)
    budget = n_entries * entry_bytes
    io_slots = max(1, min(max_io_bytes // slot, _iov_max()))
    io_bytes = io_slots * slot  # the store's largest coalesced I/O

    parent = Path(directory) if directory else DEFAULT_OUT / "tmp"
    parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="tiers-", dir=parent))
    (work / "store").mkdir()
    rows: list[dict[str, Any]] = []
    store = raw = None
    mm_raw = None
    verified = {"restore": False, "raw_read": False}
    memory: dict[str, Any] = {}
    t_start = time.perf_counter()
    try:
        store = TieredStore(StoreConfig(slot_bytes=slot, dram_bytes=budget, nvme_dirs=[str(work / "store")],
                                        nvme_bytes=budget + entry_bytes, io_threads=io_threads, o_direct=o_direct,
                                        max_io_bytes=max_io_bytes, instance_name="benchtiers", lease_ttl_s=3600))
        # The raw file is the size of the store's one extent file (it has no name to look at: the
        # store removes it once open) and takes the NVMe mode the store actually got (O_DIRECT iff
        # the store's file has it), so the two sides can never compare direct against buffered I/O.
        store_file_bytes = store.usage()["nvme"]["capacity_bytes"]
        store_direct = set(store.nvme_io_mode.values()) == {"direct"}
        raw = RawFile(str(work / "raw.kv"), store_file_bytes, io_bytes, io_threads, store_direct)
        mm_raw, raw_buf = _aligned(budget)
        raw_buf[:] = np.random.default_rng(seed).integers(0, 256, budget, dtype=np.uint8)
        raw_expect = raw_buf.copy()
        base = np.random.default_rng(seed + 1).integers(0, 256, (p.num_layers, blocks, slot), dtype=np.uint8)
        mm_staging, staging_flat = _aligned(entry_bytes)  # the raw write diagnostic's stand-in for staging
        staging = staging_flat.reshape(base.shape)
        nvme = getattr(store, "_nvme", None)  # diagnostics only: how many I/Os the store issued

        def put(key: str, i: int) -> None:
            data = _stamp(base, i)
            store.create(key, p.num_layers, blocks)
            for layer in range(p.num_layers):
                store.write(key, layer, 0, data[layer])
            store.seal(key)

        def ios() -> tuple[int, int]:
            return (nvme.write_ios, nvme.read_ios) if nvme is not None else (0, 0)

        bar = progress((warmup + rounds) * 4, f"tiers {format_size(budget)}", show_progress)
        try:
            for r in range(warmup + rounds):
                row: dict[str, Any] = {"round": r - warmup, "warmup": r < warmup}
                olds = [f"a{r}-{i}" for i in range(n_entries)]
                news = [f"b{r}-{i}" for i in range(n_entries)]
                bar.set_postfix_str("fill")
                for i, k in enumerate(olds):
                    put(k, i)
                bar.update(1)

                # ---- spill vs raw write (and raw write in the store's per-entry waves, a diagnostic)
                def store_spill() -> None:
                    s0, w0 = store.stats.snapshot(), ios()[0]
                    spent = 0.0  # wall clock of the create() calls: all of the spill work
                    for i, k in enumerate(news):
                        data = _stamp(base, n_entries + i)
                        t0 = time.perf_counter()
                        store.create(k, p.num_layers, blocks)
                        spent += time.perf_counter() - t0
                        for layer in range(p.num_layers):  # staging the new entry: not spill work
                            store.write(k, layer, 0, data[layer])
                        store.seal(k)
                    s1 = store.stats.snapshot()
                    row["spill_bytes"] = s1["spill_bytes"] - s0["spill_bytes"]
                    row["spill_s"] = spent
                    row["spill_stats_s"] = s1["spill_seconds"] - s0["spill_seconds"]
                    row["spill_ios"] = ios()[0] - w0

                def raw_write() -> None:
                    row["raw_write_s"] = raw.io(raw_buf, write=True)

                def raw_write_waves() -> None:  # the store's pattern: one entry's I/Os, then staging
                    row["raw_write_waves_s"] = raw.io(raw_buf, write=True, wave_bytes=entry_bytes,
                                                      between=lambda: np.copyto(staging, base))

                bar.set_postfix_str("spill / raw write")
                for f in _rotate([store_spill, raw_write, raw_write_waves], r):
                    f()
                bar.update(1)
                row["spilled_entries"] = sum(1 for k in olds if store.info(k).dram_slots == 0)

                # ---- restore vs raw read, all cold
                for k in news:
                    store.release(k)

                def cold() -> None:
                    for f in getattr(nvme, "files", ()):  # the store's extent file: nameless, by descriptor
                        drop_cache(f.lock_fd)
                    drop_cache(raw.fd)

                def store_restore() -> None:
                    cold()
                    s0, r0 = store.stats.snapshot(), ios()[1]
                    spent = 0.0  # wall clock of entering pinned_views(): all of the restore work
                    for i, k in enumerate(olds):
                        t0 = time.perf_counter()
                        with store.pinned_views(k) as pv:
                            spent += time.perf_counter() - t0
                            if r == 0 and i in (0, n_entries - 1):  # check restored bytes (not timed by the stats)
                                want = _stamp(base, i)
                                for layer in range(p.num_layers):
                                    for b in range(blocks):
                                        if not np.array_equal(pv.array(layer, b), want[layer, b]):
                                            raise AssertionError(f"restored entry {k} layer {layer} block {b} differs")
                                verified["restore"] = True
                    s1 = store.stats.snapshot()
                    row["restore_bytes"] = s1["restore_bytes"] - s0["restore_bytes"]
                    row["restore_s"] = spent
                    row["restore_stats_s"] = s1["restore_seconds"] - s0["restore_seconds"]
                    row["restore_ios"] = ios()[1] - r0

                def raw_read() -> None:
                    cold()
                    raw_buf[:] = 0
                    row["raw_read_s"] = raw.io(raw_buf, write=False)
                    if not np.array_equal(raw_buf, raw_expect):
                        raise AssertionError("raw O_DIRECT read returned different bytes than were written")
                    verified["raw_read"] = True

                def raw_read_waves() -> None:
                    cold()
                    row["raw_read_waves_s"] = raw.io(raw_buf, write=False, wave_bytes=entry_bytes)

                bar.set_postfix_str("restore / raw read")
                for f in _rotate([store_restore, raw_read, raw_read_waves], r):
                    f()
                bar.update(1)
                for k in olds:
                    store.release(k)
                bar.update(1)
                row["raw_bytes"] = budget
                rows.append(row)
        finally:
            bar.close()
        io_mode = store.nvme_io_mode
        mode_reasons = store.nvme_mode_reasons
        raw_mode = {"direct": raw.direct, "reason": raw.mode_reason}
        memory = {"store_arena": memory_backing(store.arena_base_address, store.arena_bytes),
                  "raw_buffer": memory_backing(raw_buf.ctypes.data, raw_buf.nbytes)}
    finally:
        if store is not None:
            store.close()
        if raw is not None:
            raw.close()
        if mm_raw is not None:
            try:
                del raw_buf
                mm_raw.close()
            except (BufferError, NameError):
                pass
        shutil.rmtree(work, ignore_errors=True)

    result = _result(rows, locals_=dict(preset=preset, slot=slot, blocks=blocks, entry_bytes=entry_bytes,
                                        n_entries=n_entries, budget=budget, io_bytes=io_bytes, io_threads=io_threads,
                                        rounds=rounds, warmup=warmup, max_io_bytes=max_io_bytes, o_direct=o_direct,
                                        entry_tokens=entry_tokens, block_tokens=block_tokens, parent=str(parent)),
                     io_mode=io_mode, mode_reasons=mode_reasons, raw_mode=raw_mode, verified=verified,
                     wall_s=time.perf_counter() - t_start, memory=memory)
    return publish(result, out, f"tiers_{preset}_{budget >> 20}MiB", _plot, render, quiet, results_dir)


def _iov_max() -> int:
    try:
        return int(os.sysconf("SC_IOV_MAX"))
    except (ValueError, OSError):
        return 1024


def _gbps(nbytes: float, seconds: float) -> float | None:
    return nbytes / seconds / 1e9 if seconds > 0 and nbytes > 0 else None


def _stat(values: list[float | None]) -> dict[str, float | None]:
    v = [x for x in values if x is not None]
    if not v:
        return {"median": None, "min": None, "max": None}
    return {"median": float(np.median(v)), "min": float(min(v)), "max": float(max(v))}


def fairness(rows: list[dict], io_mode: dict, raw_mode: dict, memory: dict | None = None) -> dict[str, Any]:
    """Whether the store and raw sides measured comparable things: the same bytes in every round (what
    the store spilled / restored == what the raw loop wrote / read), the same NVMe mode (O_DIRECT on
    both or on neither) and the same kind of buffer memory. `ok` False makes the ratios invalid."""
    problems: list[str] = []
    for row in rows:
        for ours in ("spill", "restore"):
            if row.get(f"{ours}_bytes") != row.get("raw_bytes"):
                problems.append(f"round {row.get('round')}: {ours} moved {row.get(f'{ours}_bytes')} bytes, raw "
                                f"{row.get('raw_bytes')}")
    modes = set(io_mode.values())
    raw_label = "direct" if raw_mode.get("direct") else "buffered"
    same_mode = modes == {raw_label}
    if not same_mode:
        problems.append(f"NVMe mode: store {sorted(modes) or 'none'}, raw {raw_label}")
    same_memory: bool | None = None
    mem = memory or {}
    a, b = mem.get("store_arena"), mem.get("raw_buffer")
    if a is not None and b is not None:
        # the mapping kind and the huge-page hint (deterministic); THP eligibility / huge fraction also depend
        # on size, alignment and free memory, so they are reported, not compared
        same_memory = (a["kind"], a.get("thp_hint")) == (b["kind"], b.get("thp_hint"))
        if not same_memory:
            problems.append(f"memory: store arena {a['kind']} (THP hint {a.get('thp_hint')}), raw buffer "
                            f"{b['kind']} (THP hint {b.get('thp_hint')})")
    return {"same_bytes": bool(rows) and not any("moved" in x for x in problems), "same_io_mode": same_mode,
            "same_memory": same_memory, "ok": not problems, "problems": problems}


def _result(rows: list[dict], locals_: dict, io_mode: dict, mode_reasons: dict, raw_mode: dict, verified: dict,
            wall_s: float, memory: dict | None = None) -> dict[str, Any]:
    for row in rows:
        row["spill_gbps"] = _gbps(row.get("spill_bytes", 0), row.get("spill_s", 0))
        row["restore_gbps"] = _gbps(row.get("restore_bytes", 0), row.get("restore_s", 0))
        row["spill_stats_gbps"] = _gbps(row.get("spill_bytes", 0), row.get("spill_stats_s", 0))
        row["restore_stats_gbps"] = _gbps(row.get("restore_bytes", 0), row.get("restore_stats_s", 0))
        for k in ("raw_write", "raw_read", "raw_write_waves", "raw_read_waves"):
            row[f"{k}_gbps"] = _gbps(row["raw_bytes"], row.get(f"{k}_s", 0))
        row["spill_vs_raw"] = ratio(row["spill_gbps"], row["raw_write_gbps"])
        row["restore_vs_raw"] = ratio(row["restore_gbps"], row["raw_read_gbps"])
    timed = [r for r in rows if not r["warmup"]]
    summary = {k: _stat([r[k] for r in timed]) for k in
               ("spill_gbps", "raw_write_gbps", "raw_write_waves_gbps", "restore_gbps", "raw_read_gbps",
                "raw_read_waves_gbps", "spill_vs_raw", "restore_vs_raw", "spill_stats_gbps", "restore_stats_gbps")}
    fair = fairness(rows, io_mode, raw_mode, memory)
    comparisons = []
    for ours, base, per_round in (("spill", "raw_write", "spill_vs_raw"), ("restore", "raw_read", "restore_vs_raw")):
        r = ratio(summary[f"{ours}_gbps"]["median"], summary[f"{base}_gbps"]["median"])
        comparisons.append({"ours": ours, "baseline": base, "ratio": r, "ratio_per_round_median":
                            summary[per_round]["median"], "target": TARGET, "valid": fair["ok"],
                            "met": None if r is None or not fair["ok"] else r >= TARGET})
    c = locals_
    spill_ios = sum(r.get("spill_ios", 0) for r in timed)
    restore_ios = sum(r.get("restore_ios", 0) for r in timed)
    return {
        "benchmark": "tiers",
        "config": {"preset": c["preset"], "slot_bytes": c["slot"], "block_tokens": c["block_tokens"],
                   "entry_tokens": c["entry_tokens"], "entry_blocks": c["blocks"], "entry_bytes": c["entry_bytes"],
                   "entries_per_phase": c["n_entries"], "bytes_per_phase": c["budget"], "rounds": c["rounds"],
                   "warmup_rounds": c["warmup"], "order": "store / raw / raw-in-waves, rotated each round",
                   "io_threads": c["io_threads"], "max_io_bytes": c["max_io_bytes"], "raw_io_bytes": c["io_bytes"],
                   "o_direct": c["o_direct"], "dir": c["parent"], "gb": "1e9 bytes",
                   "timers": "store: wall clock of the create() calls that spill / of entering pinned_views() "
                             "that restore (all the store's work, not the staging memcpys); raw: the I/O loop; "
                             "*_stats_gbps: the store's own spill/restore_seconds (its I/O only)",
                   "raw_io_threads": c["io_threads"],
                   "cold_reads": "fdatasync + posix_fadvise(DONTNEED) before each read phase; O_DIRECT bypasses "
                                 "the page cache anyway"},
        "host": host_info(),
        "io_mode": {"store": io_mode, "store_reasons": mode_reasons, "raw": raw_mode},
        "memory": memory or {},
        "fairness": fair,
        "store_io_diagnostics": {  # from the store's NVMe tier counters (a private attribute; diagnostics only)
            "spill_ios": spill_ios, "restore_ios": restore_ios,
            "avg_spill_io_bytes": (sum(r.get("spill_bytes", 0) for r in timed) / spill_ios) if spill_ios else None,
            "avg_restore_io_bytes": (sum(r.get("restore_bytes", 0) for r in timed) / restore_ios) if restore_ios
            else None},
        "verified": verified,
        "rounds": rows,
        "summary": summary,
        "comparisons": comparisons,
        "wall_s": wall_s,
    }


def render(result: dict[str, Any]) -> str:
    c, s = result["config"], result["summary"]
    head = (f"tiers: {c['bytes_per_phase'] / 2**20:.0f} MiB per phase = {c['entries_per_phase']} entries x "
            f"{c['entry_bytes'] / 2**20:.1f} MiB (preset {c['preset']}, slot {c['slot_bytes'] // 1024} KiB), "
            f"{c['rounds']} rounds + {c['warmup_rounds']} warm-up, io_threads {c['io_threads']}, "
            f"I/O size <= {c['raw_io_bytes'] / 2**20:.1f} MiB; store NVMe mode {result['io_mode']['store']}, "
            f"raw {'O_DIRECT' if result['io_mode']['raw']['direct'] else 'buffered'}")
    def line(label: str, key: str, note: str = "") -> list:
        return [label, s[key]["median"], s[key]["min"], s[key]["max"], note]

    rows = [
        line("spill DRAM->NVMe (store)", "spill_gbps", "delta spill_bytes / wall of the create() calls"),
        line("  store's own spill timer", "spill_stats_gbps", "diagnostic: delta spill_seconds (I/O only)"),
        line("raw O_DIRECT write", "raw_write_gbps", "baseline: one stream, io_threads in flight"),
        line("  raw write, per-entry waves", "raw_write_waves_gbps",
             "diagnostic: per-call barrier + staging memcpy between"),
        line("restore NVMe->DRAM (store)", "restore_gbps", "delta restore_bytes / wall of pinned_views()"),
        line("  store's own restore timer", "restore_stats_gbps", "diagnostic: delta restore_seconds (I/O only)"),
        line("raw O_DIRECT read (cold)", "raw_read_gbps", "baseline: one stream, io_threads in flight"),
        line("  raw read, per-entry waves", "raw_read_waves_gbps", "diagnostic: the store's per-call barrier"),
    ]
    t1 = table(["path", "GB/s med", "GB/s min", "GB/s max", "note"], rows, align="lrrrl")
    crow = [[f"{x['ours']} / {x['baseline']}", x["ratio"], x["ratio_per_round_median"], f">= {x['target']}",
             "INVALID (sides differ)" if x.get("valid") is False else
             "-" if x["met"] is None else ("met" if x["met"] else "MISSED")] for x in result["comparisons"]]
    t2 = table(["store / raw", "ratio (med)", "ratio per round (med)", "target", "verdict"], crow, align="lrrrl")
    diag = result["store_io_diagnostics"]
    extra = []
    if diag["avg_spill_io_bytes"]:
        extra.append(f"store I/Os: spill {diag['spill_ios']} (avg {diag['avg_spill_io_bytes'] / 2**20:.2f} MiB), "
                     f"restore {diag['restore_ios']} (avg {(diag['avg_restore_io_bytes'] or 0) / 2**20:.2f} MiB)")
    fair, mem = result.get("fairness", {}), result.get("memory", {})
    if fair:
        def kind(m: dict | None) -> str:
            return "?" if not m else (f"{m['kind']} {m['file']}, THP eligible {m['thp_eligible']}, "
                                      f"{m['huge_fraction_of_rss']:.0%} huge")
        extra.append(f"same bytes both sides: {fair['same_bytes']}; NVMe mode store "
                     f"{'/'.join(sorted(set(result['io_mode']['store'].values())))} vs raw "
                     f"{'direct' if result['io_mode']['raw']['direct'] else 'buffered'}: {fair['same_io_mode']}; "
                     f"memory store arena [{kind(mem.get('store_arena'))}] vs raw buffer "
                     f"[{kind(mem.get('raw_buffer'))}]: {fair['same_memory']}")
        for problem in fair.get("problems", []):
            extra.append(f"NOT COMPARABLE: {problem}")
    v = result["verified"]
    extra.append(f"verified: restored bytes {v['restore']}, raw read-back {v['raw_read']}")
    files = result.get("files", {})
    if files:
        extra.append(f"JSON {files.get('json')}\nPNG  {files.get('png')}")
    return "\n".join([head, "", t1, "", t2, ""] + extra)


def _plot(result: dict[str, Any], path: Path) -> None:
    s = result["summary"]
    labels = ["spill (store)", "raw write", "restore (store)", "raw read (cold)"]
    keys = ["spill_gbps", "raw_write_gbps", "restore_gbps", "raw_read_gbps"]
    if any(s[k]["median"] is None for k in keys):
        return
    notes = [f"{x['ours']}/{x['baseline']} = {x['ratio']:.2f} (target >= {x['target']})"
             + (" INVALID: the sides differ" if x.get("valid") is False else "")
             for x in result["comparisons"] if x["ratio"] is not None]
    c = result["config"]
    bar_chart(path, labels, [s[k]["median"] for k in keys], [s[k]["min"] for k in keys],
              ["#1f77b4", "#9e9e9e", "#1f77b4", "#9e9e9e"],
              title=(f"Store tiers vs raw O_DIRECT, {c['bytes_per_phase'] / 2**20:.0f} MiB per phase, "
                     f"{c['io_threads']} I/Os in flight, {c['rounds']} rounds"),
              ylabel="GB/s (median over rounds; min as the dark tick)", notes=notes,
              legend=[("store", "#1f77b4"), ("raw", "#9e9e9e")])


# ============================================================================== command line
def _size(text: str) -> int:
    from kvconnectors.store.sizes import parse_size

    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bytes", type=_size, default="256MiB",
                        help="bytes spilled and restored per round (the DRAM budget); e.g. 256MiB, 1g")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="8b",
                        help="model KV geometry that sets the slot size (see bench transfer --help)")
    parser.add_argument("--block-tokens", type=int, default=16, help="tokens per KV block (slot = one layer's block)")
    parser.add_argument("--entry-tokens", type=int, default=256,
                        help="tokens per store entry (one request's KV: layers x blocks slots)")
    parser.add_argument("--io-threads", type=int, default=4,
                        help="the store's io_threads, and the raw baseline's I/Os in flight")
    parser.add_argument("--max-io-bytes", type=_size, default="8MiB",
                        help="the store's cap on one coalesced I/O, and the raw baseline's I/O size")
    parser.add_argument("--rounds", type=int, default=3, help="timed spill + restore rounds (median reported)")
    parser.add_argument("--warmup", type=int, default=1,
                        help="untimed rounds first (the first writes into fallocated, still unwritten extents)")
    parser.add_argument("--o-direct", choices=["auto", "true", "false"], default="auto",
                        help="the store's o_direct setting; the raw file then uses the mode the store actually "
                             "got (O_DIRECT iff the store's extent file has it)")
    parser.add_argument("--dir", default=str(DEFAULT_OUT / "tmp"),
                        help="directory on the disk under test; a temporary folder is made (and removed) inside it")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="output directory for the JSON and PNG")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    add_results_argument(parser)


def run(args: argparse.Namespace) -> int:
    o_direct = {"auto": "auto", "true": True, "false": False}[args.o_direct]
    try:
        result = run_tiers(nbytes=args.bytes, preset=args.preset, block_tokens=args.block_tokens,
                           entry_tokens=args.entry_tokens, io_threads=args.io_threads, rounds=args.rounds,
                           warmup=args.warmup, directory=args.dir, out=args.out, o_direct=o_direct,
                           max_io_bytes=args.max_io_bytes,
                           show_progress=not args.no_progress, results_dir=args.results_dir)
    except ValueError as exc:
        print(f"kvconnectors bench tiers: {exc}", file=sys.stderr)
        return 2
    return 0 if all(result["verified"].values()) and result["fairness"]["ok"] else 1


def main(argv: list[str] | None = None) -> int:
    return module_main("kvconnectors.benchmarks.tiers", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
