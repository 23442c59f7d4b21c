"""Counters of the store. Updated under a lock of their own, read as a plain dict snapshot (easy to
log, to diff in tests, or to export to Prometheus)."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

FIELDS = (
    "creates", "puts", "seals", "reads",
    "bytes_written_dram", "bytes_written_nvme",
    "bytes_read_dram", "bytes_read_nvme",
    "hits_dram", "hits_nvme",                 # read_into calls served wholly from DRAM / partly from NVMe
    "spills", "spill_slots", "spill_bytes", "spill_seconds",
    "restores", "restore_slots", "restore_bytes", "restore_seconds",
    "pins", "renewals", "releases", "expiries",
)


class StoreStats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._c: Counter[str] = Counter({f: 0 for f in FIELDS})
        self._failures: Counter[str] = Counter()

    def add(self, **counts: float) -> None:
        with self._lock:
            for k, v in counts.items():
                if k not in self._c:
                    raise KeyError(k)
                self._c[k] += v

    def failure(self, cause: str) -> None:
        """A staging failure (create/write/seal did not happen) by cause: store_full, io_error, ..."""
        with self._lock:
            self._failures[cause] += 1

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        with self._lock:
            if name == "staging_failures":
                return dict(self._failures)
            if name in self._c:
                return self._c[name]
        raise AttributeError(name)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = dict(self._c)
            out["staging_failures"] = dict(self._failures)
            return out
