"""TieredStore unit tests: each error path, spills/restores, NVMe files (O_DIRECT, striping,
coalescing, start-up cleanup), the shm arena, and a thread-safety smoke test."""

from __future__ import annotations

import errno
import fcntl
import os
import threading
import time

import numpy as np
import pytest

from kvconnectors.errors import ConfigError, FailureCause, LeaseExpiredError, StoreFullError, UnknownTransferError
from kvconnectors.testing import odirect
from kvconnectors.store import (FakeClock, NotSealedError, StoreClosedError, StoreConfig, TieredStore, rebase)
from kvconnectors.store import nvme as nvme_mod
from kvconnectors.store.arena import map_readonly

S = 4096  # slot bytes: a page, so O_DIRECT alignment holds


def make(tmp_path, dram_slots=8, nvme_slots=8, ndirs=2, clock=None, **kw) -> TieredStore:
    dirs = [str(tmp_path / f"nvme{i}") for i in range(ndirs)]
    cfg = StoreConfig(slot_bytes=S, dram_bytes=dram_slots * S, nvme_dirs=dirs if nvme_slots else [],
                      nvme_bytes=nvme_slots * S, nvme_create_dirs=True, lease_ttl_s=30, **kw)
    return TieredStore(cfg, clock or FakeClock())


def payload(key: str, layers: int, blocks: int) -> np.ndarray:
    seed = int.from_bytes(key.encode()[:8].ljust(8, b"\0"), "little")
    return np.random.default_rng(seed).integers(0, 256, (layers, blocks, S), dtype=np.uint8)


def put(store: TieredStore, key: str, layers: int, blocks: int, seal: bool = True, **kw) -> np.ndarray:
    data = payload(key, layers, blocks)
    store.create(key, layers, blocks, **kw)
    for layer in range(layers):
        store.write(key, layer, 0, data[layer])
    if seal:
        store.seal(key)
    return data


def read_all(store: TieredStore, key: str, layers: int, blocks: int) -> np.ndarray:
    out = np.empty((layers, blocks, S), dtype=np.uint8)
    for layer in range(layers):
        store.read_into(key, layer, 0, out[layer])
    return out


def files(tmp_path) -> list[str]:
    return sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("kvc-*"))


@pytest.fixture
def store(tmp_path):
    s = make(tmp_path)
    yield s
    s.close()


# ---------------------------------------------------------------- basic path and errors
def test_roundtrip_partial_writes_and_reads(store):
    data = payload("a", 2, 4)
    store.create("a", 2, 4)
    for layer in range(2):
        store.write("a", layer, 0, data[layer, :1])          # (n, slot_bytes) array
        store.write("a", layer, 1, data[layer, 1:].tobytes())  # any buffer of n * slot_bytes
    assert not store.is_sealed("a")
    store.seal("a", checksums={"xxh64": [1, 2]})
    assert store.is_sealed("a") and store.checksums("a") == {"xxh64": [1, 2]}
    out = bytearray(2 * S)
    store.read_into("a", 1, 2, out)
    assert bytes(out) == data[1, 2:4].tobytes()
    assert np.array_equal(read_all(store, "a", 2, 4), data)
    st = store.stats.snapshot()
    assert st["creates"] == 1 and st["puts"] == 4 and st["bytes_written_dram"] == 8 * S and st["hits_dram"] == 3


