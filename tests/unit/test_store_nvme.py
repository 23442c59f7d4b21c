"""NVMe tier internals: the vectorized stripe assignment matches the per-slot loop it replaced, and
coalesced transfers (one buffer per stretch of adjacent rows) move the right bytes, within the I/O caps."""

from __future__ import annotations

import copy
import fcntl
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from kvconnectors.store import nvme as nvme_mod
from kvconnectors.store.buffers import PAGE, SlotRows, aligned_empty, private_mapping
from kvconnectors.store.freelist import FreeList
from kvconnectors.store.nvme import NvmeTier, stripe_labels
from kvconnectors.testing import odirect

S = PAGE  # slot bytes: a page, so O_DIRECT alignment holds


def labels_reference(quota: list[int], start: int) -> np.ndarray:
    """The per-slot loop NvmeTier.alloc used before stripe_labels."""
    nd, n = len(quota), sum(quota)
    labels = np.empty(n, dtype=np.int64)
    rem, pos, d = quota[:], 0, start % nd
    while pos < n:
        if rem[d]:
            labels[pos] = d
            rem[d] -= 1
            pos += 1
        d = (d + 1) % nd
    return labels


def alloc_reference(frees: list[FreeList], per_dir: int, n: int, stripe_start: int) -> np.ndarray:
    """NvmeTier.alloc as it was (water-fill quotas, then the per-slot labelling loop)."""
    nd = len(frees)
    room = [len(f) for f in frees]
    quota = [0] * nd
    left = n
    while left:
        ring = [(stripe_start + k) % nd for k in range(nd)]
        active = [d for d in ring if quota[d] < room[d]]
        share = max(1, left // len(active))
        for d in active:
            add = min(share, room[d] - quota[d], left)
            quota[d] += add
            left -= add
            if not left:
                break
    labels = labels_reference(quota, stripe_start)
    out = np.empty(n, dtype=np.int64)
    for d in range(nd):
        if quota[d]:
            out[labels == d] = frees[d].take(quota[d]) + d * per_dir
    return out


def test_stripe_labels_match_the_loop():
    rng = np.random.default_rng(0)
    for _ in range(2000):
        nd = int(rng.integers(1, 7))
        quota = rng.integers(0, 12, nd).tolist()
        if rng.random() < 0.3:  # uneven: one directory far fuller than the rest
            quota[int(rng.integers(nd))] += int(rng.integers(0, 200))
        if not sum(quota):
            continue
        start = int(rng.integers(0, 3 * nd))
        assert np.array_equal(stripe_labels(quota, start), labels_reference(quota, start)), (quota, start)


@pytest.mark.parametrize("ndirs", [1, 2, 3, 5])
def test_alloc_matches_the_old_assignment(tmp_path, ndirs):
    dirs = [str(tmp_path / f"d{i}") for i in range(ndirs)]
    for d in dirs:
        (tmp_path / d).mkdir()
    tier = NvmeTier(dirs, ndirs * 40 * S, S, o_direct=False)
    rng = np.random.default_rng(ndirs)
    held: list[np.ndarray] = []
    try:
        for _ in range(300):
            if held and (rng.random() < 0.4 or tier.free_slots == 0):
                tier.free(held.pop(int(rng.integers(len(held)))))
                continue
            n = int(rng.integers(0, min(tier.free_slots, 50) + 1))
            stripe = int(rng.integers(0, 2 * ndirs))
            want = alloc_reference([copy.deepcopy(f.free) for f in tier.files], tier.per_dir, n, stripe)
            got = tier.alloc(n, stripe)
            assert np.array_equal(got, want), (n, stripe)
            held.append(got)
    finally:
        tier.close()


def _tier(tmp_path, slots: int = 64, **kw) -> NvmeTier:
    (tmp_path / "d").mkdir()
    return NvmeTier([str(tmp_path / "d")], slots * S, S, **kw)


def _close(mm) -> None:
    try:
        mm.close()
    except BufferError:  # a failed assertion's traceback still holds a view: keep its message, not this
        pass


REPO_CACHE = Path(__file__).resolve().parents[2] / ".cache"  # on the repo's disk, ignored by git


@pytest.fixture
def direct_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory whose filesystem accepts O_DIRECT (asked by `odirect.probe`, not the store):
    tmp_path, else a fresh one under the repo's .cache/ (tmp_path may be a tmpfs); skip, with
    every probe's reason, only where neither accepts it."""
    found, probes = odirect.first_supporting([tmp_path])
    scratch: Path | None = None
    if found is None:
        REPO_CACHE.mkdir(exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix="odirect-", dir=REPO_CACHE))
        found, more = odirect.first_supporting([scratch])
        probes += more
    try:
        if found is None:
            pytest.skip("no filesystem here accepts O_DIRECT: " + "; ".join(p.reason for p in probes))
        yield found
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


