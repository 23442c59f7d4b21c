"""The DRAM tier: one preallocated, page-aligned arena carved into fixed-size slots.

Allocation is a free list of slot numbers, so staging never mallocs. With `shm_name` the arena is a
file in /dev/shm that another process on the host can map read-only (`map_readonly`) and read at the
byte offsets the store hands out: the zero-copy `shm` transport.

Ownership of a shm file is an exclusive flock held for the arena's life. The kernel drops it when
the process exits or crashes, so a file whose lock can be taken is stale; one whose lock is held
belongs to a live store and is refused.

A file is never adopted (issue 34, item 6): the arena is created O_CREAT | O_EXCL | O_NOFOLLOW, mode
0600, and checked after (a regular file of this user that no one else may read or write). A file
already at its path is removed and created anew only when it is a stale arena of ours (a regular
file of this user whose lock is free: a crashed run's), so neither its bytes nor its mode survive;
a symlink, anything but a regular file, another user's file or a live store's is refused with a
ConfigError naming the path. A reader of another process's arena opens it with `open_peer_arena`
(or `map_peer_arena`): no symlink, a regular file of its own user that neither group nor others
may write, whole slots, held by a live store; anything else is `ArenaRefused`.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import re
import stat

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


def arena_names(directory: str = SHM_DIR) -> list[str]:
    """The names in `directory` that are stores' arenas by their name (kvc_<instance>_<rank>_<pid>)."""
    try:
        return [n for n in os.listdir(directory) if ARENA_NAME.match(n)]
    except OSError:
        return []