def test_layer_groups_in_one_call(tmp_path):
    """write/read_into with a list of layers: n slots per layer, layer after layer; consecutive
    or not, partly on NVMe, and the unsealed (push) read of written slots only."""
    s = make(tmp_path, dram_slots=8, nvme_slots=16)
    try:
        data = payload("g", 4, 3)
        s.create("g", 4, 3)
        s.write("g", [2, 0], 1, np.concatenate([data[2, 1:], data[0, 1:]]))   # not consecutive
        s.write("g", [1, 2, 3], 0, data[1:, :1].copy())                       # n = 1 block per layer
        s.write("g", [0], 0, data[0, :1])
        out = np.empty((2 * 2, S), np.uint8)
        s.read_into("g", [2, 0], 1, out, unsealed=True)
        assert np.array_equal(out, np.concatenate([data[2, 1:], data[0, 1:]]))
        with pytest.raises(ValueError, match="not all written"):
            s.read_into("g", [1, 3], 1, out, unsealed=True)
        s.write("g", [1, 3], 1, np.concatenate([data[1, 1:], data[3, 1:]]))
        s.seal("g")
        put(s, "h", 2, 4)  # DRAM full: part of "g" spills to NVMe
        assert s.info("g").nvme_slots > 0
        every = np.empty((4 * 3, S), np.uint8)
        s.read_into("g", [0, 1, 2, 3], 0, every)
        assert np.array_equal(every, data.reshape(-1, S))
        for bad, err in (([0, 0], "repeat"), ([], "do not divide"), ([0, 1, 2], "do not divide")):
            with pytest.raises(ValueError, match=err):
                s.read_into("g", bad, 0, np.empty((4, S), np.uint8))
        with pytest.raises(IndexError):
            s.read_into("g", [0, 4], 0, np.empty((2, S), np.uint8))
        s.audit()
    finally:
        s.close()


def test_create_argument_errors(store):
    store.create("a", 1, 1)
    with pytest.raises(ValueError, match="already exists"):
        store.create("a", 1, 1)
    for args in [("", 1, 1), ("b", 0, 1), ("b", 1, -1), ("b", 1.5, 1)]:
        with pytest.raises(ValueError):
            store.create(*args)
    with pytest.raises(ValueError):
        store.create("b", 1, 1, ttl_s=0)


def test_write_errors(store):
    store.create("a", 2, 2)
    with pytest.raises(IndexError):
        store.write("a", 2, 0, np.zeros((1, S), np.uint8))
    with pytest.raises(IndexError):
        store.write("a", 0, 1, np.zeros((2, S), np.uint8))
    with pytest.raises(ValueError, match="multiple of slot_bytes"):
        store.write("a", 0, 0, np.zeros(S + 1, np.uint8))
    with pytest.raises(ValueError, match="C-contiguous"):
        store.write("a", 0, 0, np.zeros((S, 2), np.uint8)[:, 0])
    with pytest.raises(TypeError):
        store.write("a", 0, 0, [0] * S)
    with pytest.raises(UnknownTransferError):
        store.write("nope", 0, 0, np.zeros((1, S), np.uint8))
    assert store.stats.staging_failures == {"unknown_transfer": 1}


def test_seal_rules(store):
    store.create("a", 2, 2)
    store.write("a", 0, 0, np.zeros((2, S), np.uint8))
    with pytest.raises(ValueError, match=r"2 of 4 slots never written \(first: layer, block = \(1, 0\)\)"):
        store.seal("a")
    with pytest.raises(NotSealedError):
        store.read_into("a", 0, 0, bytearray(S))
    with pytest.raises(NotSealedError):
        with store.pinned_views("a"):
            pass
    store.write("a", 1, 0, np.zeros((2, S), np.uint8))
    store.seal("a")
    with pytest.raises(ValueError, match="already sealed"):
        store.seal("a")
    with pytest.raises(ValueError, match="sealed"):
        store.write("a", 0, 0, np.zeros((1, S), np.uint8))


def test_read_into_buffer_errors(store):
    put(store, "a", 1, 2)
    with pytest.raises(ValueError, match="read-only"):
        store.read_into("a", 0, 0, bytes(S))
    with pytest.raises(ValueError):
        store.read_into("a", 0, 0, bytearray(S - 1))
    with pytest.raises(IndexError):
        store.read_into("a", 0, 1, bytearray(2 * S))


