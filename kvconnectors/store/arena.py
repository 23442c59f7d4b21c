"""The DRAM tier: one preallocated, page-aligned arena carved into fixed-size slots.

Allocation is a free list of slot numbers, so staging never mallocs. With `shm_name` the arena is a
file in /dev/shm that another process on the host can map read-only (`map_readonly`) and read at the
byte offsets the store hands out: the zero-copy `shm` transport.

Ownership of a shm file is an exclusive flock held for the arena's life. The kernel drops it when
the process exits or crashes, so a file whose lock can be taken is stale and is reused; one whose
lock is held belongs to a live store and is refused.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import re

import numpy as np
import psutil

from kvconnectors.errors import ConfigError
from kvconnectors.logs import get_logger
from kvconnectors.store.buffers import address, paired_runs, private_mapping
from kvconnectors.store.freelist import FreeList
from kvconnectors.store.sizes import format_size

SHM_DIR = "/dev/shm"
ARENA_NAME = re.compile(r"^kvc_[A-Za-z0-9_.-]*_(\d+)$")  # the worker's shm_name: kvc_<instance>_<rank>_<pid>
logger = get_logger(__name__)


class DramArena:
    def __init__(self, slot_bytes: int, dram_bytes: int, shm_name: str | None = None, prefault: bool = True):
        self.slot_bytes = slot_bytes
        self.num_slots = dram_bytes // slot_bytes
        self.nbytes = self.num_slots * slot_bytes
        self.shm_path: str | None = None
        self._fd: int | None = None
        if shm_name is None:
            # No MAP_POPULATE here: huge pages must be asked for before the memory is faulted in.
            self._mm = private_mapping(self.nbytes)
        else:
            reap_stale_arenas()  # a killed store's arena would hold its DRAM until reboot
            self.shm_path = os.path.join(SHM_DIR, shm_name)
            self._fd = _open_owned_shm(self.shm_path, self.nbytes)
            flags = getattr(mmap, "MAP_POPULATE", 0) if prefault else 0
            self._mm = mmap.mmap(self._fd, self.nbytes, flags=mmap.MAP_SHARED | flags)
        # (num_slots, slot_bytes) view: slot i starts at byte i * slot_bytes of a page-aligned base.
        self.slots = np.frombuffer(self._mm, dtype=np.uint8).reshape(self.num_slots, slot_bytes)
        if shm_name is None and prefault:  # fault it in now (one write per page), not on first staging
            self.slots.reshape(-1)[::mmap.PAGESIZE] = 0
        self.base_address = address(self.slots)
        self._free = FreeList(self.num_slots)

    # -- allocation (callers hold the store lock) --------------------------------------------------
    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def used_slots(self) -> int:
        return self._free.used

    def alloc(self, n: int) -> np.ndarray:
        return self._free.take(n)

    def free(self, idx: np.ndarray) -> None:
        self._free.give(idx)

    def free_indices(self) -> np.ndarray:
        return self._free.free_indices()

    # -- data (callers hold a reference on the owning entry, not the lock) ------------------------
    def offset(self, slot: int) -> int:
        return slot * self.slot_bytes

    def copy_in(self, idx: np.ndarray, src: np.ndarray, src_pos: np.ndarray | None = None) -> None:
        """src[src_pos[i]] -> slot idx[i] (src_pos defaults to 0..n-1); one memcpy per run."""
        pos = np.arange(idx.size) if src_pos is None else src_pos
        for first, p, n in paired_runs(idx, pos):
            np.copyto(self.slots[first:first + n], src[p:p + n])

    def copy_out(self, idx: np.ndarray, dst: np.ndarray, dst_pos: np.ndarray | None = None) -> None:
        """slot idx[i] -> dst[dst_pos[i]]; one memcpy per run."""
        pos = np.arange(idx.size) if dst_pos is None else dst_pos
        for first, p, n in paired_runs(idx, pos):
            np.copyto(dst[p:p + n], self.slots[first:first + n])

    def close(self) -> None:
        self.slots = None  # type: ignore[assignment]
        try:
            self._mm.close()
        except BufferError:
            pass  # a caller still holds a view; the mapping goes when it does
        if self._fd is not None:
            try:
                if self.shm_path:
                    os.unlink(self.shm_path)
            except FileNotFoundError:
                pass
            os.close(self._fd)  # drops the flock
            self._fd = None


def reap_stale_arenas(directory: str = SHM_DIR) -> list[str]:
    """Remove the arenas of stores that died without closing them (SIGKILL, the OOM killer): a
    /dev/shm file is RAM, held until someone unlinks it. Stale means both: the pid in its name
    is gone, and nobody holds its lock (a live store keeps an exclusive flock on its arena for
    its life, so a store in another pid namespace is never touched). Returns the names removed."""
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        m = ARENA_NAME.match(name)
        if m is None:
            continue
        path = os.path.join(directory, name)
        try:
            changed = os.stat(path).st_ctime
        except OSError:
            continue
        if _pid_alive(int(m.group(1)), made_by=changed):
            continue
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            continue  # gone meanwhile, or not ours to open
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.unlink(path)
            removed.append(name)
        except (BlockingIOError, FileNotFoundError):
            pass  # a live store holds it, or another reaper was first
        finally:
            os.close(fd)
    if removed:
        logger.warning("removed %d arena(s) of stores that died without closing them: %s", len(removed),
                       ", ".join(removed[:4]) + (" ..." if len(removed) > 4 else ""))
    return removed


def _pid_alive(pid: int, made_by: float | None = None) -> bool:
    """Whether `pid` may still be the store that made its arena. A zombie is dead (a SIGKILLed
    worker stays one until its parent, or init, reaps it). `made_by`: the arena's ctime; a process
    started after it is another one that reuses the pid (pid_max is often 32768)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's, alive
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        return made_by is None or proc.create_time() <= made_by + 1.0
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:
        return True


def _open_owned_shm(path: str, nbytes: int) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ConfigError("shm_name", os.path.basename(path), f"{path} is in use by a live store") from None
    try:
        os.ftruncate(fd, 0)  # a stale file's old bytes must never be readable as ours
        os.ftruncate(fd, nbytes)
        os.posix_fallocate(fd, 0, nbytes)  # fail now, not with SIGBUS when /dev/shm fills up later
    except OSError as exc:
        os.close(fd)
        os.unlink(path)
        if exc.errno == errno.ENOSPC:
            raise ConfigError("dram_bytes", nbytes, f"{SHM_DIR} has less than {format_size(nbytes)} free") from None
        raise
    return fd


def map_readonly(shm_name: str) -> tuple[mmap.mmap, np.ndarray]:
    """For a same-host reader: map another process's arena read-only; index it with the byte
    offsets from `PinnedEntry.offset`. Close the mmap when done."""
    path = os.path.join(SHM_DIR, shm_name)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    return mm, np.frombuffer(mm, dtype=np.uint8)
