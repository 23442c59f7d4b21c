"""Remember why recently ended keys ended, so a late reader gets "lease expired" (the producer
dropped it) instead of "unknown transfer" (the producer never had it). Bounded: oldest forgotten first."""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple


class Tombstone(NamedTuple):
    cause: str     # "released", "expired", "dropped: <why>"
    at: float      # store clock reading when it ended


class Tombstones:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self._d: OrderedDict[str, Tombstone] = OrderedDict()

    def add(self, key: str, cause: str, at: float) -> None:
        self._d[key] = Tombstone(cause, at)
        self._d.move_to_end(key)
        while len(self._d) > self.capacity:
            self._d.popitem(last=False)

    def get(self, key: str) -> Tombstone | None:
        return self._d.get(key)

    def discard(self, key: str) -> None:
        self._d.pop(key, None)

    def __len__(self) -> int:
        return len(self._d)
