"""The consumer's NIXL agent (`NixlSink`): local memory registered once and range-checked, producers'
agents loaded and cached per address, and READs of remote arena blocks driven to DONE or a deadline,
their handles released on every path (nixl.py has the whole exchange).
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from kvconnectors.errors import FailureCause, TransferError
from kvconnectors.logs import get_logger
from kvconnectors.transport.nixl_agent import Backoff, cause_of, create_agent, describe_error, reg_descs, xfer_descs

logger = get_logger(__name__)

MEM_TYPES = ("DRAM", "VRAM")


def _mem_type(mem: str) -> str:
    if mem not in MEM_TYPES:
        raise ValueError(f"NIXL memory type {mem!r} is not one of {MEM_TYPES}")
    return mem


class NixlSink:
    """The consumer's agent (one per worker process): READs remote arena blocks into local memory
    registered once with `register`. Safe to call from several pull threads."""

    def __init__(self, *, name: str | None = None, tag: str = ""):
        self._agent = create_agent("consumer", name, tag)
        self.name: str = self._agent.name
        self._lock = threading.Lock()               # peers, registrations, counters
        self._regs: dict[tuple[str, int, int, int], Any] = {}  # (mem type, device, addr, nbytes) -> nixlRegDList
        # (mem type, device) -> sorted registered regions (starts, ends), for the range check
        self._ranges: dict[tuple[str, int], tuple[np.ndarray, np.ndarray]] = {}
        self._peers: dict[str, tuple[bytes, str]] = {}  # producer address -> (agent metadata, agent name)
        self._stuck: list[Any] = []                 # handles NIXL refused to release (still active)
        self.open_handles = 0                       # prepped dlists + xfer handles not yet released
        self.reads = 0
        self.peer_loads = 0
        self._closed = False

    # -------------------------------------------------------------- registration
    def mem_types(self) -> list[str]:
        """The memory types the UCX backend can register ("DRAM", "VRAM"; VRAM only where UCX was
        built with CUDA support, and even then registration may still fail on the device)."""
        with self._lock:
            self._check_open()
            types = self._agent.get_backend_mem_types("UCX")
        return [str(t).removesuffix("_SEG") for t in types]

    def register(self, arrays: Iterable[Any]) -> None:
        """Register each array's memory (numpy arrays or CPU tensors, contiguous) once."""
        regions = []
        for arr in arrays:
            if hasattr(arr, "data_ptr"):  # torch tensor
                regions.append((int(arr.data_ptr()), int(arr.numel() * arr.element_size())))
            else:
                a = np.asarray(arr)
                if not a.flags.c_contiguous:
                    raise ValueError("NIXL registration needs contiguous memory")
                regions.append((int(a.ctypes.data), int(a.nbytes)))
        self.register_regions(regions)

    def register_regions(self, regions: Iterable[tuple[int, int]], mem: str = "DRAM", device: int = 0) -> None:
        """Register each (address, nbytes) region of `mem` memory (VRAM: on CUDA device `device`) once."""
        mem = _mem_type(mem)
        where = f"{mem} memory" + (f" on device {device}" if mem == "VRAM" else "")
        with self._lock:
            self._check_open()
            try:
                for addr, nbytes in regions:
                    key = (mem, int(device), int(addr), int(nbytes))
                    if key in self._regs or nbytes <= 0:
                        continue
                    try:
                        self._regs[key] = self._agent.register_memory(reg_descs([(addr, nbytes)], device), mem)
                    except Exception as exc:
                        raise TransferError(FailureCause.PROTOCOL, (
                            f"NIXL consumer agent {self.name!r} could not register local {where} "
                            f"(0x{addr:x}, {nbytes} B): {describe_error(exc)}")) from None
            finally:  # what did register stays registered (deregistered at close) and in the range check
                self._index_locked()

    def _index_locked(self) -> None:
        spans: dict[tuple[str, int], list[tuple[int, int]]] = {}
        for mem, dev, addr, nbytes in sorted(self._regs):
            spans.setdefault((mem, dev), []).append((addr, addr + nbytes))
        self._ranges = {k: (np.array([a for a, _ in v], dtype=np.uint64), np.array([e for _, e in v], dtype=np.uint64))
                        for k, v in spans.items()}

    def _check_local(self, addrs: np.ndarray, lengths: np.ndarray, mem: str = "DRAM", device: int = 0) -> None:
        starts, ends = self._ranges.get((mem, device), (np.empty(0, np.uint64), np.empty(0, np.uint64)))
        if starts.size == 0:
            where = f"{mem} memory" + (f" on device {device}" if mem == "VRAM" else "")
            raise TransferError(FailureCause.PROTOCOL, f"no local {where} is registered with the NIXL consumer agent")
        i = np.searchsorted(starts, addrs, side="right") - 1
        ok = (i >= 0) & (addrs + lengths <= ends[np.maximum(i, 0)])
        if not ok.all():
            k = int(np.flatnonzero(~ok)[0])
            raise TransferError(FailureCause.PROTOCOL, (
                f"destination block at 0x{int(addrs[k]):x} (+{int(lengths[k])} B) is outside the memory "
                f"registered with NIXL as {mem}"))

    # -------------------------------------------------------------- peers
    def _peer(self, key: str, meta: bytes) -> str:
        with self._lock:
            self._check_open()
            cached = self._peers.get(key)
            if cached is not None and cached[0] == meta:
                return cached[1]
            if cached is not None:  # the producer restarted (new agent) or re-registered: drop the stale one
                logger.info("NIXL producer at %s changed agent (%s); reloading its metadata", key, cached[1])
                self._remove_locked(key)
            try:
                name = self._agent.add_remote_agent(meta)
            except Exception as exc:
                # BACKEND here is UCX failing to create the endpoint: the producer is not there
                cause = (FailureCause.PEER_UNREACHABLE if "Backend" in type(exc).__name__ else cause_of(exc))
                raise TransferError(cause, f"NIXL could not load the agent of producer {key} "
                                           f"(add_remote_agent: {describe_error(exc)})") from None
            name = name.decode() if isinstance(name, bytes) else str(name)
            self._peers[key] = (meta, name)
            self.peer_loads += 1
            return name

    def _remove_locked(self, key: str) -> None:
        entry = self._peers.pop(key, None)
        if entry is None:
            return
        if any(other[1] == entry[1] for other in self._peers.values()):
            return  # the same agent is still known under another address
        try:
            self._agent.remove_remote_agent(entry[1])
        except Exception as exc:
            logger.debug("NIXL remove_remote_agent(%s) failed: %s", entry[1], describe_error(exc))

    def forget(self, key: str) -> None:
        """Drop the cached agent of the producer at `key` (it failed; the next pull reloads it)."""
        with self._lock:
            if not self._closed:
                self._remove_locked(key)

    @property
    def peers(self) -> dict[str, str]:
        with self._lock:
            return {k: v[1] for k, v in self._peers.items()}

    # -------------------------------------------------------------- transfers
    def read_blocks(self, key: str, meta: bytes, base_address: int, offsets: Sequence[int],
                    dest: Sequence[memoryview], deadline: float, local_addrs: np.ndarray | None = None) -> int:
        """READ remote blocks [base_address + offsets[i], +len(dest[i])) into dest[i]; all blocks the
        same size. `local_addrs`: dest's addresses when the caller has them precomputed (spares
        taking each view's address). Returns the bytes read."""
        if not dest:
            return 0
        length = len(dest[0])
        if local_addrs is None:
            local = np.fromiter((_address(v, length) for v in dest), dtype=np.uint64, count=len(dest))
        else:
            local = np.asarray(local_addrs, dtype=np.uint64)
            if local.shape != (len(dest),):
                raise TransferError(FailureCause.PROTOCOL,
                                    f"{local.size} destination addresses given for {len(dest)} blocks")
        return self.read(key, meta, base_address + np.asarray(offsets, dtype=np.uint64), local, length, deadline)

    def read(self, key: str, meta: bytes, remote_addrs: np.ndarray, local_addrs: np.ndarray, length: int,
             deadline: float) -> int:
        """READ `length` bytes from each remote_addrs[i] of the producer known as `key` (its address)
        with agent metadata `meta` into local_addrs[i] (registered DRAM); poll until done or `deadline`."""
        n = len(local_addrs)
        if n != len(remote_addrs) or n == 0 or length <= 0:
            raise TransferError(FailureCause.PROTOCOL,
                                f"NIXL read of {len(remote_addrs)} remote and {n} local blocks of {length} B")
        return self.read_runs(key, meta, remote_addrs, local_addrs, np.full(n, length, dtype=np.uint64), deadline)

    def read_runs(self, key: str, meta: bytes, remote_addrs: np.ndarray, local_addrs: np.ndarray,
                  lengths: np.ndarray, deadline: float, *, mem: str = "DRAM", device: int = 0) -> int:
        """READ lengths[i] bytes from remote_addrs[i] into local_addrs[i] of registered `mem` memory
        (VRAM: on CUDA device `device`); returns once NIXL says DONE (the bytes are there), or
        raises. Returns the bytes read."""
        mem = _mem_type(mem)
        remote_addrs = np.asarray(remote_addrs, dtype=np.uint64)
        local_addrs = np.asarray(local_addrs, dtype=np.uint64)
        lengths = np.asarray(lengths, dtype=np.uint64)
        n = len(local_addrs)
        if n != len(remote_addrs) or n != len(lengths) or n == 0 or not (lengths > 0).all():
            raise TransferError(FailureCause.PROTOCOL, (
                f"NIXL read of {len(remote_addrs)} remote and {n} local runs with {len(lengths)} lengths "
                f"(smallest {int(lengths.min()) if lengths.size else 0} B)"))
        if not meta:
            raise TransferError(FailureCause.PROTOCOL, f"producer {key} sent no NIXL agent metadata")
        self._check_local(local_addrs, lengths, mem, device)
        total = int(lengths.sum())
        remote_name = self._peer(key, meta)
        what = f"NIXL READ of {n} blocks ({total} B, into {mem}) from producer {key} (agent {remote_name})"
        agent = self._agent
        handles: list[Any] = []
        xfer = None
        state = "NEW"
        try:
            try:
                loc = self._track(agent.prep_xfer_dlist("NIXL_INIT_AGENT", xfer_descs(local_addrs, lengths, device),
                                                        mem))
                handles.append(loc)
                rem = self._track(agent.prep_xfer_dlist(remote_name, xfer_descs(remote_addrs, lengths), "DRAM"))
                handles.append(rem)
                idx = np.arange(n, dtype=np.int32)
                xfer = self._track(agent.make_prepped_xfer("READ", loc, idx, rem, idx))
            except TransferError:
                raise
            except Exception as exc:
                # NOT_FOUND here: a remote range outside the producer's registered arena, or an unknown agent
                raise TransferError(cause_of(exc),
                                    f"{what}: preparing descriptors failed: {describe_error(exc)}") from None
            try:
                state = agent.transfer(xfer)
                backoff = Backoff()
                while state == "PROC":
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TransferError(FailureCause.TIMEOUT, f"{what} not done before the deadline")
                    time.sleep(min(backoff.next(), left))
                    state = agent.check_xfer_state(xfer)
            except TransferError:
                self.forget(key)
                raise
            except Exception as exc:
                self.forget(key)
                raise TransferError(cause_of(exc), f"{what} failed: {describe_error(exc)}") from None
            if state != "DONE":
                self.forget(key)  # ERR: the connection is suspect; reload the agent next time
                raise TransferError(FailureCause.PEER_UNREACHABLE, f"{what} ended in state {state}")
            with self._lock:
                self.reads += 1
            return total
        finally:
            if xfer is not None and not self._release(xfer, active=state == "PROC"):
                with self._lock:  # the READ may still be running: its descriptor lists stay too
                    self._stuck.extend(reversed(handles))
            else:
                for h in reversed(handles):
                    self._release(h)

    def _track(self, handle: Any) -> Any:
        with self._lock:
            self.open_handles += 1
        return handle

    def _release(self, handle: Any, active: bool = False) -> bool:
        try:
            handle.release()  # an active transfer is cancelled first
        except Exception as exc:
            # NIXL could not cancel: the handle (and its buffers) must stay alive; retried later.
            logger.warning("NIXL: releasing %s failed (%s); retrying at the next read", handle, describe_error(exc))
            with self._lock:
                self._stuck.append(handle)
            return False
        with self._lock:
            self.open_handles -= 1
            retry = bool(self._stuck) and not active
        if retry:
            self._retry_stuck()
        return True

    def _retry_stuck(self) -> None:
        """Release handles NIXL refused earlier, in order (a transfer before its descriptor lists);
        stop at the first that is still refused."""
        with self._lock:
            stuck, self._stuck = self._stuck, []
        for i, h in enumerate(stuck):
            try:
                h.release()
            except Exception:
                with self._lock:
                    self._stuck[:0] = stuck[i:]
                return
            with self._lock:
                self.open_handles -= 1

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            for key in list(self._peers):
                self._remove_locked(key)
        self._retry_stuck()
        with self._lock:
            self._closed = True
            for reg in self._regs.values():
                try:
                    self._agent.deregister_memory(reg)
                except Exception as exc:
                    logger.warning("NIXL consumer %s: deregistration failed: %s", self.name, describe_error(exc))
            self._regs.clear()
            if self._stuck:
                logger.warning("NIXL consumer %s: %d transfer handles could not be released", self.name,
                               len(self._stuck))
            self._agent = None

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError(FailureCause.PROTOCOL, f"NIXL consumer agent {self.name!r} is closed")


def _address(view: memoryview, length: int) -> int:
    if len(view) != length:
        raise TransferError(FailureCause.LAYOUT_MISMATCH,
                            f"destination blocks differ in size ({len(view)} vs {length})")
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(view))  # ~0.3 us; np.frombuffer(...).ctypes ~2 us
    except TypeError:
        raise TransferError(FailureCause.PROTOCOL, "a destination block is not writable memory") from None
