"""The device operations the mover needs, behind one small interface: a copy stream, events,
and page-locked host memory.

Two implementations with the same asynchronous contract: `CudaOps` (a dedicated CUDA copy
stream, CUDA events, cudaHostRegister) and `CpuOps`, whose copy stream is a real thread and
whose events complete when that thread has run the copy, so CI exercises the contract that a
GPU run relies on: enqueueing returns at once, completion is observed only through the event.
"""

from __future__ import annotations

import resource
import threading
import time
from abc import ABC, abstractmethod
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import numpy as np
import torch

from kvconnectors.errors import ConfigError
from kvconnectors.logs import get_logger

logger = get_logger(__name__)


class CopyEvent(ABC):
    """A point on a stream: done once every copy enqueued before it has completed."""

    @abstractmethod
    def done(self) -> bool: ...

    @abstractmethod
    def wait(self, timeout_s: float | None = None) -> None:
        """Block until done; TimeoutError after timeout_s; re-raises a failed copy's error."""


class DoneEvent(CopyEvent):
    """Nothing to wait for (e.g. the forward of a CPU engine, which is synchronous)."""

    def done(self) -> bool:
        return True

    def wait(self, timeout_s: float | None = None) -> None:
        return None


class FutureEvent(CopyEvent):
    def __init__(self, future: Future):
        self.future = future

    def done(self) -> bool:
        return self.future.done()

    def wait(self, timeout_s: float | None = None) -> None:
        try:
            self.future.result(timeout=timeout_s)
        except TimeoutError:
            raise TimeoutError(f"copy not done after {timeout_s:.3f}s") from None


class DeviceOps(ABC):
    """Copy stream, events and host memory of one device type."""

    # wait_for_save blocks the host on the step's copy events (those alone, never a device-wide
    # synchronize): vLLM may hand a finished request's blocks to another request in the next step.
    device_type: str

    @abstractmethod
    def forward_event(self) -> CopyEvent:
        """An event at the current point of the forward stream (the layer just computed)."""

    @abstractmethod
    def enqueue(self, copy: Callable[[], None], after: CopyEvent | None = None) -> CopyEvent:
        """Run `copy` (torch copies) on the copy stream once `after` is done; returns at once
        with an event that is done when the copies are."""

    @abstractmethod
    def host_buffer(self, nbytes: int) -> np.ndarray:
        """A page-locked host buffer (uint8) that async copies may use."""

    @abstractmethod
    def pin(self, array: np.ndarray, what: str) -> bool:
        """Page-lock existing host memory for async DMA; False (said once) when it cannot be."""

    def index(self, ids: np.ndarray) -> torch.Tensor:
        """Block ids as an index tensor on the device."""
        return torch.as_tensor(np.ascontiguousarray(ids, dtype=np.int64))

    @abstractmethod
    def gather(self, src: torch.Tensor, ids: torch.Tensor, out: torch.Tensor, dim: int = 0) -> None:
        """out (host, contiguous) = src.index_select(dim, ids): one batched copy; call inside `enqueue`."""

    @abstractmethod
    def scatter(self, rows: torch.Tensor, dst: torch.Tensor, ids: torch.Tensor) -> None:
        """dst[ids] = rows (host): one batched copy; call inside `enqueue`."""

    def close(self) -> None:
        return None


_WORDS = (torch.int64, torch.int32, torch.int16)


def _word_view(t: torch.Tensor, word: torch.dtype) -> torch.Tensor | None:
    try:
        return t.view(word)  # needs a contiguous last dim and strides/offset divisible by the word
    except RuntimeError:
        return None


