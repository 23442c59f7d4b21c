"""The NVMe tier: one preallocated extent file per directory, slots as fixed extents inside it.

- An entry's slots are striped round-robin over the directories (one file per device = parallel
  devices), and runs of adjacent extents in one file move in one preadv/pwritev (scatter-gather over
  the DRAM slots, which need not be adjacent; adjacent ones go as one buffer, so the usual
  adjacent-to-adjacent spill is one iovec and no per-slot Python objects). Several runs are in
  flight on a thread pool; the os.preadv/os.pwritev calls release the GIL.
- O_DIRECT where the filesystem accepts it (bypasses the page cache, which would otherwise double
  the memory a spill uses), detected per directory by opening with O_DIRECT and doing one probe
  write+read from page-aligned memory; EINVAL at either step means "buffered" (or a ConfigError when
  o_direct is forced on). Caller buffers that are not page-aligned go through a per-thread
  page-aligned bounce buffer.
- Files are created as `kvc-<instance>-<pid>-<n>.kv` and their name is removed as soon as both
  descriptors are open: the preallocated space stays the store's while it runs, and the kernel
  frees it when the process ends, however it ends (vLLM SIGKILLs its workers at shutdown).
  Start-up cleanup for what a crash inside that short window (or an older version) left: a
  `kvc-*.kv` file in an NVMe directory is removed iff its flock can be taken. A store holds an
  exclusive flock on its file from creation and the kernel drops it when the process exits, so
  this removes exactly the files of dead stores -- of any instance name, and without trusting
  pids (pid reuse, pid namespaces). Files of live stores (this process or another) are left alone.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from kvconnectors.errors import ConfigError
from kvconnectors.store.buffers import PAGE, SlotRows, aligned_empty, is_aligned, row_views
from kvconnectors.store.freelist import FreeList
from kvconnectors.store.sizes import format_size

FILE_PREFIX, FILE_SUFFIX = "kvc-", ".kv"
_seq = itertools.count()
try:
    IOV_MAX = int(os.sysconf("SC_IOV_MAX"))
except (ValueError, OSError):
    IOV_MAX = 1024


def cleanup_leftovers(directory: str) -> list[str]:
    """Remove the extent files of dead stores from `directory` (see the module rule); return them."""
    removed = []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return removed
    for name in names:
        if not (name.startswith(FILE_PREFIX) and name.endswith(FILE_SUFFIX)):
            continue
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            continue  # vanished, a symlink, or not ours to open
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue  # a live store owns it
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            pass
        finally:
            os.close(fd)
    return removed


@dataclass
class ExtentFile:
    directory: str
    path: str                # the name it was created under (removed once open)
    capacity: int            # extents (slots)
    lock_fd: int             # holds the ownership flock
    io_fd: int               # O_DIRECT fd, or lock_fd when buffered
    direct: bool
    mode_reason: str
    free: FreeList = field(init=False)

    def __post_init__(self) -> None:
        self.free = FreeList(self.capacity)


class NvmeTier:
    def __init__(self, dirs: Sequence[str], nvme_bytes: int, slot_bytes: int, *, o_direct: object = "auto",
                 io_threads: int = 4, instance_name: str = "default", max_io_bytes: int = 8 << 20):
        self.slot_bytes = slot_bytes
        self.dirs = list(dirs)
        self.per_dir = (nvme_bytes // len(self.dirs)) // slot_bytes if self.dirs and nvme_bytes else 0
        self.capacity = self.per_dir * len(self.dirs)
        self.max_io_slots = max(1, min(max_io_bytes // slot_bytes, IOV_MAX))
        self.removed_leftovers: list[str] = []
        self.files: list[ExtentFile] = []
        self._local = threading.local()
        self._ios_lock = threading.Lock()
        self.read_ios = self.write_ios = 0
        self._pool: ThreadPoolExecutor | None = None
        if not self.capacity:
            return
        try:
            for d in self.dirs:
                self.removed_leftovers += cleanup_leftovers(d)
                self.files.append(self._open(d, o_direct, instance_name))
        except BaseException:
            self.close()
            raise
        self._pool = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="kvc-nvme")

    def _open(self, d: str, o_direct: object, instance: str) -> ExtentFile:
        path = os.path.join(d, f"{FILE_PREFIX}{instance}-{os.getpid()}-{next(_seq)}{FILE_SUFFIX}")
        size = self.per_dir * self.slot_bytes
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)  # before anything else: an unlocked kvc- file is fair game
        try:
            os.posix_fallocate(fd, 0, size)  # reserve the budget now: ENOSPC at start-up, not mid-spill
        except OSError as exc:
            os.close(fd)
            os.unlink(path)
            raise ConfigError("nvme_bytes", self.per_dir * self.slot_bytes * len(self.dirs),
                              f"cannot preallocate {format_size(size)} in {d}: {exc.strerror}") from None
        direct_fd, reason = self._try_direct(path, o_direct)
        os.unlink(path)  # nameless from now on: nothing to leak, even after a SIGKILL
        if direct_fd is None and o_direct is True:
            os.close(fd)
            raise ConfigError("o_direct", True, f"{d} refuses O_DIRECT: {reason}")
        return ExtentFile(d, path, self.per_dir, fd, direct_fd if direct_fd is not None else fd,
                          direct_fd is not None, reason)

    def _try_direct(self, path: str, o_direct: object) -> tuple[int | None, str]:
        if o_direct is False:
            return None, "o_direct=false"
        if not hasattr(os, "O_DIRECT"):
            return None, "O_DIRECT is not available on this platform"
        if self.slot_bytes % PAGE:
            return None, f"slot_bytes={self.slot_bytes} is not a multiple of {PAGE}"
        try:
            dfd = os.open(path, os.O_RDWR | os.O_DIRECT | os.O_CLOEXEC)
        except OSError as exc:
            return None, f"open(O_DIRECT): {exc.strerror}"
        mm, probe = aligned_empty(PAGE)
        try:
            # Some filesystems accept the flag at open and fail the first I/O instead.
            if os.pwritev(dfd, [probe], 0) != PAGE or os.preadv(dfd, [probe], 0) != PAGE:
                raise OSError(errno.EIO, "short probe I/O")
        except OSError as exc:
            os.close(dfd)
            return None, f"probe I/O with O_DIRECT: {exc.strerror}"
        finally:
            del probe
            mm.close()
        return dfd, "O_DIRECT accepted"

    # -- modes and accounting ------------------------------------------------------------------------
    @property
    def modes(self) -> dict[str, str]:
        return {f.directory: "direct" if f.direct else "buffered" for f in self.files}

    @property
    def free_slots(self) -> int:
        return sum(len(f.free) for f in self.files)

    @property
    def used_slots(self) -> int:
        return self.capacity - self.free_slots

    def dir_of(self, ids: np.ndarray) -> np.ndarray:
        return np.asarray(ids, dtype=np.int64) // self.per_dir

    def used_ids(self) -> np.ndarray:
        """Every allocated extent id (for audits)."""
        every = np.arange(self.capacity, dtype=np.int64)
        free = np.concatenate([f.free.free_indices() + i * self.per_dir for i, f in enumerate(self.files)]
                              or [np.empty(0, np.int64)])
        return np.setdiff1d(every, free, assume_unique=True)

    # -- allocation (callers hold the store lock) ----------------------------------------------------
    def alloc(self, n: int, stripe_start: int = 0) -> np.ndarray:
        """Return `n` extent ids, position j on directory (stripe_start + j) % D where room allows."""
        if n > self.free_slots:
            raise ValueError(f"cannot take {n} of {self.free_slots} free extents")
        if n == 0:
            return np.empty(0, dtype=np.int64)
        nd = len(self.files)
        if nd == 1:  # the common single-directory case: nothing to stripe
            return self.files[0].free.take(n)
        room = [len(f.free) for f in self.files]
        quota = [0] * nd
        left = n
        while left:  # water-fill: even shares, a full directory's share goes to the others
            ring = [(stripe_start + k) % nd for k in range(nd)]
            active = [d for d in ring if quota[d] < room[d]]
            share = max(1, left // len(active))
            for d in active:
                add = min(share, room[d] - quota[d], left)
                quota[d] += add
                left -= add
                if not left:
                    break
        labels = stripe_labels(quota, stripe_start)
        out = np.empty(n, dtype=np.int64)
        for d in range(nd):
            if quota[d]:
                out[labels == d] = self.files[d].free.take(quota[d]) + d * self.per_dir
        return out

    def free(self, ids: np.ndarray) -> None:
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size == 0:
            return
        dirs = ids // self.per_dir
        for d in np.unique(dirs).tolist():
            self.files[d].free.give(ids[dirs == d] - d * self.per_dir)

    # -- data (callers hold a reference on the owning entry, not the lock) --------------------------
    def write(self, ids: np.ndarray, bufs: SlotRows) -> None:
        """bufs.mem[bufs.idx[i]] (slot_bytes each) -> extent ids[i]."""
        self._run_all(ids, bufs, write=True)

    def read(self, ids: np.ndarray, bufs: SlotRows) -> None:
        """extent ids[i] -> bufs.mem[bufs.idx[i]] (writable, slot_bytes each)."""
        self._run_all(ids, bufs, write=False)

    def _run_all(self, ids: np.ndarray, bufs: SlotRows, write: bool) -> None:
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size == 0:
            return
        if self._pool is None:
            raise RuntimeError("NVMe tier is closed or disabled")
        order = np.argsort(ids, kind="stable")
        sids = ids[order]
        srows = np.asarray(bufs.idx, dtype=np.int64)[order]
        # A run ends where ids stop being consecutive, where a file ends, or at the I/O size cap.
        brk = np.flatnonzero((np.diff(sids) != 1) | (np.diff(sids // self.per_dir) != 0)) + 1
        tasks: list[tuple[ExtentFile, int, list[np.ndarray]]] = []
        for s, e in zip(np.concatenate(([0], brk)).tolist(), np.concatenate((brk, [sids.size])).tolist()):
            for c in range(s, e, self.max_io_slots):
                ce = min(e, c + self.max_io_slots)
                first = int(sids[c])
                f = self.files[first // self.per_dir]
                # One buffer per stretch of adjacent rows: <= max_io_slots <= IOV_MAX buffers per I/O.
                tasks.append((f, first % self.per_dir, row_views(bufs.mem, srows[c:ce])))
        with self._ios_lock:
            if write:
                self.write_ios += len(tasks)
            else:
                self.read_ios += len(tasks)
        if len(tasks) == 1:  # no thread hand-off for the common single-run case
            self._one_io(*tasks[0], write)
            return
        futures: list[Future] = [self._pool.submit(self._one_io, *t, write) for t in tasks]
        errors = [f.exception() for f in futures]  # wait for *all*: no I/O may outlive its buffers
        for exc in errors:
            if exc is not None:
                raise exc

    def _one_io(self, f: ExtentFile, first: int, bufs: list[np.ndarray], write: bool) -> None:
        """Move the buffers (each a whole number of slots, in order) to/from extents first, first + 1, ..."""
        offset = first * self.slot_bytes
        if f.direct and not all(is_aligned(b) for b in bufs):
            ends = np.cumsum([b.nbytes for b in bufs]).tolist()
            bounce = self._bounce()[: ends[-1]]
            if write:
                for b, end in zip(bufs, ends):
                    bounce[end - b.nbytes:end] = b.reshape(-1)
                _full_io(os.pwritev, f.io_fd, [bounce], offset)
            else:
                _full_io(os.preadv, f.io_fd, [bounce], offset)
                for b, end in zip(bufs, ends):
                    b.reshape(-1)[:] = bounce[end - b.nbytes:end]
            return
        _full_io(os.pwritev if write else os.preadv, f.io_fd, bufs, offset)

    def _bounce(self) -> np.ndarray:
        arr = getattr(self._local, "bounce", None)
        if arr is None:  # one per I/O thread, sized for the largest coalesced I/O
            self._local.mm, arr = aligned_empty(self.max_io_slots * self.slot_bytes)
            self._local.bounce = arr
        return arr

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        for f in self.files:
            if f.io_fd != f.lock_fd:
                os.close(f.io_fd)
            try:
                os.unlink(f.path)
            except FileNotFoundError:
                pass
            os.close(f.lock_fd)
        self.files = []


def stripe_labels(quota: Sequence[int], start: int) -> np.ndarray:
    """The directory of each position of an allocation: round-robin from directory `start`, a directory
    dropping out once its quota[d] positions are handed out. Directory d's k-th position comes in
    round k at ring place (d - start) % D, so sorting by k * D + ring place gives the order."""
    nd = len(quota)
    q = np.asarray(quota, dtype=np.int64)
    dirs = np.repeat(np.arange(nd, dtype=np.int64), q)
    k = np.arange(dirs.size, dtype=np.int64) - np.repeat(np.cumsum(q) - q, q)  # rank within its directory
    keys = k * nd + (dirs - start) % nd
    return dirs[np.argsort(keys, kind="stable")]


def _full_io(fn: Callable[[int, list, int], int], fd: int, bufs: list, offset: int) -> None:
    """preadv/pwritev until every byte moved (both may legally return short counts)."""
    views = [memoryview(b).cast("B") for b in bufs]
    total = sum(v.nbytes for v in views)
    done = 0
    while done < total:
        n = fn(fd, views, offset + done)
        if n <= 0:
            raise OSError(errno.EIO, f"{fn.__name__} moved {n} bytes at offset {offset + done} (fd {fd})")
        done += n
        while views and n >= views[0].nbytes:
            n -= views[0].nbytes
            views.pop(0)
        if n:
            views[0] = views[0][n:]
