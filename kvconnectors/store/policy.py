"""Which DRAM slots to spill when room is needed.

Entries go oldest lease deadline first (the transfer closest to being given up is the least likely
to be read soon; ties by creation order), and within an entry its *last* slots go first: consumers
read layer by layer from layer 0, so the head stays in DRAM and the first reads hit it while the
tail comes back from NVMe.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np

from kvconnectors.store.entry import Entry


def pick_victims(entries: Iterable[Entry], need: int, exclude: Entry | None = None) -> list[tuple[Entry, np.ndarray]]:
    """Up to `need` DRAM slot positions from spillable entries, as (entry, positions in entry.loc)."""
    out: list[tuple[Entry, np.ndarray]] = []
    if need <= 0:
        return out
    for e in sorted((e for e in entries if e is not exclude and e.spillable()),
                    key=lambda e: (e.lease.deadline, e.seq)):
        pos = np.sort(np.flatnonzero(e.loc >= 0)[::-1][:need])  # the tail, in slot order
        if pos.size:
            out.append((e, pos))
            need -= pos.size
            if need == 0:
                break
    return out


def spillable_slots(entries: Iterable[Entry], exclude: Entry | None = None) -> int:
    return sum(e.dram_count() for e in entries if e is not exclude and e.spillable())