def same_words(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """a and b reinterpreted as the widest integer word both allow (same bytes, fewer elements);
    unchanged when no wider word fits both."""
    for word in _WORDS:
        if word.itemsize <= min(a.element_size(), b.element_size()):
            break
        va, vb = _word_view(a, word), _word_view(b, word)
        if va is not None and vb is not None:
            return va, vb
    return a, b


class CpuOps(DeviceOps):
    """vLLM's CPU backend: a copy thread is the stream (FIFO, like a CUDA stream)."""

    device_type = "cpu"

    def __init__(self, name: str = "kvc-copy"):
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    def forward_event(self) -> CopyEvent:
        return DoneEvent()

    def enqueue(self, copy: Callable[[], None], after: CopyEvent | None = None) -> CopyEvent:
        def run() -> None:
            if after is not None:
                after.wait()
            copy()
        return FutureEvent(self._thread.submit(run))

    def gather(self, src: torch.Tensor, ids: torch.Tensor, out: torch.Tensor, dim: int = 0) -> None:
        # Straight into the destination (one copy), moved as 8-byte words where the rows allow: torch's
        # CPU index_select copies element by element, and bf16 rows go ~3x slower than the same bytes
        # as int64 (both measured in `bench transfer --paths mover`).
        src_w, out_w = same_words(src, out)
        torch.index_select(src_w, dim, ids, out=out_w)

    def scatter(self, rows: torch.Tensor, dst: torch.Tensor, ids: torch.Tensor) -> None:
        # numpy's fancy assignment copies whole rows; torch's index_copy_ goes byte by byte on uint8
        dst.numpy()[ids.numpy()] = rows.numpy()

    def host_buffer(self, nbytes: int) -> np.ndarray:
        return np.empty(nbytes, dtype=np.uint8)

    def pin(self, array: np.ndarray, what: str) -> bool:
        return True  # host memory is what a CPU engine copies from and to

    def close(self) -> None:
        self._thread.shutdown(wait=True)


class CudaEvent(CopyEvent):
    def __init__(self, event: "torch.cuda.Event"):
        self.event = event

    def done(self) -> bool:
        return bool(self.event.query())

    def wait(self, timeout_s: float | None = None) -> None:
        if timeout_s is None:
            self.event.synchronize()
            return
        deadline = time.monotonic() + timeout_s
        pause = 20e-6
        while not self.event.query():  # poll: Event.synchronize() has no timeout
            if time.monotonic() >= deadline:
                raise TimeoutError(f"CUDA copy not done after {timeout_s:.3f}s")
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)


class CudaOps(DeviceOps):
    """A dedicated copy stream per worker; the forward stream is never synchronized."""

    device_type = "cuda"

    def __init__(self, device: torch.device | int | None = None):
        self.device = torch.device("cuda", torch.cuda.current_device() if device is None else
                                   torch.device(device).index or 0)
        self.stream = torch.cuda.Stream(device=self.device)
        self._pinned: list[tuple[int, int]] = []
        self._lock = threading.Lock()
        self._warned: set[str] = set()

    def forward_event(self) -> CopyEvent:
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return CudaEvent(ev)

    def enqueue(self, copy: Callable[[], None], after: CopyEvent | None = None) -> CopyEvent:
        with self._lock, torch.cuda.stream(self.stream):  # callers on several threads share the stream
            if isinstance(after, CudaEvent):
                self.stream.wait_event(after.event)
            elif after is not None:
                after.wait()
            copy()
            ev = torch.cuda.Event()
            ev.record(self.stream)
        return CudaEvent(ev)

    def gather(self, src: torch.Tensor, ids: torch.Tensor, out: torch.Tensor, dim: int = 0) -> None:
        # gather on the device (HBM bandwidth), then one DMA into page-locked host memory
        out.copy_(src.index_select(dim, ids), non_blocking=True)

    def scatter(self, rows: torch.Tensor, dst: torch.Tensor, ids: torch.Tensor) -> None:
        dst.index_copy_(0, ids, rows.to(self.device, non_blocking=True))

    def host_buffer(self, nbytes: int) -> np.ndarray:
        # torch's caching host allocator: a freed buffer is reused, not pinned again, so the bounce
        # buffers of an arena that could not be page-locked stay a pool of the copies in flight
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy()

    def index(self, ids: np.ndarray) -> torch.Tensor:
        host = torch.as_tensor(np.ascontiguousarray(ids, dtype=np.int64)).pin_memory()
        return host.to(self.device, non_blocking=True)

    def pin(self, array: np.ndarray, what: str) -> bool:
        nbytes = array.nbytes
        ptr = array.ctypes.data
        err = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0))
        if err != 0:
            soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
            limit = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft} B"
            self._say_once(what, f"cannot page-lock {what} ({nbytes} B): cudaHostRegister failed with error {err}; "
                                 f"RLIMIT_MEMLOCK is {limit} (raise it with `ulimit -l unlimited` or the "
                                 "container's memlock limit); copies go through pinned bounce buffers instead")
            return False
        self._pinned.append((ptr, nbytes))
        return True

    def _say_once(self, what: str, message: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            logger.warning(message)

    def close(self) -> None:
        self.stream.synchronize()
        for ptr, _ in self._pinned:
            torch.cuda.cudart().cudaHostUnregister(ptr)
        self._pinned.clear()


def ops_for(device_type: str) -> DeviceOps:
    """The device operations for a registered cache's device type."""
    if device_type == "cuda":
        return CudaOps()
    if device_type in ("cpu", "meta"):
        return CpuOps()
    raise ConfigError("kv_caches", device_type, "TieredConnector moves KV caches on cpu or cuda devices only")