def _reasons(tier: NvmeTier) -> dict[str, str]:
    return {f.directory: f.mode_reason for f in tier.files}


def _outcome(check: Callable[[], None]) -> tuple[str, str]:
    """How a check ended: "failed", "skipped" or "passed", and its message. A meta-test asserts
    on this rather than with pytest.raises, under which a skip would skip the meta-test itself."""
    try:
        check()
    except pytest.fail.Exception as exc:
        return "failed", str(exc)
    except pytest.skip.Exception as exc:
        return "skipped", str(exc)
    return "passed", ""


def _counting(monkeypatch) -> list[int]:
    """Record how many buffers each pwritev/preadv of the tier gets."""
    seen: list[int] = []
    for name in ("pwritev", "preadv"):
        real = getattr(nvme_mod.os, name)

        def spy(fd, bufs, off, _real=real):
            seen.append(len(bufs))
            return _real(fd, bufs, off)
        monkeypatch.setattr(nvme_mod.os, name, spy)
    return seen


@pytest.mark.parametrize("o_direct", ["auto", False])
def test_adjacent_rows_move_as_one_buffer(tmp_path, monkeypatch, o_direct):
    tier = _tier(tmp_path, o_direct=o_direct)
    mm, flat = aligned_empty(32 * S)  # page-aligned on both sides: no bounce buffer
    mem, back = flat[:16 * S].reshape(16, S), flat[16 * S:].reshape(16, S)
    try:
        mem[:] = np.random.default_rng(1).integers(0, 256, mem.shape, dtype=np.uint8)
        back[:] = 0
        seen = _counting(monkeypatch)
        ids = np.arange(10, 18)
        rows = np.array([3, 4, 5, 9, 10, 0, 1, 2])  # three stretches of adjacent rows
        tier.write(ids, SlotRows(mem, rows))
        assert seen == [3] and tier.write_ios == 1
        tier.read(ids[::-1], SlotRows(back, rows[::-1]))  # the ids' order does not matter
        assert seen == [3, 3]
        assert np.array_equal(back[rows], mem[rows])
        assert not back[[6, 7, 8, 11, 12, 13, 14, 15]].any()  # rows not named are untouched
    finally:
        del mem, back, flat
        _close(mm)
        tier.close()


def test_io_caps_and_file_boundaries_split_runs(tmp_path, monkeypatch):
    tier = _tier(tmp_path, max_io_bytes=4 * S)
    mm = private_mapping(32 * S)
    mem = np.frombuffer(mm, dtype=np.uint8).reshape(32, S)
    try:
        mem[:] = np.arange(32, dtype=np.uint8)[:, None]
        seen = _counting(monkeypatch)
        tier.write(np.arange(20, 30), SlotRows(mem, np.arange(10)))
        assert seen == [1, 1, 1]  # 4 + 4 + 2 slots: the I/O size cap, each one buffer
        seen.clear()
        back = np.zeros((10, S), np.uint8)
        tier.read(np.arange(20, 30), SlotRows(back, np.arange(10)))
        assert np.array_equal(back, mem[:10])
    finally:
        del mem
        _close(mm)
        tier.close()


