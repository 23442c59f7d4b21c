"""block_shares: the shm copy and the checksum check split over threads (issue 15 item 9), in C
(kvconnectors._blockcopy) and in Python (the fallback where the package was built without a
compiler): every copy_blocks test runs on both."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import xxhash

from kvconnectors.errors import FailureCause, TransferError
from kvconnectors.mover import block_shares

SLOT = 256


@pytest.fixture(autouse=True)
def two_threads(monkeypatch):
    monkeypatch.setattr(block_shares, "THREADS", 2)


@pytest.fixture(params=["native", "python"])
def impl(request, monkeypatch) -> str:
    """Which copy_blocks runs: the C loop, or the Python one (native taken away)."""
    if request.param == "native":
        assert block_shares.native is not None, NOT_BUILT
    else:
        monkeypatch.setattr(block_shares, "native", None)
    return request.param


NOT_BUILT = ("kvconnectors._blockcopy is not built: reinstall with a C compiler (pip install -e . builds "
             "kvconnectors/_native/blockcopy.c); shm pulls fall back to the slower Python copy")


def test_the_native_copy_is_built():
    """The project's environments build it (setup.py NATIVE is optional, so a failed build would
    otherwise only show as slower shm pulls)."""
    assert block_shares.native is not None, NOT_BUILT
    assert block_shares.native.STREAMING_STORES in (0, 1)


def _spy_shares(monkeypatch, impl: str, spy) -> None:
    """Call spy(thread_name) at the start of every share of copy_blocks, whichever impl runs."""
    if impl == "python":
        real = block_shares._copy_share

        def python_share(*args):
            spy()
            return real(*args)
        monkeypatch.setattr(block_shares, "_copy_share", python_share)
        return
    real_native = block_shares.native

    class Spied:
        STREAMING_STORES = real_native.STREAMING_STORES

        @staticmethod
        def copy_verify(*args):
            spy()
            return real_native.copy_verify(*args)
    monkeypatch.setattr(block_shares, "native", Spied)


def _arena(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, SLOT), dtype=np.uint8)


def _scattered(arena: np.ndarray, seed: int = 1):
    """Destination rows in shuffled places of a bigger cache, and the arena offsets of the blocks."""
    n = len(arena)
    cache = np.zeros((2 * n, SLOT), dtype=np.uint8)
    rows = np.random.default_rng(seed).permutation(2 * n)[:n]
    order = np.random.default_rng(seed + 1).permutation(n)  # block i comes from arena slot order[i]
    dest = [memoryview(cache[r]) for r in rows]
    return cache, rows, order, (order * SLOT).tolist(), dest


def _sums(arena: np.ndarray, order) -> list[int]:
    return [xxhash.xxh3_64_intdigest(arena[j]) for j in order]


@pytest.mark.parametrize("addrs", [False, True], ids=["views", "dest_addrs"])
@pytest.mark.parametrize("n", [5, 63, 64, 128, 301])  # one share (below 2 x 64 blocks) and two
def test_copy_blocks_lands_every_block_where_asked_and_nothing_else(n, addrs, impl):
    arena = _arena(n)
    cache, rows, order, offs, dest = _scattered(arena)
    dest_addrs = np.uint64(cache.ctypes.data) + rows.astype(np.uint64) * np.uint64(SLOT) if addrs else None
    assert block_shares.copy_blocks(memoryview(arena.reshape(-1)), offs, dest, _sums(arena, order), SLOT,
                                    dest_addrs) is None
    assert np.array_equal(cache[rows], arena[order])
    others = np.setdiff1d(np.arange(len(cache)), rows)
    assert not cache[others].any()


def test_both_shares_run_at_once_on_two_threads(monkeypatch, impl):
    seen: set[str] = set()
    _spy_shares(monkeypatch, impl, lambda: seen.add(threading.current_thread().name))
    arena = _arena(256)
    _, _, order, offs, dest = _scattered(arena)
    block_shares.copy_blocks(memoryview(arena.reshape(-1)), offs, dest, None, SLOT)
    assert len(seen) == 2 and threading.current_thread().name in seen


@pytest.mark.parametrize("bad", [[10], [200], [30, 200], [140, 250]])
def test_the_lowest_mismatching_block_is_reported_whichever_share_found_it(bad, impl):
    arena = _arena(256)
    _, _, order, offs, dest = _scattered(arena)
    sums = _sums(arena, order)
    for i in bad:
        sums[i] ^= 1
    assert block_shares.copy_blocks(memoryview(arena.reshape(-1)), offs, dest, sums, SLOT) == min(bad)
    assert block_shares.first_mismatch(sums, dest) == min(bad)
    assert block_shares.first_mismatch(sums, dest, _addrs_of(dest)) == min(bad)  # natively, when built


def _addrs_of(views) -> np.ndarray:
    return np.array([np.frombuffer(v, dtype=np.uint8).ctypes.data for v in views], dtype=np.uint64)


@pytest.mark.parametrize("by_address", [False, True], ids=["views", "addrs"])
def test_first_mismatch_none_when_every_block_matches(by_address, monkeypatch):
    arena = _arena(200)
    views = [memoryview(r) for r in arena]
    sums = [xxhash.xxh3_64_intdigest(r) for r in arena]
    addrs = _addrs_of(views) if by_address else None
    if by_address:
        assert block_shares.native is not None, NOT_BUILT
        calls: list[int] = []
        real = block_shares.native

        class Counted:
            @staticmethod
            def first_mismatch(*args):
                calls.append(1)
                return real.first_mismatch(*args)
        monkeypatch.setattr(block_shares, "native", Counted)
    assert block_shares.first_mismatch(sums, views, addrs) is None
    arena[150, 3] ^= 0xFF  # in the second share
    assert block_shares.first_mismatch(sums, views, addrs) == 150
    if by_address:
        assert len(calls) == 4  # two shares each time, both native


def test_first_mismatch_refuses_fewer_addresses_than_blocks():
    assert block_shares.native is not None, NOT_BUILT
    arena = _arena(8)
    views = [memoryview(r) for r in arena]
    sums = [xxhash.xxh3_64_intdigest(r) for r in arena]
    with pytest.raises(TransferError, match="7 block addresses for 8 blocks"):
        block_shares.first_mismatch(sums, views, _addrs_of(views)[:7])


@pytest.mark.parametrize("off, why", [(SLOT + 1, "slot"), (-SLOT, "outside"), (200 * SLOT, "outside"),
                                      (2**64 - 1, "outside")])
def test_a_bad_offset_anywhere_is_refused_before_anything_is_copied(off, why, impl):
    arena = _arena(200)
    cache, _, order, offs, dest = _scattered(arena)
    offs[-1] = off  # the last block: copying would have started long before it in a per-block check
    with pytest.raises(TransferError) as exc:
        block_shares.copy_blocks(memoryview(arena.reshape(-1)), offs, dest, None, SLOT)
    assert exc.value.cause == FailureCause.PROTOCOL and str(off) in str(exc.value) and why in str(exc.value)
    assert not cache.any()


def test_a_short_destination_is_refused_not_overrun_and_every_share_has_stopped(impl):
    arena = _arena(256)
    cache, rows, order, offs, dest = _scattered(arena)
    guard = np.zeros(2 * SLOT, dtype=np.uint8)
    dest[200] = memoryview(guard[:SLOT - 8])  # in the second share; its neighbour bytes must stay zero
    with pytest.raises(TransferError) as exc:
        block_shares.copy_blocks(memoryview(arena.reshape(-1)), offs, dest, None, SLOT)
    assert exc.value.cause == FailureCause.PROTOCOL and "destination block 200" in str(exc.value)
    assert not guard.any()
    if impl == "python":  # it checks each block as it goes: the first share ran to its end before it raised
        first_share = cache[rows[:128]].copy()
        assert np.array_equal(first_share, arena[order[:128]])
    else:  # every view's size is checked before anything is copied
        assert not cache.any()


def test_a_share_that_fails_at_once_still_waits_for_the_others(monkeypatch):
    monkeypatch.setattr(block_shares, "native", None)  # (the native copy checks every view before copying)
    real = block_shares._copy_share

    def slow_in_the_pool(*args):
        if threading.current_thread() is not threading.main_thread():
            time.sleep(0.3)  # still copying when the calling thread's share has failed
        return real(*args)

    monkeypatch.setattr(block_shares, "_copy_share", slow_in_the_pool)
    arena = _arena(256)
    cache, rows, order, offs, dest = _scattered(arena)
    dest[0] = memoryview(np.zeros(SLOT - 1, dtype=np.uint8))
    with pytest.raises(TransferError, match="destination block 0"):
        block_shares.copy_blocks(memoryview(arena.reshape(-1)), offs, dest, _sums(arena, order), SLOT)
    assert np.array_equal(cache[rows[128:]], arena[order[128:]])  # the second share had finished


def test_called_from_a_pool_thread_it_runs_inline_instead_of_waiting_on_itself():
    arena = _arena(256)
    views = [memoryview(r) for r in arena]
    sums = [xxhash.xxh3_64_intdigest(r) for r in arena]
    sums[200] ^= 1
    nested = block_shares._executor().submit(block_shares.first_mismatch, sums, views)
    assert nested.result(timeout=10) == 200  # the pool's one thread would wait on its own queue


def test_the_calling_share_waits_for_the_pool_share_natively_too(monkeypatch):
    """A native share that found a mismatch at once still waits for the other share to stop."""
    assert block_shares.native is not None, NOT_BUILT
    real = block_shares.native
    finished: list[float] = []

    class SlowInThePool:
        STREAMING_STORES = real.STREAMING_STORES

        @staticmethod
        def copy_verify(*args):
            if threading.current_thread() is not threading.main_thread():
                time.sleep(0.3)
                out = real.copy_verify(*args)
                finished.append(time.monotonic())
                return out
            return real.copy_verify(*args)
    monkeypatch.setattr(block_shares, "native", SlowInThePool)
    arena = _arena(256)
    cache, rows, order, offs, dest = _scattered(arena)
    sums = _sums(arena, order)
    sums[0] ^= 1
    assert block_shares.copy_blocks(memoryview(arena.reshape(-1)), offs, dest, sums, SLOT) == 0
    assert finished, "copy_blocks returned before the pool's share stopped"
    assert np.array_equal(cache[rows[128:]], arena[order[128:]])


@pytest.mark.parametrize("shape", ["aligned", "unaligned_dest", "odd_slot"])
def test_native_copy_streams_or_falls_back_and_checks_either_way(shape):
    """Streaming stores need 16-byte aligned destinations and whole 64-byte lines; otherwise a plain
    copy (which hashes the destination). A corrupted arena slot is found on both ways."""
    assert block_shares.native is not None, NOT_BUILT
    slot = 200 if shape == "odd_slot" else SLOT
    n = 150
    arena = np.random.default_rng(3).integers(0, 256, (n, slot), dtype=np.uint8)
    backing = np.zeros(2 * n * slot + 64, dtype=np.uint8)
    shift = (16 - backing.ctypes.data % 16) % 16 + (1 if shape == "unaligned_dest" else 0)
    cache = backing[shift:shift + 2 * n * slot].reshape(2 * n, slot)
    rows = np.random.default_rng(4).permutation(2 * n)[:n]
    order = np.random.default_rng(5).permutation(n)
    dest = [memoryview(cache[r]) for r in rows]
    sums = [xxhash.xxh3_64_intdigest(arena[j]) for j in order]
    offs = (order * slot).tolist()
    assert block_shares.copy_blocks(memoryview(arena.reshape(-1)), offs, dest, sums, slot) is None
    assert np.array_equal(cache[rows], arena[order])
    arena[order[90], 7] ^= 0x40  # block 90's source slot, after its checksum was taken
    assert block_shares.copy_blocks(memoryview(arena.reshape(-1)), offs, dest, sums, slot) == 90


@pytest.mark.parametrize("short", ["offsets", "checksums"])
def test_offsets_and_checksums_must_be_one_per_block(short, impl):
    """The native loop reads offsets[i] and sums[i] for every destination block: a shorter list would
    be read past its end, so it is refused, typed, before anything is copied."""
    arena = _arena(8)
    cache, rows, order, offs, dest = _scattered(arena)
    sums = _sums(arena, order)
    if short == "offsets":
        offs = offs[:-1]
    else:
        sums = sums[:-1]
    with pytest.raises(TransferError) as exc:
        block_shares.copy_blocks(memoryview(arena.reshape(-1)), offs, dest, sums, SLOT)
    assert exc.value.cause == FailureCause.PROTOCOL and f"7 {short} for 8 blocks" in exc.value.detail
    assert not cache.any()


@pytest.mark.parametrize("bad", [-1, 2**64])
def test_a_checksum_that_is_no_xxh3_is_refused_typed(bad):
    """Checksums come off the wire (msgpack allows negative and huge ints)."""
    assert block_shares.native is not None, NOT_BUILT
    arena = _arena(8)
    cache, rows, order, offs, dest = _scattered(arena)
    sums = _sums(arena, order)
    sums[3] = bad
    with pytest.raises(TransferError) as exc:
        block_shares.copy_blocks(memoryview(arena.reshape(-1)), offs, dest, sums, SLOT)
    assert exc.value.cause == FailureCause.PROTOCOL and f"checksum {bad}" in exc.value.detail


def test_destination_addresses_must_be_one_per_block(impl):
    arena = _arena(8)
    cache, rows, order, offs, dest = _scattered(arena)
    addrs = np.uint64(cache.ctypes.data) + rows.astype(np.uint64)[:-1] * np.uint64(SLOT)
    with pytest.raises(TransferError) as exc:
        block_shares.copy_blocks(memoryview(arena.reshape(-1)), offs, dest, None, SLOT, addrs)
    assert "7 destination addresses for 8 blocks" in exc.value.detail
    assert not cache.any()


def test_check_behind_names_the_lowest_mismatching_block_of_any_run():
    arena = _arena(12)
    views = [memoryview(arena[i]) for i in range(12)]
    sums = [xxhash.xxh3_64_intdigest(v) for v in views]
    sums[9] ^= 1
    sums[5] ^= 1  # in the second run: found although the third run's check may finish first
    behind = block_shares.CheckBehind(sums)
    for first in (0, 4, 8):
        behind.add(first, views[first:first + 4])
    assert behind.first_mismatch() == 5
    behind.close()
    clean = block_shares.CheckBehind([xxhash.xxh3_64_intdigest(v) for v in views])
    clean.add(0, views)
    assert clean.first_mismatch() is None


def test_check_behind_lets_the_caller_go_on_while_a_run_is_checked(monkeypatch):
    """add() returns while its check is still running (held here); first_mismatch() waits for it."""
    gate = threading.Event()
    real = xxhash.xxh3_64_intdigest

    class HeldXxhash:
        @staticmethod
        def xxh3_64_intdigest(view):
            assert gate.wait(10)
            return real(view)
    monkeypatch.setattr(block_shares, "xxhash", HeldXxhash)
    arena = _arena(4)
    views = [memoryview(arena[i]) for i in range(4)]
    behind = block_shares.CheckBehind([real(v) for v in views])
    t0 = time.monotonic()
    behind.add(0, views)
    assert time.monotonic() - t0 < 1.0
    result: list = []
    waiter = threading.Thread(target=lambda: result.append(behind.first_mismatch()), daemon=True)
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive(), "first_mismatch() returned before the held check ran"
    gate.set()
    waiter.join(10)
    assert result == [None]
    behind.close()


@pytest.mark.parametrize("impl", ["native", "python"], indirect=True)
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_hash_rows_is_each_rows_xxh3(impl, layout):
    """The stager's checksums: natively (GIL-free) or in Python, each row's xxh3, rows of a wider
    array too (strided: the arena's slots, or a bounce buffer's rows)."""
    wide = np.random.default_rng(7).integers(0, 256, (50, SLOT + 64), dtype=np.uint8)
    rows = wide[:, :SLOT] if layout == "strided" else np.ascontiguousarray(wide[:, :SLOT])
    out = np.zeros(50, dtype=np.uint64)
    block_shares.hash_rows(rows, out)
    assert [int(x) for x in out] == [xxhash.xxh3_64_intdigest(r) for r in rows]
    block_shares.hash_rows(rows[:0], out[:0])  # nothing to hash
    with pytest.raises(ValueError, match="contiguous uint64"):
        block_shares.hash_rows(rows, np.zeros(49, dtype=np.uint64))

