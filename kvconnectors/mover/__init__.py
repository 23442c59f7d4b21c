"""The data mover: every copy of KV bytes between an engine's cache and host memory.

vLLM-free on purpose (torch, numpy and the store only), so benchmarks, tests and the GPU check
drive the same classes the connector's worker wires up:
- `geometry`  where the bytes of a block live, for each layout vLLM hands a connector;
- `device`    copy stream, events, page-locked memory: CUDA, and a really asynchronous CPU twin;
- `stager`    engine blocks -> host store slots (producer);
- `loader`    host bytes -> engine blocks (consumer).
"""

from kvconnectors.mover.device import CopyEvent, CpuOps, CudaOps, DeviceOps, ops_for
from kvconnectors.mover.geometry import (LAYOUTS, PREFERRED_LAYOUT, BlockGeometry, UnsupportedKVCache,
                                         describe_kv_caches)
from kvconnectors.mover.loader import Loader
from kvconnectors.mover.stager import StagedCopy, Stager

__all__ = ["LAYOUTS", "PREFERRED_LAYOUT", "BlockGeometry", "CopyEvent", "CpuOps", "CudaOps", "DeviceOps", "Loader",
           "StagedCopy", "Stager", "UnsupportedKVCache", "describe_kv_caches", "ops_for"]
