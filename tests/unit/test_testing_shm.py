"""The test harness removes the shared-memory segments killed engines leave, and only those
(kvconnectors/testing/shm.py): a segment some live process maps or holds open is kept."""

from __future__ import annotations

import ctypes
import mmap
import os
import time

from kvconnectors.testing.shm import remove_orphaned_segments


def test_only_unreferenced_recent_vllm_segments_are_removed(tmp_path) -> None:
    since = time.time() - 60
    files = {k: tmp_path / n for k, n in {
        "orphan": "psm_0a1b2c3d", "tp": "vllm_dist_ab12-tp:0-[0-1]-cpushm_0", "sem": "sem.mp-xyz",
        "open": "psm_00000001", "mapped": "psm_00000002", "old": "psm_00000003", "other": "kvc_x_0_1",
        "semaphore": "sem.mp-live"}.items()}
    for path in files.values():
        path.write_bytes(b"\0" * mmap.PAGESIZE)
    os.utime(files["old"], (since - 60, since - 60))
    held = os.open(files["open"], os.O_RDONLY)
    # mapped with the fd closed (Python's mmap would keep a dup of it: libc's mmap does not), so
    # only /proc/<pid>/maps refers to it
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype, libc.mmap.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                                               ctypes.c_int, ctypes.c_int, ctypes.c_long]
    def map_closed(path) -> int:
        fd = os.open(path, os.O_RDONLY)
        addr = libc.mmap(None, mmap.PAGESIZE, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        os.close(fd)
        assert addr not in (None, ctypes.c_void_p(-1).value)
        return addr
    addrs = [map_closed(files["mapped"])]
    # as glibc's sem_open makes a live semaphore: mapped under a temporary name, then linked to its
    # real name and the temporary one unlinked (its maps line names a file that no longer exists)
    files["semaphore"].unlink()
    temp = tmp_path / "sem.tmpXYZ"
    temp.write_bytes(b"\0" * mmap.PAGESIZE)
    addrs.append(map_closed(temp))
    os.link(temp, files["semaphore"])
    temp.unlink()
    try:
        removed = remove_orphaned_segments(since, str(tmp_path))
    finally:
        os.close(held)
        for addr in addrs:
            libc.munmap(ctypes.c_void_p(addr), ctypes.c_size_t(mmap.PAGESIZE))
    assert sorted(removed) == sorted(files[k].name for k in ("orphan", "tp", "sem"))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(files[k].name for k in (
        "open", "mapped", "old", "other", "semaphore"))
