"""Helpers of the security tests (a small store's geometry, staging, destination views)."""

from __future__ import annotations

import numpy as np
import xxhash

from kvconnectors.store import TieredStore
from kvconnectors.transport import wire

SLOT, LAYERS, BLOCKS = 4096, 2, 4
FP = "fp-security"
COMPAT = wire.compat_hash("tiered")
SECRET = b"security-s3cret-s3cret"


def stage(store: TieredStore, tid: str, seed: int = 0) -> np.ndarray:
    data = np.random.default_rng(seed).integers(0, 256, (LAYERS, BLOCKS, SLOT), dtype=np.uint8)
    store.create(tid, LAYERS, BLOCKS)
    for layer in range(LAYERS):
        store.write(tid, layer, 0, data[layer])
    store.seal(tid, {"xxh3": [xxhash.xxh3_64_intdigest(data[l, b]) for l in range(LAYERS) for b in range(BLOCKS)]})
    return data


def dest_views() -> tuple[np.ndarray, list[memoryview]]:
    cache = np.zeros((LAYERS, BLOCKS, SLOT), np.uint8)
    return cache, [memoryview(cache[l, b]) for l in range(LAYERS) for b in range(BLOCKS)]