# ---------------------------------------------------------------- leases, release, tombstones
def test_expiry_release_and_typed_errors(tmp_path):
    clk = FakeClock()
    s = make(tmp_path, clock=clk, tombstones=2)
    try:
        for k in ("a", "b", "c", "d"):
            put(s, k, 1, 1, ttl_s=10)
        assert s.lease_remaining("a") == 10
        clk.advance(5)
        assert s.renew("a") == 10 and s.renew("b", 20) == 20  # default: the TTL the entry was created with
        assert s.lease_remaining("a") == 10
        clk.advance(7)  # c and d reached their deadline 2 s ago
        with pytest.raises(LeaseExpiredError, match="expired 2s ago"):  # when it lapsed, not when noticed
            s.read_into("c", 0, 0, bytearray(S))
        assert sorted(s.expire_now()) == []  # lazily expired already by the read above
        assert sorted(s.keys()) == ["a", "b"] and not s.contains("c") and s.contains("a")
        s.release("a")
        with pytest.raises(LeaseExpiredError, match="released"):
            s.renew("a")
        s.release("a")  # releasing an ended key is a no-op
        with pytest.raises(UnknownTransferError):
            s.release("never")
        # tombstones=2: "c" (oldest tombstone) is forgotten once "a" and "d" ended after it
        with pytest.raises(UnknownTransferError):
            s.lease_remaining("c")
        with pytest.raises(LeaseExpiredError) as ei:
            s.lease_remaining("d")
        assert ei.value.cause is FailureCause.LEASE_EXPIRED
        clk.advance(100)
        assert s.expire_now() == ["b"]
        assert s.usage()["dram"]["used_bytes"] == 0 and s.usage()["entries"] == 0
        st = s.stats.snapshot()
        assert (st["expiries"], st["releases"], st["renewals"]) == (3, 1, 2)
        put(s, "a", 1, 1)  # a key can be reused after it ended
        assert s.contains("a")
    finally:
        s.close()


def test_lease_wire_rebases_onto_the_consumer_clock(tmp_path):
    clk = FakeClock(500.0)
    s = make(tmp_path, clock=clk)
    try:
        put(s, "a", 1, 1, ttl_s=12)
        clk.advance(2)
        wire = s.lease_wire("a")
        assert (wire.remaining_s, wire.sender_now) == (10.0, 502.0)
        consumer = FakeClock(3.0)
        assert rebase(wire, consumer, margin_s=1.0) == 12.0
    finally:
        s.close()


def test_release_while_pinned_frees_on_unpin(store):
    data = put(store, "a", 2, 2)
    with store.pinned_views("a") as v:
        store.release("a")
        with pytest.raises(LeaseExpiredError):
            store.read_into("a", 0, 0, bytearray(S))
        assert store.usage()["dram"]["used_bytes"] == 4 * S  # still held by the pin
        assert store.usage()["ending"] == 1
        assert np.array_equal(v.array(1, 1), data[1, 1])    # the holder's views stay valid
        store.audit()
    assert store.usage()["dram"]["used_bytes"] == 0 and store.usage()["ending"] == 0
    store.audit()
    with pytest.raises(RuntimeError, match="after the with-block"):
        v.offset(0, 0)


def test_expiry_while_pinned_drops_on_unpin(tmp_path):
    clk = FakeClock()
    s = make(tmp_path, clock=clk)
    try:
        put(s, "a", 1, 2, ttl_s=5)
        with s.pinned_views("a") as v:
            clk.advance(6)
            assert s.expire_now() == ["a"]
            with pytest.raises(LeaseExpiredError):
                s.renew("a")
            assert v.array(0, 1).tobytes() == payload("a", 1, 2)[0, 1].tobytes()
            assert s.usage()["dram"]["used_bytes"] == 2 * S
        assert s.usage()["dram"]["used_bytes"] == 0
        s.audit()
    finally:
        s.close()


# ---------------------------------------------------------------- tiers: spill, restore, full
def test_spill_then_read_back_and_promote(tmp_path):
    s = make(tmp_path, dram_slots=8, nvme_slots=8)
    try:
        a = put(s, "a", 2, 4)
        b = put(s, "b", 2, 4)  # DRAM full: "a" (older deadline) spills
        assert s.info("a").nvme_slots == 8 and s.info("b").dram_slots == 8
        assert s.stats.spills == 1 and s.stats.spill_bytes == 8 * S
        assert np.array_equal(read_all(s, "a", 2, 4), a)  # from NVMe, no room to promote
        assert s.stats.hits_nvme == 2 and s.info("a").nvme_slots == 8
        s.release("b")
        assert np.array_equal(read_all(s, "a", 2, 4), a)  # now promoted on the way
        assert s.info("a").dram_slots == 8 and s.stats.restore_slots == 8
        assert np.array_equal(read_all(s, "a", 2, 4), a)
        s.audit()
        del b
    finally:
        s.close()


