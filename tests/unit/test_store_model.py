"""Model-based test: drive TieredStore with random operations against a plain-dict model under a
FakeClock. Budgets are tiny (8 DRAM slots, 2 x 6 NVMe slots) so spills, restores, direct-to-NVMe
placement and the both-tiers-full swap happen all the time."""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import ExitStack
from dataclasses import dataclass, field

import numpy as np
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvconnectors.errors import LeaseExpiredError, StoreFullError, UnknownTransferError
from kvconnectors.store import FakeClock, NotSealedError, PinnedEntry, StoreConfig, TieredStore

S = 4096
DRAM_SLOTS, NVME_SLOTS_PER_DIR, NDIRS = 8, 6, 2
TOTAL = DRAM_SLOTS + NVME_SLOTS_PER_DIR * NDIRS
NAMES = [f"k{i}" for i in range(6)]
# Most operations aim at a live entry (index into the sorted live keys); the rest at any name,
# which covers ended and never-created keys.
KEYS = st.one_of(st.integers(0, 63), st.sampled_from(NAMES))
TTLS = st.sampled_from([4, 10, 40])


@dataclass
class Model:
    layers: int
    blocks: int
    deadline: float
    data: np.ndarray
    written: np.ndarray
    sealed: bool = False
    pins: int = 0

    @property
    def slots(self) -> int:
        return self.layers * self.blocks


@dataclass
class OpenPin:
    key: str
    stack: ExitStack
    view: PinnedEntry
    model: Model
    layers: tuple[int, ...] = field(default=())


class StoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tmp = tempfile.mkdtemp(prefix="kvc-model-")
        self.dirs = [os.path.join(self.tmp, f"d{i}") for i in range(NDIRS)]
        self.clock = FakeClock()
        self.store = TieredStore(StoreConfig(slot_bytes=S, dram_bytes=DRAM_SLOTS * S, nvme_dirs=self.dirs,
                                             nvme_bytes=NVME_SLOTS_PER_DIR * NDIRS * S, nvme_create_dirs=True,
                                             io_threads=2, lease_ttl_s=10), self.clock)
        self.live: dict[str, Model] = {}
        self.ending: list[Model] = []   # ended while pinned: still occupies slots
        self.gone: set[str] = set()     # released or expired: must answer LeaseExpiredError
        self.pins: list[OpenPin] = []

    # ---------------------------------------------------------------- model helpers
    def sync(self) -> None:
        """Apply expiry to the model exactly as the store does (deadline reached = expired)."""
        now = self.clock.now()
        for key in [k for k, m in self.live.items() if now >= m.deadline]:
            self.end(key)

    def end(self, key: str) -> None:
        m = self.live.pop(key)
        self.gone.add(key)
        if m.pins:
            self.ending.append(m)

    def occupied(self) -> int:
        return sum(m.slots for m in self.live.values()) + sum(m.slots for m in self.ending)

    def expect_gone(self, key: str, call) -> None:
        expected = LeaseExpiredError if key in self.gone else UnknownTransferError
        try:
            call()
        except expected:
            return
        raise AssertionError(f"{key}: expected {expected.__name__}")

    def pick(self, key: int | str, sealed: bool | None = None) -> str:
        if isinstance(key, str):
            return key
        pool = sorted(k for k, m in self.live.items() if sealed is None or m.sealed == sealed)
        return pool[key % len(pool)] if pool else NAMES[key % len(NAMES)]

    # ---------------------------------------------------------------- rules
    @rule(key=st.sampled_from(NAMES), layers=st.integers(1, 3), blocks=st.integers(1, 3), ttl=TTLS,
          seed=st.integers(0, 2**31))
    def stage(self, key, layers, blocks, ttl, seed):
        """create + write every slot + seal: what the producer does for one request."""
        self.sync()
        if key in self.live or layers * blocks > TOTAL - self.occupied():
            return
        self.create(key, layers, blocks, ttl)
        self.write_all_and_seal(key, seed)

    @rule(key=st.sampled_from(NAMES), layers=st.integers(1, 4), blocks=st.integers(1, 3), ttl=TTLS)
    def create(self, key, layers, blocks, ttl):
        self.sync()
        if key in self.live:
            try:
                self.store.create(key, layers, blocks, ttl_s=ttl)
            except ValueError:
                return
            raise AssertionError("duplicate create accepted")
        n = layers * blocks
        before = self.store.usage()
        try:
            self.store.create(key, layers, blocks, ttl_s=ttl)
        except StoreFullError:
            assert n > TOTAL - self.occupied(), "StoreFullError although the budgets fit it"
            assert self.store.usage() == before, "a failed create touched the store"
            return
        assert n <= TOTAL - self.occupied(), "created beyond the budgets"
        self.live[key] = Model(layers, blocks, self.clock.now() + ttl, np.zeros((layers, blocks, S), np.uint8),
                               np.zeros((layers, blocks), bool))
        self.gone.discard(key)

    @rule(key=KEYS, layer=st.integers(0, 2), first=st.integers(0, 2), n=st.integers(1, 3), seed=st.integers(0, 2**31))
    def write(self, key, layer, first, n, seed):
        self.sync()
        key = self.pick(key, sealed=False)
        data = np.random.default_rng(seed).integers(0, 256, (n, S), dtype=np.uint8)
        m = self.live.get(key)
        if m is None:
            return self.expect_gone(key, lambda: self.store.write(key, layer, first, data))
        if m.sealed:
            try:
                self.store.write(key, layer, first, data)
            except ValueError:
                return
            raise AssertionError("write after seal accepted")
        if layer >= m.layers or first + n > m.blocks:
            try:
                self.store.write(key, layer, first, data)
            except IndexError:
                return
            raise AssertionError("out-of-bounds write accepted")
        self.store.write(key, layer, first, data)
        m.data[layer, first:first + n] = data
        m.written[layer, first:first + n] = True

    @rule(key=KEYS, seed=st.integers(0, 2**31))
    def write_all_and_seal(self, key, seed):
        self.sync()
        key = self.pick(key, sealed=False)
        m = self.live.get(key)
        if m is None or m.sealed:
            return
        rng = np.random.default_rng(seed)
        for layer in range(m.layers):
            data = rng.integers(0, 256, (m.blocks, S), dtype=np.uint8)
            self.store.write(key, layer, 0, data)
            m.data[layer] = data
        m.written[:] = True
        self.store.seal(key)
        m.sealed = True

    @rule(key=KEYS)
    def seal(self, key):
        self.sync()
        key = self.pick(key, sealed=False)
        m = self.live.get(key)
        if m is None:
            return self.expect_gone(key, lambda: self.store.seal(key))
        if m.sealed or not m.written.all():
            try:
                self.store.seal(key)
            except ValueError:
                return
            raise AssertionError("seal of a sealed or incomplete entry accepted")
        self.store.seal(key)
        m.sealed = True

    @rule(key=KEYS, layer=st.integers(0, 2), first=st.integers(0, 2), n=st.integers(1, 3))
    def read(self, key, layer, first, n):
        self.sync()
        key = self.pick(key, sealed=True)
        out = np.empty((n, S), np.uint8)
        m = self.live.get(key)
        if m is None:
            return self.expect_gone(key, lambda: self.store.read_into(key, layer, first, out))
        if not m.sealed:
            try:
                self.store.read_into(key, layer, first, out)
            except NotSealedError:
                return
            raise AssertionError("read of an unsealed entry accepted")
        if layer >= m.layers or first + n > m.blocks:
            return
        self.store.read_into(key, layer, first, out)
        assert np.array_equal(out, m.data[layer, first:first + n]), f"{key}: wrong bytes"

    @rule(key=KEYS, ttl=st.one_of(st.none(), TTLS))
    def renew(self, key, ttl):
        self.sync()
        key = self.pick(key)
        m = self.live.get(key)
        if m is None:
            return self.expect_gone(key, lambda: self.store.renew(key, ttl))
        got = self.store.renew(key, ttl)
        if ttl is not None:
            assert got == ttl
        m.deadline = self.clock.now() + got
        assert self.store.lease_remaining(key) == got

    @rule(key=KEYS)
    def release(self, key):
        self.sync()
        key = self.pick(key)
        if key in self.live:
            self.store.release(key)
            self.end(key)
        elif key in self.gone:
            self.store.release(key)  # no-op
        else:
            self.expect_gone(key, lambda: self.store.release(key))

    @rule(dt=st.sampled_from([1, 3, 9, 30]))
    def advance(self, dt):
        self.clock.advance(dt)
        now = self.clock.now()
        expected = sorted(k for k, m in self.live.items() if now >= m.deadline)
        assert sorted(self.store.expire_now()) == expected
        self.sync()

    @precondition(lambda self: len(self.pins) < 3)
    @rule(key=KEYS, subset=st.one_of(st.none(), st.lists(st.integers(0, 2), min_size=1, max_size=3)))
    def pin(self, key, subset):
        self.sync()
        key = self.pick(key, sealed=True)
        m = self.live.get(key)
        stack = ExitStack()
        if m is None:
            return self.expect_gone(key, lambda: stack.enter_context(self.store.pinned_views(key)))
        if not m.sealed:
            try:
                stack.enter_context(self.store.pinned_views(key, subset))
            except NotSealedError:
                return
            raise AssertionError("pin of an unsealed entry accepted")
        if subset is not None and max(subset) >= m.layers:
            try:
                stack.enter_context(self.store.pinned_views(key, subset))
            except IndexError:
                return
            raise AssertionError("pin of a missing layer accepted")
        # Room the store can make: free DRAM + DRAM slots of other sealed, unpinned entries.
        free = DRAM_SLOTS - self.store.usage()["dram"]["used_bytes"] // S
        others = sum(self.store.info(k).dram_slots for k, o in self.live.items()
                     if k != key and o.sealed and not o.pins)
        on_nvme = self.store.info(key).nvme_slots
        before = self.store.usage()
        try:
            view = stack.enter_context(self.store.pinned_views(key, subset))
        except StoreFullError:
            assert on_nvme > free + others, "pin refused although DRAM could be made"
            if subset is None:
                assert self.store.usage() == before, "a refused pin moved data"
            return
        if subset is None:
            assert on_nvme <= free + others, "pin restored more than there was room for"
            assert self.store.info(key).nvme_slots == 0
        m.pins += 1
        self.pins.append(OpenPin(key, stack, view, m, view.layers))

    @precondition(lambda self: len(self.pins) < 3)
    @rule(i=st.integers(0, 63), subset=st.one_of(st.none(), st.lists(st.integers(0, 2), min_size=1, max_size=2)))
    def pin_spilled(self, i, subset):
        """Pin an entry that has slots on NVMe: the restore path (spill others, or swap)."""
        self.sync()
        spilled = sorted(k for k, m in self.live.items() if m.sealed and self.store.info(k).nvme_slots)
        if spilled:
            self.pin(spilled[i % len(spilled)], subset)

    @rule(i=st.integers(0, 63), layer=st.integers(0, 3))
    def read_spilled(self, i, layer):
        """Read an entry that has slots on NVMe: direct NVMe reads and promotion."""
        self.sync()
        spilled = sorted(k for k, m in self.live.items() if m.sealed and self.store.info(k).nvme_slots)
        if spilled:
            key = spilled[i % len(spilled)]
            self.read(key, layer % self.live[key].layers, 0, self.live[key].blocks)

    @precondition(lambda self: self.pins)
    @rule(i=st.integers(0, 2))
    def unpin(self, i):
        p = self.pins.pop(i % len(self.pins))
        p.stack.close()
        p.model.pins -= 1
        if p.model.pins == 0 and p.model in self.ending:
            self.ending.remove(p.model)

    # ---------------------------------------------------------------- invariants
    @invariant()
    def books_balance(self):
        self.sync()
        u = self.store.usage()
        assert u["dram"]["used_bytes"] + u["nvme"]["used_bytes"] == self.occupied() * S, (u, self.occupied())
        assert u["dram"]["used_bytes"] <= DRAM_SLOTS * S and u["nvme"]["used_bytes"] <= NVME_SLOTS_PER_DIR * NDIRS * S
        assert u["entries"] == len(self.live) and sorted(self.store.keys()) == sorted(self.live)
        assert u["ending"] == len(self.ending)
        for k, m in self.live.items():
            info = self.store.info(k)
            assert info.dram_slots + info.nvme_slots == m.slots and info.pins == m.pins
        self.store.audit()  # slots held by entries == slots the tiers count as used (no leaked extent)

    @invariant()
    def pinned_views_hold_their_bytes(self):
        for p in self.pins:
            for layer in p.layers:
                for b in range(p.model.blocks):
                    assert np.array_equal(p.view.array(layer, b), p.model.data[layer, b]), f"pinned {p.key} changed"

    def teardown(self) -> None:
        try:
            for p in self.pins:
                p.stack.close()
            self.store.close()
            left = [f for d in self.dirs for f in os.listdir(d)]
            assert left == [], left
        finally:
            shutil.rmtree(self.tmp, ignore_errors=True)


StoreMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=50, deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow])
TestStoreModel = StoreMachine.TestCase
