"""The data mover: every copy of KV bytes between an engine's cache and host memory.

vLLM-free on purpose (torch, numpy and the store only), so benchmarks, tests and the GPU check
drive the same classes the connector's worker wires up:
- `geometry`      where the bytes of a block live, for each layout vLLM hands a connector;
- `device`        copy stream, events, page-locked memory: CUDA, and a really asynchronous CPU twin;
- `stager`        engine blocks -> host store slots (producer);
- `loader`        host bytes -> engine blocks (consumer);
- `block_views`   a transfer's destination blocks as views, each made when asked for;
- `block_shares`  per-block copy and checksum work split over threads (shm's copy in C);
- `checksums`     the per-block xxh3 checksum, its check and the error a mismatch raises;
- `heads`         which KV heads each tensor-parallel rank holds (pure arithmetic);
- `reslice`       head slices of host rows, and the check, pack and rehash of a sliced send.

The names below load on first use: `block_views`, `block_shares` and `checksums` need numpy (and
xxhash) only, and the transport uses them without paying for torch.
"""

from importlib import import_module

_EXPORTS = {
    "CopyEvent": "device", "CpuOps": "device", "CudaOps": "device", "DeviceOps": "device", "ops_for": "device",
    "LAYOUTS": "geometry", "PREFERRED_LAYOUT": "geometry", "BlockGeometry": "geometry",
    "UnsupportedKVCache": "geometry", "describe_kv_caches": "geometry",
    "Loader": "loader", "StagedCopy": "stager", "Stager": "stager",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
