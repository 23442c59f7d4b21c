"""The tiered host store: (layer, block) slots in a preallocated DRAM arena that spills to NVMe
extent files, every entry under a lease. See `store.TieredStore` for the API."""

from kvconnectors.store.config import StoreConfig
from kvconnectors.store.entry import EntryInfo
from kvconnectors.store.errors import NotSealedError, StoreClosedError
from kvconnectors.store.lease import (Clock, FakeClock, Lease, LeaseWire, MonotonicClock, offset_from_roundtrip,
                                      rebase)
from kvconnectors.store.reaper import Reaper
from kvconnectors.store.sizes import format_size, parse_size
from kvconnectors.store.store import TieredStore
from kvconnectors.store.views import PinnedEntry

__all__ = [
    "Clock", "EntryInfo", "FakeClock", "Lease", "LeaseWire", "MonotonicClock", "NotSealedError", "PinnedEntry",
    "Reaper", "StoreClosedError", "StoreConfig", "TieredStore", "format_size", "offset_from_roundtrip", "parse_size",
    "rebase",
]
