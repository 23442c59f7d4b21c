"""One transfer's bookkeeping: where each of its (layer, block) slots lives, its lease, its pins.

Slots of one entry may sit in different tiers (the tail of an entry spills first, and an entry too
big for free DRAM starts partly on NVMe). `loc[i]` for slot i = layer * num_blocks + block is a DRAM
slot number when >= 0 and NVMe extent id `-loc[i] - 1` when < 0, or UNRESERVED: an entry created
with reserve=False (a landing entry) gets its slots as its writer reserves them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from kvconnectors.store.lease import Lease


UNRESERVED = np.iinfo(np.int64).min  # a slot position that holds no slot yet


def on_nvme(loc: np.ndarray) -> np.ndarray:
    """Mask of the positions of `loc` that name an NVMe extent (not DRAM, not UNRESERVED)."""
    return (loc < 0) & (loc != UNRESERVED)


def nvme_loc(ext_ids: np.ndarray) -> np.ndarray:
    return -np.asarray(ext_ids, dtype=np.int64) - 1


def ext_of(loc: np.ndarray) -> np.ndarray:
    return -loc - 1


@dataclass(eq=False)
class Entry:
    key: str
    num_layers: int
    num_blocks: int
    lease: Lease
    loc: np.ndarray
    seq: int                                  # creation order: tie-break for spill order
    sealed: bool = False
    checksums: dict | None = None
    written: np.ndarray = field(default=None)  # type: ignore[assignment]
    pins: int = 0                             # pinned_views holders
    io: int = 0                               # read_into/write calls copying right now
    writes: int = 0                           # of those, writes (a seal must wait for them, not for reads)
    spilling: bool = False                    # its DRAM slots are being handed away: no new refs
    restoring: bool = False                   # a restore is moving it up: no second mover
    ended: str | None = None                  # detached from the key table (released/expired); free when idle
    deferred_ext: list[np.ndarray] = field(default_factory=list)  # extents freed once io == 0
    writer: object = None                     # while unsealed, only this renews or releases it

    def __post_init__(self) -> None:
        if self.written is None:
            self.written = np.zeros(self.loc.size, dtype=bool)

    @property
    def num_slots(self) -> int:
        return self.loc.size

    def index(self, layer: int, first_block: int, n: int) -> slice:
        s = layer * self.num_blocks + first_block
        return slice(s, s + n)

    def dram_count(self) -> int:
        return int(np.count_nonzero(self.loc >= 0))

    def nvme_count(self) -> int:
        return int(np.count_nonzero(on_nvme(self.loc))) + sum(a.size for a in self.deferred_ext)

    def idle(self) -> bool:
        return self.pins == 0 and self.io == 0 and not self.spilling and not self.restoring

    def spillable(self) -> bool:
        return self.sealed and self.ended is None and self.idle()


class EntryInfo(NamedTuple):
    key: str
    num_layers: int
    num_blocks: int
    sealed: bool
    pins: int
    dram_slots: int
    nvme_slots: int
    nvme_slots_by_dir: dict[str, int]
    remaining_s: float