def reap_stale_arenas(directory: str = SHM_DIR) -> list[str]:
    """Remove the arenas of stores that died without closing them (SIGKILL, the OOM killer): a
    /dev/shm file is RAM, held until someone unlinks it. Stale means both: the pid in its name
    is gone, and nobody holds its lock (a live store keeps an exclusive flock on its arena for
    its life, so a store in another pid namespace is never touched). Returns the names removed."""
    removed: list[str] = []
    for name in arena_names(directory):
        m = ARENA_NAME.match(name)
        assert m is not None
        path = os.path.join(directory, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            continue  # a symlink, a FIFO, another user's file: not an arena of ours
        if _pid_alive(int(m.group(1)), made_by=st.st_ctime):
            continue
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue  # gone meanwhile, or not ours to open
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.unlink(path)
            removed.append(name)
        except OSError:
            pass  # a live store holds it, another reaper was first, or it is not ours to remove
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
    """A new arena file at `path`, of `nbytes`, 0600, exclusively locked; never an existing file
    (module docstring). ConfigError naming shm_name when the path holds something we must not use."""
    fd = _create_exclusive(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:  # someone opened our brand-new file and locked it first: not ours after all
        os.close(fd)
        raise _arena_refused(path, "was locked by another process as soon as it was created") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o077:
            raise _arena_refused(path, f"was created as mode {stat.S_IMODE(st.st_mode):04o}, uid {st.st_uid}: not a "
                                       f"file only this user ({os.geteuid()}) may use")
        os.ftruncate(fd, nbytes)
        os.posix_fallocate(fd, 0, nbytes)  # fail now, not with SIGBUS when /dev/shm fills up later
    except BaseException as exc:
        os.close(fd)
        try:
            os.unlink(path)
        except OSError:
            pass
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            raise ConfigError("dram_bytes", nbytes, f"{SHM_DIR} has less than {format_size(nbytes)} free") from None
        raise
    return fd


_CREATE_FLAGS = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def _create_exclusive(path: str) -> int:
    """os.open(path, O_CREAT | O_EXCL | O_NOFOLLOW, 0600); a stale arena of ours in the way is removed
    first (`_remove_stale`), anything else refused."""
    for _ in range(3):
        try:
            fd = os.open(path, _CREATE_FLAGS, 0o600)
        except FileExistsError:
            _remove_stale(path)
            continue
        os.fchmod(fd, 0o600)  # exactly 0600, whatever the umask
        return fd
    raise _arena_refused(path, "keeps being created again by another process while this store replaces it")


def _remove_stale(path: str) -> None:
    """Remove the file at `path` if it is a stale arena of ours: a regular file of this user whose
    lock no live store holds (a crashed run's). Else ConfigError: a symlink, anything but a regular
    file, another user's file, or a live store's arena."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return  # gone meanwhile: create it
    if stat.S_ISLNK(st.st_mode):
        raise _arena_refused(path, "is a symbolic link (to a file this store would write its KV into); refusing "
                                   "to follow or remove it: remove it yourself once you know who put it there")
    if not stat.S_ISREG(st.st_mode):
        raise _arena_refused(path, "exists and is not a regular file; remove it, or choose another instance_name")
    if st.st_uid != os.geteuid():
        raise _arena_refused(path, f"exists and belongs to uid {st.st_uid}, not this process's uid {os.geteuid()}: "
                                   "adopting it would let its owner read and write this store's KV; remove it, or "
                                   "choose another instance_name")
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise _arena_refused(path, f"exists and cannot be opened to check its lock ({exc.strerror}); "
                                   "remove it") from None
    try:
        now = os.fstat(fd)
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            return  # replaced meanwhile: look again
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError("shm_name", os.path.basename(path), f"{path} is in use by a live store") from None
        os.unlink(path)  # its bytes and its mode go with it; ours is created anew
        logger.warning("removed %s (mode %04o), the arena of a store of this user that did not close it",
                       path, stat.S_IMODE(st.st_mode))
    except FileNotFoundError:
        pass
    finally:
        os.close(fd)


def _arena_refused(path: str, why: str) -> ConfigError:
    return ConfigError("shm_name", os.path.basename(path), f"{path} {why}")


# ------------------------------------------------------------------ readers of another store's arena
class ArenaRefused(ValueError):
    """A file named as another store's arena that a reader must not map: `why` says what it is."""

    def __init__(self, path: str, why: str):
        self.path, self.why = path, why
        super().__init__(f"shm arena {path!r} {why}; refusing to read it")


# Opened without following a symlink, without blocking (a FIFO's open waits for a writer) and
# without becoming a controlling terminal; the fstat of what was opened decides.
PEER_OPEN_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0)


def _kind(mode: int) -> str:
    return ("a symbolic link" if stat.S_ISLNK(mode) else "a FIFO" if stat.S_ISFIFO(mode) else
            "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else
            "a directory" if stat.S_ISDIR(mode) else "a socket" if stat.S_ISSOCK(mode) else "not a regular file")


def open_peer_arena(path: str, *, slot: int = 0, min_bytes: int = 0,
                    require_live: bool = True) -> tuple[int, os.stat_result]:
    """Open another process's arena at `path` read-only, after checking it can be one: not a
    symlink, FIFO, device, socket or directory (lstat first: such a name is never opened; then
    O_NOFOLLOW | O_NONBLOCK, and the fstat of what was opened decides); owned by this process's uid;
    writable by neither group nor others; at least `min_bytes` long and, with `slot`, whole
    `slot`-byte slots; with `require_live`, exclusively locked (a live store holds LOCK_EX on its
    arena for its life; a file whose lock is free belongs to no store). Returns (fd, its fstat); the
    caller closes fd. ArenaRefused (`.why`) for a file that fails a check, OSError when the path
    cannot be looked at or opened at all (ENOENT: no such arena). The path's directory and name are
    the caller's to check."""
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        raise ArenaRefused(path, f"is {_kind(st.st_mode)}")
    try:
        fd = os.open(path, PEER_OPEN_FLAGS)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # a symlink put in its place since the lstat
            raise ArenaRefused(path, "is a symbolic link") from None
        raise
    try:
        fst = os.fstat(fd)
        _check_peer_arena(fd, fst, path, slot, min_bytes, require_live)
    except BaseException:
        os.close(fd)
        raise
    return fd, fst


def _check_peer_arena(fd: int, st: os.stat_result, path: str, slot: int, min_bytes: int, require_live: bool) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise ArenaRefused(path, f"is {_kind(st.st_mode)}")
    me = os.geteuid()
    if st.st_uid != me:
        raise ArenaRefused(path, f"is owned by uid {st.st_uid}, not this process's uid {me} (a store creates its "
                                 "arena 0600 as the user it runs as)")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ArenaRefused(path, f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o}); a store "
                                 "creates its arena 0600")
    if st.st_size < max(min_bytes, 1) or (slot > 0 and st.st_size % slot):
        raise ArenaRefused(path, f"has {st.st_size} bytes: not whole {slot}-byte slots, or fewer than the "
                                 f"{-(-min_bytes // slot)} slots this read needs" if slot > 0 else
                           f"has {st.st_size} bytes, fewer than the {max(min_bytes, 1)} this read needs")
    if not require_live:
        return
    try:  # the store holds LOCK_EX for its arena's life: a lock we can take means no live store owns the file
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return
    except OSError as exc:
        raise ArenaRefused(path, f"cannot be checked for its store's lock ({exc.strerror})") from None
    fcntl.flock(fd, fcntl.LOCK_UN)
    raise ArenaRefused(path, "is not held by a live store (its lock is free)")


def map_peer_arena(path: str, *, slot: int = 0, min_bytes: int = 0, require_live: bool = True,
                   populate: bool = False) -> mmap.mmap:
    """`open_peer_arena`, then a read-only shared mapping of the whole file (the fd is closed; the
    mapping stays valid). `populate`: MAP_POPULATE (fault it all in now)."""
    fd, st = open_peer_arena(path, slot=slot, min_bytes=min_bytes, require_live=require_live)
    try:
        flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
        return mmap.mmap(fd, st.st_size, flags=flags, prot=mmap.PROT_READ)
    finally:
        os.close(fd)


def map_readonly(shm_name: str) -> tuple[mmap.mmap, np.ndarray]:
    """For a same-host reader: map another process's arena read-only (checked: `map_peer_arena`);
    index it with the byte offsets from `PinnedEntry.offset`. Close the mmap when done."""
    if os.path.basename(shm_name) != shm_name or shm_name in ("", ".", ".."):
        raise ArenaRefused(shm_name, f"is not a file name in {SHM_DIR}")
    mm = map_peer_arena(os.path.join(SHM_DIR, shm_name))
    return mm, np.frombuffer(mm, dtype=np.uint8)
