"""GPU-direct NIXL pulls: a consumer whose KV cache is in CUDA memory registers that memory with
NIXL as VRAM once at start-up (per rank), and each pull READs the producer's pinned arena slots
straight into the device blocks: no host bounce on the decode side.

This module decides and describes; the READ itself is NixlSink.read_runs (nixl_sink.py), the path
NixlDevicePull (paths/nixl_device.py), the wiring and the log line / metric the worker's (tiered/worker.py):

- `why_not_direct`: the cases that keep the host path whatever NIXL can do (the layout splits a
  block of a layer into several runs; checksum verification is on and cannot run on the device);
- `open_direct`: make the agent, check its UCX backend lists VRAM, register every device storage
  of the cache; any failure is a `Fallback` naming the reason, never an exception;
- `device_rows` + `merge_runs`: one pull's descriptors, one per (layer, block) row, then adjacent
  rows (adjacent on both sides) merged into one run.

Checksums: xxh3 per row is a host function, and device memory is not hashable without copying it
back (a device-to-host bounce of every byte: the cost the direct path exists to avoid). So the
direct path is used only with `checksum: false`; with checksums on, the consumer keeps the host path,
which verifies every row before it reaches the blocks, and says so once at start-up.

Trust model (README, Security): the consumer never sends its own agent metadata to anyone (it
only loads producers'), so registering its KV cache as VRAM exposes it to no peer; what a nixl
consumer can READ of a producer's arena is unchanged by this path.

NOT VALIDATED ON HARDWARE (CUDA_VALIDATED below): the decisions, descriptors, merging and fallback
run in CPU unit tests with the NIXL agent faked at its boundary; the CUDA-only steps (the device
pointers of CUDA storages, UCX registering and READing VRAM) have never run on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from kvconnectors.errors import TransferError

if TYPE_CHECKING:
    from kvconnectors.mover.geometry import BlockGeometry
    from kvconnectors.transport.nixl import NixlSink

# Set True once a GPU run has READ through this path byte-exact (as benchmarks/device.py's flag).
CUDA_VALIDATED = False
# Why a CUDA + nixl consumer keeps the host path: the `reason` label of kvconnectors:nixl_vram_fallbacks.
REASONS = ("layout", "checksum", "agent", "no_vram", "registration")


@dataclass(frozen=True)
class Fallback:
    """The direct path is not used on this rank: `reason` (one of REASONS) and why, for the log."""
    reason: str
    detail: str

    def __post_init__(self) -> None:
        if self.reason not in REASONS:
            raise ValueError(f"fallback reason {self.reason!r} is not one of {REASONS}")


@dataclass(frozen=True)
class DeviceRows:
    """A GPU-direct pull's destination: the device address of each (layer, block) row, layer after
    layer, every row `row_bytes` long, on CUDA device `device`."""
    addrs: np.ndarray  # uint64
    row_bytes: int
    device: int

    def __len__(self) -> int:
        return len(self.addrs)


def applies(device: str, transport: str) -> bool:
    """Whether a consumer decides about the direct path at all (a host cache needs none: its
    blocks are registered as DRAM and READ into directly)."""
    return transport == "nixl" and device == "cuda"


def why_not_direct(geometry: "BlockGeometry", *, checksum: bool) -> Fallback | None:
    """What keeps this cache on the host path before NIXL is asked anything, or None."""
    if not geometry.block_contiguous:
        return Fallback("layout", (
            f"layout {geometry.layout} stores a block of one layer as {geometry.runs} runs of {geometry.run_bytes} B, "
            "and the producer's slot is one run: a READ would need one descriptor per run (the host path "
            "scatters them instead); the connector asks for LBHNC, one run per block"))
    if checksum:
        return Fallback("checksum", (
            "checksum is on, and the xxh3 of each row cannot be computed on the device without copying it "
            "back (the bounce the direct path avoids); the host path verifies every row; set checksum false "
            "to READ into device memory directly"))
    return None


def device_index(geometry: "BlockGeometry") -> int:
    index = geometry.views[0].device.index
    return int(index) if index is not None else 0


def device_regions(geometry: "BlockGeometry") -> list[tuple[int, int]]:
    """The cache's allocations (address, nbytes), each once: cross-layer layouts are one allocation
    for all layers, layer-first ones one per layer (or one, when vLLM carved them from one)."""
    seen: dict[int, int] = {}
    for view in geometry.views:
        storage = view.untyped_storage()
        seen.setdefault(int(storage.data_ptr()), int(storage.nbytes()))
    return sorted(seen.items())


def device_rows(geometry: "BlockGeometry", layers: range | list[int], block_ids: list[int]) -> DeviceRows:
    """Where each (layer, block) row of `layers` x `block_ids` starts in device memory (one run per
    block: `why_not_direct` refused the others)."""
    if not geometry.block_contiguous:
        raise ValueError(f"layout {geometry.layout} has {geometry.runs} runs per block: no direct rows")
    base = np.array([geometry.views[layer].data_ptr() for layer in layers], dtype=np.uint64)
    ids = np.asarray(block_ids, dtype=np.uint64)
    addrs = (base[:, None] + ids[None, :] * np.uint64(geometry.block_stride)).reshape(-1)
    return DeviceRows(addrs=addrs, row_bytes=geometry.block_bytes, device=device_index(geometry))


def merge_runs(local: np.ndarray, remote: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(local, remote, lengths) READ descriptors for rows local[i] <- remote[i] of `length` bytes:
    rows sorted by local address, and a row that continues the previous one on *both* sides joins
    its run (consecutive blocks of a layer into consecutive arena slots: one descriptor)."""
    local = np.asarray(local, dtype=np.uint64)
    remote = np.asarray(remote, dtype=np.uint64)
    if local.shape != remote.shape or local.ndim != 1 or length <= 0:
        raise ValueError(f"{local.shape} local and {remote.shape} remote rows of {length} B")
    if local.size == 0:
        return local, remote, np.empty(0, dtype=np.uint64)
    order = np.argsort(local, kind="stable")
    loc, rem = local[order], remote[order]
    step = np.uint64(length)
    joins = (loc[1:] == loc[:-1] + step) & (rem[1:] == rem[:-1] + step)
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    counts = np.diff(np.append(starts, loc.size)).astype(np.uint64)
    return loc[starts], rem[starts], counts * step


def open_direct(geometry: "BlockGeometry", *, checksum: bool,
                sink_factory: Callable[[], "NixlSink"]) -> tuple["NixlSink | None", Fallback | None]:
    """The consumer agent with the device cache registered as VRAM, or why not (the agent is
    closed then: the host path needs none). Never raises for a NIXL failure."""
    fallback = why_not_direct(geometry, checksum=checksum)
    if fallback is not None:
        return None, fallback
    try:
        sink = sink_factory()
    except TransferError as exc:
        return None, Fallback("agent", f"the NIXL consumer agent could not be created: {exc.detail}")
    try:
        types = sink.mem_types()
        if "VRAM" not in types:
            _close(sink)
            return None, Fallback("no_vram", f"NIXL's UCX backend registers memory types {types}, not VRAM")
        sink.register_regions(device_regions(geometry), mem="VRAM", device=device_index(geometry))
    except TransferError as exc:
        _close(sink)
        return None, Fallback("registration", exc.detail)
    except Exception as exc:  # a binding error outside NixlSink's typed ones: still a fallback, not a crash
        _close(sink)
        return None, Fallback("registration", f"{type(exc).__name__}: {exc}")
    return sink, None


def _close(sink: Any) -> None:
    try:
        sink.close()
    except Exception:  # noqa: BLE001 - closing a half-made agent must not hide the reason we report
        pass
