"""TieredStore entries that reserve their slots as they are written (create(reserve=False) +
reserve()), and entries only their writer renews or releases while unsealed: what a landing
store needs so that a peer's claim of a large transfer holds no more than the bytes it delivered."""

from __future__ import annotations

import numpy as np
import pytest

from kvconnectors.errors import StoreFullError, UnknownTransferError
from kvconnectors.store import FakeClock, StoreConfig, TieredStore

S = 4096


def make(tmp_path, dram_slots=8, nvme_slots=0, clock=None) -> TieredStore:
    cfg = StoreConfig(slot_bytes=S, dram_bytes=dram_slots * S, nvme_dirs=[str(tmp_path / "nvme")] if nvme_slots else [],
                      nvme_bytes=nvme_slots * S, nvme_create_dirs=True, lease_ttl_s=10)
    return TieredStore(cfg, clock or FakeClock())


def rows(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, S), dtype=np.uint8)


def test_an_unreserved_entry_holds_no_slot_until_reserved(tmp_path) -> None:
    with make(tmp_path) as st:
        st.create("a", 2, 4, reserve=False)
        assert st.usage()["dram"]["used_bytes"] == 0 and st.info("a").dram_slots == 0
        with pytest.raises(ValueError, match="not reserved"):
            st.write("a", 0, 0, rows(4, 0))
        assert st.reserve("a", [0], 0, 4) == 4
        assert st.reserve("a", [0], 0, 4) == 0  # already reserved: nothing more
        st.write("a", 0, 0, data0 := rows(4, 0))
        with pytest.raises(ValueError, match="never written"):
            st.seal("a")
        assert st.reserve("a", [1], 2, 2) == 2 and st.reserve("a", 1, 0, 4) == 2  # the gap only
        st.write("a", 1, 0, data1 := rows(4, 1))
        assert st.usage()["dram"]["used_bytes"] == 8 * S
        st.seal("a")
        out = np.empty((8, S), np.uint8)
        st.read_into("a", [0, 1], 0, out)
        assert np.array_equal(out, np.concatenate((data0, data1)))
        st.audit()
        st.release("a")
        assert st.usage()["dram"]["used_bytes"] == 0
        st.audit()


def test_create_without_reserving_still_refuses_what_could_never_fit(tmp_path) -> None:
    with make(tmp_path, dram_slots=8) as st:
        with pytest.raises(StoreFullError):
            st.create("big", 3, 3, reserve=False)
        st.create("x", 2, 4, reserve=False)
        st.create("y", 2, 4, reserve=False)  # claims are not reservations: both fit the free slots
        st.reserve("x", [0, 1], 0, 6)
        with pytest.raises(StoreFullError):
            st.reserve("y", [0, 1], 0, 4)  # 2 free slots left
        assert st.info("y").dram_slots == 0, "a refused reservation takes nothing"
        assert st.reserve("y", [0], 0, 2) == 2
        st.audit()
        st.release("x")
        st.release("y")
        st.audit()


def test_reservations_go_to_nvme_when_dram_is_short_and_free_on_release(tmp_path) -> None:
    with make(tmp_path, dram_slots=2, nvme_slots=8) as st:
        st.create("a", 1, 6, reserve=False)
        assert st.reserve("a", 0, 0, 6) == 6
        info = st.info("a")
        assert (info.dram_slots, info.nvme_slots) == (2, 4)
        st.write("a", 0, 0, data := rows(6, 3))
        st.seal("a")
        out = np.empty((6, S), np.uint8)
        st.read_into("a", 0, 0, out)
        assert np.array_equal(out, data)
        st.audit()
        st.release("a")
        usage = st.usage()
        assert usage["dram"]["used_bytes"] == usage["nvme"]["used_bytes"] == 0
        st.audit()


def test_an_expired_partly_reserved_entry_frees_what_it_reserved(tmp_path) -> None:
    clock = FakeClock()
    with make(tmp_path, dram_slots=4, nvme_slots=4, clock=clock) as st:
        st.create("a", 2, 4, reserve=False)
        st.reserve("a", [0, 1], 0, 6)  # 4 in DRAM, 2 on NVMe, 2 positions never reserved
        clock.advance(11)
        assert st.expire_now() == ["a"]
        usage = st.usage()
        assert usage["dram"]["used_bytes"] == usage["nvme"]["used_bytes"] == 0
        st.audit()


def test_an_unsealed_entry_with_a_writer_renews_and_releases_only_with_it(tmp_path) -> None:
    clock = FakeClock()
    writer = object()
    with make(tmp_path, clock=clock) as st:
        st.create("a", 1, 2, reserve=False, writer=writer)
        with pytest.raises(UnknownTransferError):
            st.renew("a")
        with pytest.raises(UnknownTransferError):
            st.renew("a", writer=object())
        with pytest.raises(UnknownTransferError):
            st.release("a")
        assert st.contains("a")
        clock.advance(6)
        st.renew("a", writer=writer)
        clock.advance(6)
        assert st.contains("a"), "the writer's renewal counts"
        st.reserve("a", 0, 0, 2)
        st.write("a", 0, 0, rows(2, 4))
        st.seal("a")
        st.renew("a")  # sealed: anyone holding its id may renew it (the consumer's lease keeper)
        clock.advance(6)
        st.renew("a")
        clock.advance(6)
        assert st.contains("a")
        st.release("a")  # sealed: its consumer releases it
        assert not st.contains("a")
        st.create("b", 1, 1, writer=writer)  # a fully reserved entry may have a writer too
        with pytest.raises(UnknownTransferError):
            st.renew("b")
        st.create("c", 1, 1, reserve=False, writer=writer)
        st.release("c", writer=writer)
        assert not st.contains("c")
        clock.advance(11)
        assert st.expire_now() == ["b"]