def test_partial_spill_takes_the_tail(tmp_path):
    s = make(tmp_path, dram_slots=8, nvme_slots=8)
    try:
        a = put(s, "a", 4, 2)
        put(s, "b", 1, 3)  # needs 3 more slots than free: a's last 3 slots go
        info = s.info("a")
        assert (info.dram_slots, info.nvme_slots) == (5, 3)
        with s.pinned_views("a", layers=[0, 1]) as v:  # head layers are in DRAM: nothing to restore
            assert np.array_equal(v.array(0, 0), a[0, 0])
        assert s.stats.restores == 0
        assert np.array_equal(read_all(s, "a", 4, 2), a)
    finally:
        s.close()


def test_store_full_is_typed_and_touches_nothing(tmp_path):
    s = make(tmp_path, dram_slots=4, nvme_slots=2, ndirs=1)
    try:
        a = put(s, "a", 1, 4)
        before = (s.usage(), s.info("a"))
        with pytest.raises(StoreFullError) as ei:
            s.create("big", 2, 2)
        msg = str(ei.value)
        assert ei.value.cause is FailureCause.STORE_FULL
        assert "4 slots = 2 layers x 2 blocks x 4.0KiB" in msg and "DRAM 0B of 16.0KiB" in msg \
            and "NVMe 8.0KiB of 8.0KiB" in msg, msg
        assert (s.usage(), s.info("a")) == before and not s.contains("big")
        assert s.stats.staging_failures == {"store_full": 1}
        assert np.array_equal(read_all(s, "a", 1, 4), a)
        s.create("fits", 1, 2)  # exactly the free NVMe: a spills 2 slots
        s.audit()
    finally:
        s.close()


def test_unsealed_entries_do_not_spill_new_entry_starts_on_nvme(tmp_path):
    s = make(tmp_path, dram_slots=4, nvme_slots=8)
    try:
        put(s, "a", 1, 4, seal=False)  # being written: must stay put
        b = put(s, "b", 2, 3)          # so b goes straight to NVMe
        assert s.info("a").dram_slots == 4 and s.info("b").nvme_slots == 6
        assert s.stats.bytes_written_nvme == 6 * S and s.stats.spills == 0
        assert np.array_equal(read_all(s, "b", 2, 3), b)
        with pytest.raises(StoreFullError, match="cannot pin 'b'"):
            with s.pinned_views("b"):
                pass
        assert s.info("b").nvme_slots == 6  # refused before touching anything
    finally:
        s.close()


def test_pin_restores_by_spilling_others(tmp_path):
    s = make(tmp_path, dram_slots=6, nvme_slots=12)
    try:
        a = put(s, "a", 2, 3)
        b = put(s, "b", 2, 3)  # a spills
        with s.pinned_views("a", layers=range(2)) as v:
            assert s.info("a").dram_slots == 6 and s.info("b").nvme_slots == 6  # b made room
            for layer in range(2):
                for blk in range(3):
                    assert np.array_equal(v.array(layer, blk), a[layer, blk])
                    assert v.offset(layer, blk) % S == 0
            assert sum(n for _, n in v.byte_runs(0)) == 3 * S
            with pytest.raises(ValueError):
                v.array(0, 0)[0] = 1  # views are read-only
            with pytest.raises(StoreFullError):  # b cannot come back: a is pinned
                with s.pinned_views("b"):
                    pass
            assert np.array_equal(read_all(s, "b", 2, 3), b)  # but it is still readable from NVMe
        s.audit()
    finally:
        s.close()


