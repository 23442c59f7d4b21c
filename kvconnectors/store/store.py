"""TieredStore: the producer-side host store. Entries of (layer, block) slots in a DRAM arena that
spills to NVMe, each entry under a lease.

Concurrency. One lock guards the bookkeeping (key table, free lists, leases); bytes move outside
it, so a spill to NVMe never stalls readers of other entries. Instead of holding the lock, an
operation holds the entry:
- `io`       a read_into/write copying right now: the entry's slots stay where they are;
- `pins`     a pinned_views holder: the entry is neither spilled nor freed;
- `spilling` its DRAM slots are being written out and handed to someone else: new readers wait;
- `restoring` slots are coming back to DRAM: a second mover waits, readers do not (extents that a
              reader may still be reading are freed when its io ends).
An entry that is released or expires while held leaves the key table at once (so nothing new can
read it: the key answers LeaseExpiredError) and its slots are freed when the last holder lets go.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import numpy as np

from kvconnectors.errors import LeaseExpiredError, StoreFullError, TransferError, UnknownTransferError
from kvconnectors.store.arena import DramArena
from kvconnectors.store.buffers import SlotRows, aligned_empty, as_slots
from kvconnectors.store.config import StoreConfig
from kvconnectors.store.entry import UNRESERVED, Entry, EntryInfo, ext_of, nvme_loc, on_nvme
from kvconnectors.store.errors import NotSealedError, StoreClosedError
from kvconnectors.store.lease import Clock, Lease, LeaseWire, MonotonicClock, check_ttl
from kvconnectors.store.nvme import NvmeTier
from kvconnectors.store.policy import pick_victims, spillable_slots
from kvconnectors.store.sizes import format_size
from kvconnectors.store.stats import StoreStats
from kvconnectors.store.tombstones import Tombstones
from kvconnectors.store.views import PinnedEntry, WriteTarget

_EMPTY = np.empty(0, dtype=np.int64)
_CLOSE_WAIT_S = 10.0


class TieredStore:
    def __init__(self, config: StoreConfig, clock: Clock | None = None):
        if not isinstance(config, StoreConfig):
            raise TypeError(f"config must be a StoreConfig, got {type(config).__name__}")
        self.config = config
        self.clock: Clock = clock or MonotonicClock()
        self.stats = StoreStats()
        self._cond = threading.Condition(threading.Lock())
        self._entries: dict[str, Entry] = {}
        self._ending: set[Entry] = set()    # left the key table, slots not freed yet (still held)
        self._pending: set[str] = set()     # keys whose create() is moving bytes
        self._heap: list[tuple[float, int, str]] = []  # (deadline, seq, key); stale items skipped
        self._tombs = Tombstones(config.tombstones)
        self._seq = itertools.count()
        self._closed = False
        self._arena = DramArena(config.slot_bytes, config.dram_bytes, config.shm_name,  # type: ignore[arg-type]
                                prefault=config.dram_prefault)
        try:
            self._nvme = NvmeTier(config.nvme_dirs, config.nvme_bytes, config.slot_bytes,  # type: ignore[arg-type]
                                  o_direct=config.o_direct, io_threads=config.io_threads,
                                  instance_name=config.instance_name,
                                  max_io_bytes=config.max_io_bytes)  # type: ignore[arg-type]
        except BaseException:
            self._arena.close()
            raise

    # ------------------------------------------------------------------ introspection
    @property
    def slot_bytes(self) -> int:
        return self.config.slot_bytes  # type: ignore[return-value]

    @property
    def nvme_io_mode(self) -> dict[str, str]:
        """Per NVMe directory: "direct" (O_DIRECT active) or "buffered"."""
        return self._nvme.modes

    @property
    def nvme_mode_reasons(self) -> dict[str, str]:
        return {f.directory: f.mode_reason for f in self._nvme.files}

    @property
    def removed_leftovers(self) -> list[str]:
        """Files of dead stores removed from the NVMe directories at start-up."""
        return list(self._nvme.removed_leftovers)

    @property
    def shm_path(self) -> str | None:
        return self._arena.shm_path

    @property
    def arena_base_address(self) -> int:
        return self._arena.base_address

    def arena_slots(self) -> np.ndarray:
        """The DRAM arena as uint8 [num_slots, slot_bytes] (to page-lock it; writers go through
        begin_write, readers through pinned_views)."""
        return self._arena.slots

    @property
    def arena_bytes(self) -> int:
        return self._arena.nbytes

    # ------------------------------------------------------------------ producer side
    def create(self, key: str, num_layers: int, num_blocks: int, ttl_s: float | None = None, *,
               reserve: bool = True, writer: object = None) -> None:
        """Reserve every slot of a new entry. DRAM first; when DRAM is short, sealed idle entries
        spill their tails to NVMe, and what still does not fit starts on NVMe. StoreFullError only
        when free DRAM + free NVMe < the entry; then nothing stored is touched.

        reserve=False (a landing entry, filled by peers): the same check that the entry would fit
        now, but no slot is reserved: `reserve()` takes them as the bytes arrive. `writer` (any
        object): while the entry is unsealed, only renew(writer=writer) renews its lease and only
        release(writer=writer) releases it (others are answered UnknownTransferError), so nobody
        but its writer keeps an unfinished entry alive or ends it; expiry still does."""
        if not isinstance(key, str) or not key:
            raise ValueError(f"key must be a non-empty str, got {key!r}")
        for name, v in (("num_layers", num_layers), ("num_blocks", num_blocks)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        ttl = self.config.lease_ttl_s if ttl_s is None else check_ttl(ttl_s)
        n = int(num_layers) * int(num_blocks)
        arena, nvme = self._arena, self._nvme
        with self._cond:
            self._check_open()
            self._expire_locked()
            if key in self._entries or key in self._pending:
                raise ValueError(f"transfer {key!r} already exists in the store")
            free_d, free_n = arena.free_slots, nvme.free_slots
            if n > free_d + free_n:
                self.stats.failure("store_full")
                raise StoreFullError(self._full_message(key, num_layers, num_blocks))
            seq = next(self._seq)
            if not reserve:
                self._add_entry(Entry(key, int(num_layers), int(num_blocks), Lease.start(self.clock, ttl),
                                      np.full(n, UNRESERVED, dtype=np.int64), seq, writer=writer))
                self.stats.add(creates=1)
                return
            stripe = seq % max(1, len(nvme.files))
            dram = arena.alloc(min(free_d, n))
            victims = pick_victims(self._entries.values(), min(n - dram.size, free_n))
            spilled = sum(p.size for _, p in victims)
            spill_ext = nvme.alloc(spilled, stripe)
            direct_ext = nvme.alloc(n - dram.size - spilled, stripe)
            for v, _ in victims:
                v.spilling = True
            self._pending.add(key)
        try:
            self._spill_io(victims, spill_ext)
        except BaseException:
            with self._cond:
                arena.free(dram)
                nvme.free(spill_ext)
                nvme.free(direct_ext)
                for v, _ in victims:
                    v.spilling = False
                    self._settle(v)
                self._pending.discard(key)
            self.stats.failure("io_error")
            raise
        with self._cond:
            freed = self._commit_spill(victims, spill_ext)
            self._pending.discard(key)
            # Head of the entry in DRAM, tail on NVMe: layer-wise readers start with DRAM hits.
            loc = np.concatenate((dram, freed, nvme_loc(direct_ext)))
            if self._closed:
                arena.free(loc[loc >= 0])
                nvme.free(ext_of(loc[loc < 0]))
                raise StoreClosedError("store closed during create()")
            self._add_entry(Entry(key, int(num_layers), int(num_blocks), Lease.start(self.clock, ttl), loc, seq,
                                  writer=writer))
        self.stats.add(creates=1)

    def reserve(self, key: str, layer: int | Sequence[int], first_block: int, rows: int) -> int:
        """Reserve the slots of `rows` positions of an unsealed entry (named as for `write`) that
        have none yet (an entry created with reserve=False): free DRAM first, then free NVMe;
        nothing stored is spilled for them. Returns how many were newly reserved. StoreFullError
        when free DRAM + free NVMe cannot hold them; then nothing changes."""
        arena, nvme = self._arena, self._nvme
        with self._cond:
            e = self._live(key)
            if e.sealed:
                raise ValueError(f"transfer {key!r} is sealed; its bytes cannot change")
            idx = self._positions(e, layer, first_block, rows)
            pos = _positions_where(idx, e.loc[idx] == UNRESERVED)
            n = int(pos.size)
            if not n:
                return 0
            free_d, free_n = arena.free_slots, nvme.free_slots
            if n > free_d + free_n:
                self.stats.failure("store_full")
                s = self.slot_bytes
                raise StoreFullError(
                    f"cannot reserve {n} more slots ({format_size(n * s)}) for {key!r}: free DRAM "
                    f"{format_size(free_d * s)}, NVMe {format_size(free_n * s)} ({len(self._entries)} entries)")
            dram = arena.alloc(min(free_d, n))
            ext = nvme.alloc(n - dram.size, e.seq % max(1, len(nvme.files)))
            e.loc[pos] = np.concatenate((dram, nvme_loc(ext)))
        return n

    def write(self, key: str, layer: int | Sequence[int], first_block: int, data: Any) -> None:
        """Copy n slots (data: uint8 (n, slot_bytes) or any C-contiguous buffer of n*slot_bytes)
        into (layer, first_block .. first_block+n-1) of an unsealed entry. With a list of layers,
        data holds n slots per layer, layer after layer (one call for a whole layer group)."""
        src = as_slots(data, self.slot_bytes, writable=False, what="write data")
        target = self.begin_write(key, layer, first_block, src.shape[0])
        ok = False
        try:
            for pos, slot, n in target.dram_runs:
                np.copyto(target.slots[slot:slot + n], src[pos:pos + n])
            ok = True
        finally:
            self.end_write(target, src[target.nvme_pos] if ok else None, ok=ok)

    def begin_write(self, key: str, layer: int | Sequence[int], first_block: int, rows: int) -> WriteTarget:
        """Reserve `rows` slots of an unsealed entry for a writer that copies into the DRAM arena
        itself (the mover's device->host copy lands in the slots directly): the entry holds still
        until `end_write`, which writes the rows that live on NVMe and marks the slots written."""
        with self._cond:
            try:
                e = self._live(key)
            except TransferError as exc:
                self.stats.failure(exc.cause.value)
                raise
            if e.sealed:
                raise ValueError(f"transfer {key!r} is sealed; its bytes cannot change")
            idx = self._positions(e, layer, first_block, rows)
            if (e.loc[idx] == UNRESERVED).any():
                raise ValueError(f"transfer {key!r}: layer(s) {layer} from block {first_block}: slots not "
                                 f"reserved yet (reserve() them first)")
            e.io += 1
            e.writes += 1
            loc = e.loc[idx].copy()
        return WriteTarget(e, idx, loc, self._arena.slots)

    def end_write(self, target: WriteTarget, nvme_rows: np.ndarray | None, *, ok: bool = True) -> None:
        """Finish `begin_write`: `nvme_rows` are the rows at `target.nvme_pos` (they go to disk);
        ok=False gives the slots back unwritten (a failed copy)."""
        e, loc = target.entry, target.loc
        d_bytes = n_bytes = 0
        try:
            if ok and target.nvme_pos.size:
                if nvme_rows is None or nvme_rows.shape[0] != target.nvme_pos.size:
                    raise ValueError(f"{target.nvme_pos.size} rows live on NVMe, got "
                                     f"{None if nvme_rows is None else nvme_rows.shape[0]}")
                self._nvme.write(ext_of(loc[target.nvme_pos]), SlotRows(nvme_rows, np.arange(target.nvme_pos.size)))
            d_bytes = (loc.size - target.nvme_pos.size) * self.slot_bytes
            n_bytes = target.nvme_pos.size * self.slot_bytes
        except OSError:
            ok = False
            self.stats.failure("io_error")
            raise
        except BaseException:
            ok = False
            raise
        finally:
            with self._cond:
                e.io -= 1
                e.writes -= 1
                ended = e.ended
                if ok and ended is None:
                    e.written[target.idx] = True
                self._settle(e)
        if ended is not None:
            self.stats.failure("lease_expired")
            raise LeaseExpiredError(f"transfer {e.key!r} ended ({ended}) while it was being written")
        self.stats.add(puts=1, bytes_written_dram=d_bytes, bytes_written_nvme=n_bytes)

    def seal(self, key: str, checksums: dict | None = None) -> None:
        """Mark the entry complete (every slot written); only sealed entries are readable."""
        with self._cond:
            e = self._live(key)
            if e.sealed:
                raise ValueError(f"transfer {key!r} is already sealed")
            missing = np.flatnonzero(~e.written)
            if missing.size or e.writes:  # reads in flight (a push of written slots) do not matter
                first = divmod(int(missing[0]), e.num_blocks) if missing.size else None
                raise ValueError(f"transfer {key!r} cannot be sealed: {missing.size} of {e.num_slots} slots "
                                 f"never written (first: layer, block = {first})"
                                 + (f"; {e.writes} writes in flight" if e.writes else ""))
            e.sealed = True
            e.checksums = dict(checksums) if checksums is not None else None
        self.stats.add(seals=1)

    # ------------------------------------------------------------------ consumer side
    def is_sealed(self, key: str) -> bool:
        with self._cond:
            return self._live(key).sealed

    def checksums(self, key: str) -> dict | None:
        with self._cond:
            return self._live(key).checksums

    def read_into(self, key: str, layer: int | Sequence[int], first_block: int, out: Any, *,
                  unsealed: bool = False) -> None:
        """Copy n slots into `out` (writable, n*slot_bytes) from wherever they live; with a list of
        layers, n slots per layer, layer after layer (one call for every layer of a prompt). Slots
        on NVMe are promoted to DRAM on the way when free DRAM allows (never by evicting anything).
        unsealed=True (push mode) reads already written slots of an entry still being staged,
        without promoting them."""
        dst = as_slots(out, self.slot_bytes, writable=True, what="read_into out")
        with self._cond:
            e = self._readable(key, unsealed)
            idx = self._positions(e, layer, first_block, dst.shape[0])
            if unsealed and not e.written[idx].all():
                raise ValueError(f"transfer {key!r}: layer(s) {layer} from block {first_block}: "
                                 f"{dst.shape[0]} slots are not all written yet")
            on_nvme = _positions_where(idx, e.loc[idx] < 0)
            if on_nvme.size and not unsealed and not e.restoring and self._arena.free_slots >= on_nvme.size:
                try:
                    self._restore_locked(e, on_nvme, allow_spill=False)
                except OSError:
                    pass  # promotion is an optimisation; the read below still goes to NVMe
                if e.ended is not None:
                    self._raise_missing(key)
            e.io += 1
            loc = e.loc[idx].copy()
        try:
            d_bytes, n_bytes = self._move(loc, dst, to_store=False)
        finally:
            with self._cond:
                e.io -= 1
                self._settle(e)
        self.stats.add(reads=1, bytes_read_dram=d_bytes, bytes_read_nvme=n_bytes,
                       hits_dram=int(n_bytes == 0), hits_nvme=int(n_bytes > 0))

    @contextmanager
    def pinned_views(self, key: str, layers: range | Sequence[int] | None = None, *,
                     unsealed: bool = False) -> Iterator[PinnedEntry]:
        """Make the entry's `layers` (default all) DRAM-resident, restoring spilled slots (spilling
        other sealed idle entries if needed; StoreFullError if even that cannot make room), and pin
        the entry while the with-block runs. Yields views and arena offsets for zero-copy senders.

        unsealed=True (push mode: layer groups leave while later layers are still staged) pins an
        entry still being written; its slots must already be in DRAM (an unsealed entry is never
        spilled, but may have started on NVMe when DRAM was short: StoreFullError then)."""
        e, view = self._pin(key, layers, unsealed)
        try:
            yield view
        finally:
            view.close()
            with self._cond:
                e.pins -= 1
                self._settle(e)

    # ------------------------------------------------------------------ leases
    def renew(self, key: str, ttl_s: float | None = None, *, writer: object = None) -> float:
        """Restart the entry's lease. An unsealed entry created with a `writer` renews only with
        that writer (others: UnknownTransferError, so the answer reveals nothing about it)."""
        with self._cond:
            e = self._live(key)
            self._check_writer(e, writer)
            ttl = e.lease.renew(ttl_s)
            heapq.heappush(self._heap, (e.lease.deadline, e.seq, key))
            if len(self._heap) > 4 * len(self._entries) + 1024:  # drop stale heap items
                self._heap = [(x.lease.deadline, x.seq, k) for k, x in self._entries.items()]
                heapq.heapify(self._heap)
        self.stats.add(renewals=1)
        return ttl

    def lease_remaining(self, key: str) -> float:
        with self._cond:
            return self._live(key).lease.remaining()

    def lease_wire(self, key: str) -> LeaseWire:
        """The lease as (remaining TTL, this store's clock): what goes into kv_transfer_params."""
        with self._cond:
            return self._live(key).lease.to_wire()

    def release(self, key: str, *, writer: object = None) -> None:
        """Free the entry now (when its last holder lets go, if pinned or being read). Releasing a
        key that already ended is a no-op; a key never seen raises UnknownTransferError, and so
        does an unsealed entry created with another `writer`."""
        with self._cond:
            self._check_open()
            self._expire_locked()
            e = self._entries.get(key)
            if e is None:
                if self._tombs.get(key) is not None:
                    return
                raise UnknownTransferError(f"transfer {key!r} is not in this store")
            self._check_writer(e, writer)
            self._end(e, "released")

    def expire_now(self) -> list[str]:
        """End every entry whose lease has passed; return their keys. Entries still pinned or being
        read leave the key table now and give their slots back when released by their holder."""
        with self._cond:
            self._check_open()
            return self._expire_locked()

    # ------------------------------------------------------------------ listing
    def contains(self, key: str) -> bool:
        with self._cond:
            try:
                self._live(key)
                return True
            except TransferError:
                return False

    def keys(self) -> list[str]:
        with self._cond:
            self._check_open()
            self._expire_locked()
            return list(self._entries)

    def info(self, key: str) -> EntryInfo:
        with self._cond:
            e = self._live(key)
            ext = ext_of(e.loc[on_nvme(e.loc)])
            by_dir = {}
            if ext.size:
                dirs, counts = np.unique(self._nvme.dir_of(ext), return_counts=True)
                by_dir = {self._nvme.files[d].directory: int(c) for d, c in zip(dirs.tolist(), counts.tolist())}
            return EntryInfo(key, e.num_layers, e.num_blocks, e.sealed, e.pins, e.dram_count(), int(ext.size),
                             by_dir, e.lease.remaining())

    def usage(self) -> dict[str, Any]:
        """Bytes used/capacity per tier (everything stored, including entries that ended but are
        still held), and entry counts (live entries with at least one slot in the tier)."""
        s = self.slot_bytes
        with self._cond:
            self._check_open()
            self._expire_locked()
            live = list(self._entries.values())
            return {
                "dram": {"used_bytes": self._arena.used_slots * s, "capacity_bytes": self._arena.num_slots * s,
                         "entries": sum(1 for e in live if e.dram_count())},
                "nvme": {"used_bytes": self._nvme.used_slots * s, "capacity_bytes": self._nvme.capacity * s,
                         "entries": sum(1 for e in live if e.nvme_count()), "io_mode": self._nvme.modes},
                "entries": len(live),
                "pinned": sum(1 for e in live if e.pins),
                "unsealed": sum(1 for e in live if not e.sealed),
                "ending": len(self._ending),
            }

    def audit(self) -> None:
        """Check that the slots the entries claim are exactly the slots the tiers count as used
        (no leak, no double use). Raises AssertionError. Meant for tests and debugging."""
        with self._cond:
            if self._closed:
                return
            holders = list(self._entries.values()) + list(self._ending)
            if self._pending or any(e.spilling or e.restoring for e in holders):
                return  # reservations in flight are owned by no entry yet
            dram = np.concatenate([e.loc[e.loc >= 0] for e in holders] + [_EMPTY])
            ext = np.concatenate([ext_of(e.loc[on_nvme(e.loc)]) for e in holders]
                                 + [a for e in holders for a in e.deferred_ext] + [_EMPTY])
            assert np.unique(dram).size == dram.size, "a DRAM slot belongs to two entries"
            assert dram.size == self._arena.used_slots, \
                f"entries hold {dram.size} DRAM slots, arena counts {self._arena.used_slots} used"
            assert not np.intersect1d(dram, self._arena.free_indices()).size, "a held DRAM slot is on the free list"
            assert np.array_equal(np.sort(ext), self._nvme.used_ids()), "NVMe extents held != extents allocated"
            for e in self._ending:
                assert not e.idle(), f"{e.key!r} ended and idle but not freed"

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Free everything and remove the NVMe files (and the shm file). Idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            deadline = time.monotonic() + _CLOSE_WAIT_S

            def busy() -> bool:  # movers and copies must finish before their memory goes away
                return bool(self._pending) or any(e.io or e.spilling or e.restoring
                                                  for e in list(self._entries.values()) + list(self._ending))
            while busy() and time.monotonic() < deadline:
                self._cond.wait(0.05)
            self._entries.clear()
            self._ending.clear()
            self._heap.clear()
        try:
            self._nvme.close()
        finally:
            self._arena.close()

    def __enter__(self) -> "TieredStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ================================================================== internals (lock held)
    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError("the store is closed")

    @staticmethod
    def _check_writer(e: Entry, writer: object) -> None:
        if e.writer is not None and not e.sealed and writer is not e.writer:
            raise UnknownTransferError(f"transfer {e.key!r} is not in this store (not for this caller)")

    def _add_entry(self, e: Entry) -> None:
        self._entries[e.key] = e
        self._tombs.discard(e.key)
        heapq.heappush(self._heap, (e.lease.deadline, e.seq, e.key))

    def _raise_missing(self, key: str) -> None:
        t = self._tombs.get(key)
        if t is not None:
            raise LeaseExpiredError(f"transfer {key!r} is gone: {t.cause} {self.clock.now() - t.at:.3g}s ago")
        raise UnknownTransferError(f"transfer {key!r} is not in this store")

    def _live(self, key: str) -> Entry:
        self._check_open()
        self._expire_locked()
        e = self._entries.get(key)
        if e is None:
            self._raise_missing(key)
        return e  # type: ignore[return-value]

    def _usable(self, key: str) -> Entry:
        """A live, sealed entry that is not mid-spill (waits for the spill to finish)."""
        while True:
            e = self._live(key)
            if not e.sealed:
                raise NotSealedError(f"transfer {key!r} is not sealed yet")
            if not e.spilling:
                return e
            self._cond.wait()

    def _readable(self, key: str, unsealed: bool) -> Entry:
        """`_usable`, except that unsealed=True also admits an entry still being staged (never a
        spill victim). A sealed one always goes through `_usable`: it may be mid-spill, and its
        DRAM slots are about to belong to someone else."""
        if unsealed:
            e = self._live(key)
            if not e.sealed:
                return e
        return self._usable(key)

    @staticmethod
    def _slice(e: Entry, layer: int, first_block: int, n: int) -> slice:
        if not 0 <= layer < e.num_layers:
            raise IndexError(f"layer {layer} out of range [0, {e.num_layers}) for {e.key!r}")
        if first_block < 0 or first_block + n > e.num_blocks:
            raise IndexError(f"blocks [{first_block}, {first_block + n}) out of range [0, {e.num_blocks}) "
                             f"for {e.key!r}")
        return e.index(int(layer), int(first_block), n)

    @classmethod
    def _positions(cls, e: Entry, layer: int | Sequence[int], first_block: int, rows: int) -> slice | np.ndarray:
        """Positions in e.loc of `rows` slots: n blocks from first_block of one layer (a slice) or
        of each of a list of layers, layer after layer (an index array; a slice when contiguous)."""
        if isinstance(layer, (int, np.integer)):
            return cls._slice(e, int(layer), first_block, rows)
        layers = [int(x) for x in layer]
        if not layers or rows % len(layers):
            raise ValueError(f"{rows} slots do not divide into the {len(layers)} layers {layers[:8]}")
        if len(set(layers)) != len(layers):
            raise ValueError(f"layers {layers[:8]} repeat")
        n = rows // len(layers)
        parts = [cls._slice(e, x, first_block, n) for x in layers]
        if all(b.start == a.stop for a, b in zip(parts, parts[1:])):
            return slice(parts[0].start, parts[-1].stop)  # whole consecutive layers: one slice
        return np.concatenate([np.arange(p.start, p.stop) for p in parts])

    def _expire_locked(self) -> list[str]:
        now = self.clock.now()
        out = []
        while self._heap and self._heap[0][0] <= now:
            _, seq, key = heapq.heappop(self._heap)
            e = self._entries.get(key)
            if e is None or e.seq != seq or not e.lease.expired(now):
                continue  # renewed since, or already gone
            self._end(e, "expired", e.lease.deadline)  # when it lapsed, not when we noticed: "expired 5s ago"
            out.append(key)
        return out

    def _end(self, e: Entry, cause: str, now: float | None = None) -> None:
        del self._entries[e.key]
        self._tombs.add(e.key, cause, self.clock.now() if now is None else now)
        e.ended = cause
        e.lease.release()
        self.stats.add(**{"expiries" if cause == "expired" else "releases": 1})
        if e.idle():
            self._free_entry(e)
        else:
            self._ending.add(e)

    def _free_entry(self, e: Entry) -> None:
        self._arena.free(e.loc[e.loc >= 0])
        self._nvme.free(ext_of(e.loc[on_nvme(e.loc)]))
        for a in e.deferred_ext:
            self._nvme.free(a)
        e.deferred_ext = []
        e.loc = _EMPTY
        self._ending.discard(e)

    def _settle(self, e: Entry) -> None:
        """After a holder lets go: free deferred extents and ended entries, wake waiters."""
        if e.io == 0 and e.deferred_ext:
            for a in e.deferred_ext:
                self._nvme.free(a)
            e.deferred_ext = []
        if e.ended is not None and e.idle() and e.loc.size:
            self._free_entry(e)
        self._cond.notify_all()

    @contextmanager
    def _unlocked(self) -> Iterator[None]:
        self._cond.release()
        try:
            yield
        finally:
            self._cond.acquire()

    def _full_message(self, key: str, layers: int, blocks: int) -> str:
        s, n = self.slot_bytes, layers * blocks
        live = self._entries.values()
        return (f"cannot stage {key!r}: needs {n} slots = {layers} layers x {blocks} blocks x {format_size(s)} "
                f"= {format_size(n * s)}; free: DRAM {format_size(self._arena.free_slots * s)} of "
                f"{format_size(self._arena.num_slots * s)}, NVMe {format_size(self._nvme.free_slots * s)} of "
                f"{format_size(self._nvme.capacity * s)} ({len(self._entries)} entries: "
                f"{sum(1 for e in live if e.pins)} pinned, {sum(1 for e in live if not e.sealed)} unsealed)")

    # ------------------------------------------------------------------ moving bytes
    def _move(self, loc: np.ndarray, buf: np.ndarray, to_store: bool) -> tuple[int, int]:
        """Copy between caller slots `buf` and the store slots `loc` (no lock held). Returns bytes
        moved from/to DRAM and NVMe."""
        in_dram = loc >= 0
        d_pos = np.flatnonzero(in_dram)
        n_pos = np.flatnonzero(~in_dram)
        if d_pos.size:
            if to_store:
                self._arena.copy_in(loc[d_pos], buf, d_pos)
            else:
                self._arena.copy_out(loc[d_pos], buf, d_pos)
        if n_pos.size:
            (self._nvme.write if to_store else self._nvme.read)(ext_of(loc[n_pos]), SlotRows(buf, n_pos))
        return d_pos.size * self.slot_bytes, n_pos.size * self.slot_bytes

    def _spill_io(self, victims: list[tuple[Entry, np.ndarray]], ext: np.ndarray) -> None:
        """Write the victims' DRAM slots to `ext` (no lock held; the victims are `spilling`)."""
        if not victims:
            return
        t0 = time.perf_counter()
        dram = np.concatenate([v.loc[pos] for v, pos in victims])
        self._nvme.write(ext, SlotRows(self._arena.slots, dram))
        self.stats.add(spills=len(victims), spill_slots=dram.size, spill_bytes=dram.size * self.slot_bytes,
                       spill_seconds=time.perf_counter() - t0)

    def _commit_spill(self, victims: list[tuple[Entry, np.ndarray]], ext: np.ndarray) -> np.ndarray:
        """Point the victims at their extents; return the DRAM slots they gave up (now the caller's)."""
        freed, at = [], 0
        for v, pos in victims:
            freed.append(v.loc[pos].copy())
            v.loc[pos] = nvme_loc(ext[at:at + pos.size])
            at += pos.size
            v.spilling = False
            self._settle(v)
        return np.concatenate(freed + [_EMPTY])

    def _restore_locked(self, e: Entry, want: np.ndarray, allow_spill: bool) -> None:
        """Bring e.loc[want] (positions on NVMe) into DRAM. Free DRAM first; then, if allowed, spill
        other sealed idle entries to make room; with NVMe full too, swap through a bounce buffer.
        Every step leaves a consistent state, so a failure part way leaves a valid mixed entry."""
        e.restoring = True
        pool = _EMPTY  # DRAM slots reserved for this restore
        t0 = time.perf_counter()
        restored = 0
        try:
            while True:
                pos = want[e.loc[want] < 0]
                if not pos.size or e.ended is not None:
                    return
                self._check_open()
                top_up = min(self._arena.free_slots, pos.size - pool.size)
                if top_up > 0:
                    pool = np.concatenate((pool, self._arena.alloc(top_up)))
                if pool.size:
                    chunk, dram, pool = pos[:pool.size], pool[:pos.size], pool[pos.size:]
                    ext = ext_of(e.loc[chunk])
                    try:
                        with self._unlocked():
                            self._nvme.read(ext, SlotRows(self._arena.slots, dram))
                    except BaseException:
                        pool = np.concatenate((pool, dram))
                        raise
                    e.loc[chunk] = dram
                    if e.io:
                        e.deferred_ext.append(ext)  # a reader may still be reading them
                    else:
                        self._nvme.free(ext)
                    restored += chunk.size
                    continue
                if not allow_spill:
                    return
                if not spillable_slots(self._entries.values(), exclude=e):
                    raise StoreFullError(f"cannot restore {e.key!r}: {pos.size} slots still on NVMe and no "
                                         f"DRAM can be freed (every entry in DRAM is pinned, unsealed or busy)")
                if self._nvme.free_slots:
                    victims = pick_victims(self._entries.values(), min(pos.size, self._nvme.free_slots), exclude=e)
                    ext = self._nvme.alloc(sum(p.size for _, p in victims), e.seq % max(1, len(self._nvme.files)))
                    for v, _ in victims:
                        v.spilling = True
                    try:
                        with self._unlocked():
                            self._spill_io(victims, ext)
                    except BaseException:
                        self._nvme.free(ext)
                        for v, _ in victims:
                            v.spilling = False
                            self._settle(v)
                        raise
                    pool = np.concatenate((pool, self._commit_spill(victims, ext)))
                    continue
                restored += self._swap_locked(e, pos)
        finally:
            self._arena.free(pool)
            e.restoring = False
            if restored:
                self.stats.add(restores=1, restore_slots=restored, restore_bytes=restored * self.slot_bytes,
                               restore_seconds=time.perf_counter() - t0)
            self._settle(e)

    def _swap_locked(self, e: Entry, pos: np.ndarray) -> int:
        """DRAM and NVMe both full: trade places between some of e's NVMe slots and victims' DRAM
        slots through a page-aligned bounce buffer. Returns how many slots of e came up."""
        e.spilling = True  # its extents get overwritten below: new readers must wait
        try:
            while e.io:  # ... and readers already in must leave first
                if not self._cond.wait(_CLOSE_WAIT_S):
                    raise StoreFullError(f"cannot restore {e.key!r}: both tiers are full and readers hold it")
            victims = pick_victims(self._entries.values(), min(pos.size, self._nvme.max_io_slots), exclude=e)
            c = sum(p.size for _, p in victims)
            if not c:
                raise StoreFullError(f"cannot restore {e.key!r}: no DRAM can be freed any more")
            chunk = pos[:c]
            ext = ext_of(e.loc[chunk])
            for v, _ in victims:
                v.spilling = True
            mm, bounce = aligned_empty(c * self.slot_bytes)
            rows = SlotRows(bounce.reshape(c, self.slot_bytes), np.arange(c))
            lost = False
            try:
                with self._unlocked():
                    self._nvme.read(ext, rows)
                    try:
                        self._spill_io(victims, ext)
                    except BaseException:
                        lost = True
                        self._nvme.write(ext, rows)  # put e's bytes back before giving up
                        lost = False
                        raise
                    self._arena.copy_in(np.concatenate([v.loc[p] for v, p in victims]), bounce.reshape(c, -1))
            except BaseException:
                for v, _ in victims:
                    v.spilling = False
                    self._settle(v)
                if lost and e.ended is None:  # its bytes are gone: never serve them
                    self._end(e, "dropped: NVMe I/O error during restore")
                raise
            finally:
                del rows, bounce
                mm.close()
            e.loc[chunk] = self._commit_spill(victims, ext)
            return c
        finally:
            e.spilling = False

    def _pin(self, key: str, layers: range | Sequence[int] | None,
             unsealed: bool = False) -> tuple[Entry, PinnedEntry]:
        with self._cond:
            while True:
                e = self._readable(key, unsealed)
                if not e.restoring:
                    break
                self._cond.wait()
            chosen = tuple(range(e.num_layers)) if layers is None else tuple(sorted(set(int(x) for x in layers)))
            for layer in chosen:
                if not 0 <= layer < e.num_layers:
                    raise IndexError(f"layer {layer} out of range [0, {e.num_layers}) for {key!r}")
            pos = np.concatenate([np.arange(l * e.num_blocks, (l + 1) * e.num_blocks) for l in chosen] + [_EMPTY])
            need = pos[e.loc[pos] < 0]
            if need.size and not e.sealed:
                raise StoreFullError(f"cannot pin unsealed {key!r}: {need.size} of its slots started on NVMe")
            if need.size:
                room = self._arena.free_slots + spillable_slots(self._entries.values(), exclude=e)
                if need.size > room:
                    raise StoreFullError(
                        f"cannot pin {key!r}: {need.size} slots ({format_size(need.size * self.slot_bytes)}) are on "
                        f"NVMe and only {room} DRAM slots can be freed (the rest are pinned, unsealed or busy)")
                self._restore_locked(e, need, allow_spill=True)
                if e.ended is not None:
                    self._raise_missing(key)
            e.pins += 1
            view = PinnedEntry(key, e.num_layers, e.num_blocks, chosen, e.loc.copy(), self._arena.slots,
                               self.slot_bytes, self._arena.base_address, self._arena.shm_path)
        self.stats.add(pins=1)
        return e, view


def _positions_where(idx: slice | np.ndarray, mask: np.ndarray) -> np.ndarray:
    """The entries of `idx` (a slice or an index array into e.loc) where `mask` (over idx) holds."""
    hits = np.flatnonzero(mask)
    return hits + idx.start if isinstance(idx, slice) else idx[hits]