def test_unaligned_rows_go_through_the_bounce_buffer(direct_dir):
    tier = _tier(direct_dir)
    try:
        odirect.require_direct(tier.modes, _reasons(tier))
        src = np.empty(8 * S + 1, np.uint8)[1:].reshape(8, S)  # misaligned by one byte
        src[:] = np.random.default_rng(2).integers(0, 256, src.shape, dtype=np.uint8)
        rows = np.array([6, 7, 0, 1, 2, 4])
        tier.write(np.arange(6), SlotRows(src, rows))
        back = np.empty(8 * S + 1, np.uint8)[1:].reshape(8, S)
        back[:] = 0
        tier.read(np.arange(6), SlotRows(back, rows))
        assert np.array_equal(back[rows], src[rows]) and not back[[3, 5]].any()
    finally:
        tier.close()


def test_o_direct_is_used_where_the_filesystem_accepts_it(direct_dir):
    """"auto" must pick O_DIRECT wherever the filesystem takes it, and the descriptor the tier does
    its I/O on must really carry the flag. Seen to fail: with `_try_direct` returning
    (None, "forced") the tier reports buffered and `require_direct` fails (the meta-test below
    keeps that proof); with `io_fd` set to the buffered `lock_fd` the F_GETFL assertion fails."""
    tier = _tier(direct_dir)
    try:
        odirect.require_direct(tier.modes, _reasons(tier))
        for f in tier.files:
            assert fcntl.fcntl(f.io_fd, fcntl.F_GETFL) & os.O_DIRECT, (f.directory, f.mode_reason)
    finally:
        tier.close()


def test_buffered_store_fails_the_check_where_o_direct_works(direct_dir, monkeypatch):
    """Meta-test: a store forced into buffered I/O (its O_DIRECT decision, `_try_direct`, patched)
    on a filesystem that accepts O_DIRECT must fail `require_direct`, not skip it. Seen to fail:
    with require_direct replaced by the old "skip unless every mode is direct", the outcome was
    ("skipped", ...)."""
    monkeypatch.setattr(NvmeTier, "_try_direct", lambda self, path, o_direct: (None, "forced buffered"))
    tier = _tier(direct_dir)
    try:
        assert set(tier.modes.values()) == {"buffered"}
        outcome, message = _outcome(lambda: odirect.require_direct(tier.modes, _reasons(tier)))
        assert outcome == "failed", (outcome, message)
        assert "accepts O_DIRECT" in message and "'buffered'" in message and "forced buffered" in message, message
    finally:
        tier.close()


def test_probe_refusal_is_a_skip_with_its_reason(tmp_path, monkeypatch):
    """Meta-test: where the filesystem refuses O_DIRECT (here: open() with the flag made to fail
    with EINVAL, as on tmpfs) a buffered store is a skip naming the refusal, and the probe leaves
    no file behind. Seen to fail: with `probe` always reporting support, the probe assertion
    failed; with require_direct skipping with another reason, the message assertion failed."""
    real_open = os.open

    def no_direct(path, flags, *a, **kw):
        if flags & os.O_DIRECT:
            raise OSError(22, "Invalid argument")
        return real_open(path, flags, *a, **kw)
    monkeypatch.setattr(odirect.os, "open", no_direct)
    got = odirect.probe(tmp_path)
    assert not got.supported and "open(O_DIRECT)" in got.reason and "Invalid argument" in got.reason
    assert list(tmp_path.iterdir()) == []
    outcome, message = _outcome(lambda: odirect.require_direct({str(tmp_path): "buffered"}))
    assert outcome == "skipped" and "refuses O_DIRECT: open(O_DIRECT)" in message, (outcome, message)


def test_bounce_and_scratch_memory_is_private():
    mm, arr = aligned_empty(3 * S)
    try:
        assert arr.ctypes.data % PAGE == 0 and arr.nbytes == 3 * S
        with open("/proc/self/smaps") as f:
            text = f.read()
        addr = arr.ctypes.data
        for line in text.splitlines():
            lo, _, rest = line.partition("-")
            try:
                a, b = int(lo, 16), int(rest.split()[0], 16)
            except (ValueError, IndexError):
                continue
            if a <= addr < b:
                assert rest.split()[1][3] == "p", line  # a private mapping, not shmem
                break
        else:
            pytest.skip("mapping not found in /proc/self/smaps")
    finally:
        del arr
        _close(mm)