def test_pin_swaps_when_both_tiers_are_full(tmp_path):
    s = make(tmp_path, dram_slots=4, nvme_slots=4, ndirs=1)
    try:
        a = put(s, "a", 1, 4)
        b = put(s, "b", 2, 2)  # a spills completely; both tiers are now full
        assert s.usage()["dram"]["used_bytes"] == s.usage()["nvme"]["used_bytes"] == 4 * S
        with s.pinned_views("a") as v:
            assert np.array_equal(np.stack([v.array(0, i) for i in range(4)]), a[0])
        assert s.info("b").nvme_slots == 4
        assert np.array_equal(read_all(s, "b", 2, 2), b)
        s.audit()
    finally:
        s.close()


def test_spill_io_error_rolls_back(tmp_path, monkeypatch):
    s = make(tmp_path, dram_slots=4, nvme_slots=8)
    try:
        a = put(s, "a", 1, 4)
        before = s.usage()

        def broken(ids, bufs):
            raise OSError(errno.EIO, "injected")
        monkeypatch.setattr(s._nvme, "write", broken)
        with pytest.raises(OSError, match="injected"):
            s.create("b", 1, 2)
        monkeypatch.undo()
        assert s.usage() == before and not s.contains("b") and s.info("a").dram_slots == 4
        assert s.stats.staging_failures == {"io_error": 1}
        s.audit()
        put(s, "b", 1, 2)
        assert np.array_equal(read_all(s, "a", 1, 4), a)
    finally:
        s.close()


# ---------------------------------------------------------------- NVMe files
def test_o_direct_is_active_here(tmp_path):
    s = make(tmp_path)
    try:
        odirect.require_direct(s.nvme_io_mode, s.nvme_mode_reasons)  # buffered where O_DIRECT works fails
        a = put(s, "a", 2, 4)
        put(s, "b", 2, 4)  # spill a through O_DIRECT
        out = np.empty(8 * S + 1, np.uint8)[1:].reshape(2, 4, S)  # misaligned: goes via the bounce buffer
        for layer in range(2):
            s.read_into("a", layer, 0, out[layer])
        assert np.array_equal(out, a)
    finally:
        s.close()


def test_o_direct_refused_falls_back_or_fails(tmp_path, monkeypatch):
    real_open = os.open

    def no_direct(path, flags, *a, **kw):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a, **kw)
    monkeypatch.setattr(nvme_mod.os, "open", no_direct)
    s = make(tmp_path)
    try:
        assert set(s.nvme_io_mode.values()) == {"buffered"}
        assert all("open(O_DIRECT)" in r for r in s.nvme_mode_reasons.values())
        a = put(s, "a", 2, 4)
        put(s, "b", 2, 4)
        assert np.array_equal(read_all(s, "a", 2, 4), a)
    finally:
        s.close()
    with pytest.raises(ConfigError) as ei:
        make(tmp_path, o_direct=True)
    assert ei.value.key == "o_direct" and "refuses O_DIRECT" in str(ei.value)
    assert files(tmp_path) == []  # nothing left behind by the failed start


def test_o_direct_probe_failure_falls_back(tmp_path, monkeypatch):
    real = os.pwritev

    def einval_on_probe(fd, bufs, off):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, bufs, off)
    monkeypatch.setattr(nvme_mod.os, "pwritev", einval_on_probe)
    s = make(tmp_path)
    try:
        assert set(s.nvme_io_mode.values()) == {"buffered"}
        assert all("probe" in r for r in s.nvme_mode_reasons.values())
    finally:
        s.close()


def test_o_direct_false_is_buffered(tmp_path):
    s = make(tmp_path, o_direct=False)
    try:
        assert set(s.nvme_io_mode.values()) == {"buffered"}
    finally:
        s.close()


def test_striping_and_coalescing(tmp_path):
    s = make(tmp_path, dram_slots=8, nvme_slots=16, ndirs=2)
    try:
        a = put(s, "a", 2, 4)
        ios = s._nvme.write_ios
        put(s, "b", 2, 4)  # spills all 8 slots of a
        info = s.info("a")
        assert sorted(info.nvme_slots_by_dir.values()) == [4, 4], info
        assert s._nvme.write_ios - ios == 2  # adjacent extents coalesced: one pwritev per directory
        sizes = {os.fstat(f.lock_fd).st_size for f in s._nvme.files}
        assert len(s._nvme.files) == 2 and sizes == {8 * S}  # preallocated: budget / number of dirs
        reads = s._nvme.read_ios
        assert np.array_equal(read_all(s, "a", 2, 4), a)
        assert s._nvme.read_ios - reads == 4  # per layer: 2 slots in each directory, one preadv each
    finally:
        s.close()


def test_files_are_removed_on_close_and_leftovers_on_start(tmp_path):
    d0 = tmp_path / "nvme0"
    d0.mkdir()
    stale = d0 / "kvc-old-999999-0.kv"        # a dead store's file: nobody holds its lock
    stale.write_bytes(b"x" * 100)
    alive = d0 / "kvc-other-1-0.kv"           # a live store's file: its lock is held
    alive.write_bytes(b"y")
    holder = os.open(alive, os.O_RDONLY)
    fcntl.flock(holder, fcntl.LOCK_EX)
    foreign = d0 / "notes.kv"                 # not ours
    foreign.write_text("keep")
    try:
        s = make(tmp_path, ndirs=2)
        assert str(stale) in s.removed_leftovers and not stale.exists()
        assert alive.exists() and foreign.exists()
        # Its own files have no name once open (the kernel frees them when the process ends, even
        # killed), yet hold the preallocated space.
        assert files(tmp_path) == ["nvme0/kvc-other-1-0.kv"]
        assert [(st.st_nlink, st.st_size) for st in (os.fstat(f.lock_fd) for f in s._nvme.files)] == [(0, 4 * S)] * 2
        s2 = make(tmp_path, ndirs=2)          # a second live store leaves the other live one's file alone
        assert not s2.removed_leftovers and alive.exists()
        put(s, "a", 2, 4)
        put(s, "b", 2, 4)
        s.close()
        s2.close()
        assert files(tmp_path) == ["nvme0/kvc-other-1-0.kv"]
    finally:
        os.close(holder)
    s3 = make(tmp_path)  # once its owner is gone, the file is a leftover too
    try:
        assert not alive.exists()
    finally:
        s3.close()


def test_closed_store_refuses_everything(tmp_path):
    s = make(tmp_path)
    put(s, "a", 1, 1)
    s.close()
    s.close()
    assert files(tmp_path) == []
    for call in (lambda: s.create("b", 1, 1), lambda: s.read_into("a", 0, 0, bytearray(S)), lambda: s.keys(),
                 lambda: s.renew("a"), lambda: s.release("a"), lambda: s.expire_now()):
        with pytest.raises(StoreClosedError):
            call()


# ---------------------------------------------------------------- shm arena
def test_shm_arena_is_readable_by_another_mapping(tmp_path):
    name = f"kvc_test_{os.getpid()}"
    s = make(tmp_path, shm_name=name)
    try:
        assert s.shm_path == f"/dev/shm/{name}"
        with pytest.raises(ConfigError) as ei:  # a second live store cannot take the same name
            make(tmp_path, shm_name=name)
        assert ei.value.key == "shm_name"
        a = put(s, "a", 2, 2)
        mm, arena = map_readonly(name)
        try:
            with s.pinned_views("a") as v:
                off = v.offset(1, 1)
                assert arena[off:off + S].tobytes() == a[1, 1].tobytes()
                assert v.base_address == s.arena_base_address
        finally:
            del arena
            mm.close()
    finally:
        s.close()
    assert not os.path.exists(f"/dev/shm/{name}")


def test_stale_shm_file_is_reused(tmp_path):
    name = f"kvc_stale_{os.getpid()}"
    path = f"/dev/shm/{name}"
    with open(path, "wb") as f:
        f.write(b"old secret bytes")
    s = make(tmp_path, shm_name=name)
    try:
        assert os.path.getsize(path) == 8 * S
        mm, arena = map_readonly(name)
        assert not arena[:16].any()  # old bytes were truncated away
        del arena
        mm.close()
    finally:
        s.close()


# ---------------------------------------------------------------- threads
def test_concurrent_writer_readers_and_reaper(tmp_path):
    """The forward thread stages entries (forcing spills), transport threads read and pin them, a
    reaper expires: every byte read must be the byte written, and the books must balance."""
    s = TieredStore(StoreConfig(slot_bytes=S, dram_bytes=24 * S, nvme_dirs=[str(tmp_path / "n0"), str(tmp_path / "n1")],
                                nvme_bytes=48 * S, nvme_create_dirs=True, io_threads=2, lease_ttl_s=1.0))
    sealed: list[str] = []
    errors: list[BaseException] = []
    stop = threading.Event()
    lock = threading.Lock()

    def writer():
        i = 0
        while not stop.is_set():
            key = f"k{i}"
            try:
                put(s, key, 2, 4)
                with lock:
                    sealed.append(key)
            except StoreFullError:
                time.sleep(0.01)
            except LeaseExpiredError:
                pass  # a slow box can outlive a short lease mid-staging: a legitimate outcome
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)
                return
            i += 1

    def reader(seed):
        rng = np.random.default_rng(seed)
        out = np.empty((4, S), np.uint8)
        while not stop.is_set():
            with lock:
                if not sealed:
                    continue
                key = sealed[int(rng.integers(len(sealed)))]
            try:
                layer = int(rng.integers(2))
                if rng.random() < 0.2:
                    with s.pinned_views(key, [layer]) as v:
                        got = np.stack([v.array(layer, b) for b in range(4)])
                else:
                    s.read_into(key, layer, 0, out)
                    got = out
                if not np.array_equal(got, payload(key, 2, 4)[layer]):
                    errors.append(AssertionError(f"wrong bytes for {key} layer {layer}"))
                if rng.random() < 0.3:
                    s.release(key)
            except (LeaseExpiredError, StoreFullError):
                pass
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)
                return

    def reaper():
        while not stop.is_set():
            s.expire_now()
            time.sleep(0.02)

    threads = [threading.Thread(target=writer), threading.Thread(target=reader, args=(1,)),
               threading.Thread(target=reader, args=(2,)), threading.Thread(target=reaper)]
    for t in threads:
        t.start()
    time.sleep(1.5)
    stop.set()
    for t in threads:
        t.join(10)
    try:
        assert not errors, errors[:3]
        st = s.stats.snapshot()
        assert st["creates"] > 10 and st["reads"] > 10 and st["spills"] > 0, st
        s.audit()
    finally:
        s.close()
    assert files(tmp_path) == []


# ---------------------------------------------------------------- odds and ends
def test_dram_only_store(tmp_path):
    s = make(tmp_path, dram_slots=4, nvme_slots=0)
    try:
        a = put(s, "a", 1, 3)
        with pytest.raises(StoreFullError, match="NVMe 0B of 0B"):
            s.create("b", 1, 2)
        with s.pinned_views("a") as v:
            assert np.array_equal(v.array(0, 2), a[0, 2])
        assert s.usage()["nvme"] == {"used_bytes": 0, "capacity_bytes": 0, "entries": 0, "io_mode": {}}
        assert files(tmp_path) == []
    finally:
        s.close()


def test_torch_tensors_of_any_dtype_are_bytes(store):
    torch = pytest.importorskip("torch")
    src = torch.arange(2 * S // 2, dtype=torch.bfloat16).reshape(2, S // 2)  # numpy has no bf16
    store.create("t", 1, 2)
    store.write("t", 0, 0, src)
    store.seal("t")
    out = torch.empty_like(src)
    store.read_into("t", 0, 0, out)
    assert torch.equal(out, src)


def test_reaper_expires_in_the_background(tmp_path):
    from kvconnectors.store import Reaper

    s = TieredStore(StoreConfig(slot_bytes=S, dram_bytes=4 * S, lease_ttl_s=0.3))
    seen: list[str] = []
    try:
        put(s, "a", 1, 1)
        with Reaper(s, interval_s=0.02, on_expired=seen.extend):
            deadline = time.monotonic() + 5
            while not seen and time.monotonic() < deadline:
                time.sleep(0.01)
        assert seen == ["a"] and s.usage()["dram"]["used_bytes"] == 0
    finally:
        s.close()
