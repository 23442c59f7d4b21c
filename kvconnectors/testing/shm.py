"""Shared-memory segments that killed vLLM engines leave in /dev/shm (tests kill engines on purpose).

vLLM's message queues (`psm_*`, Python's SharedMemory), its CPU tensor-parallel buffers
(`vllm_dist_*`) and multiprocessing semaphores (`sem.mp-*`) are RAM until someone unlinks them; a
SIGKILLed engine never does (a full test run left ~3 GiB). A segment is an orphan when no live
process maps it or holds it open (compared by inode: a semaphore is mapped under another name
than the one it ends up with): whoever still uses one maps it (SharedMemory keeps its fd open
too), so nothing in use is ever removed, not even another test session's or server's. Only
segments made since `since` are considered: what a test session made, not what other programs
on the host may own.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from kvconnectors.store.arena import SHM_DIR

VLLM_SEGMENT = re.compile(r"^(psm_[0-9a-f]+|vllm_dist_.+|sem\.mp-.+)$")


FileId = tuple[int, int]  # (st_dev, st_ino): a file whatever name it has now


def referenced_files() -> set[FileId]:
    """Every file some live process maps or holds open (what /proc shows to this user), by device
    and inode, not by name: glibc's sem_open maps a semaphore under a temporary name and then links
    it to its real one (`sem.mp-*`), so /proc/<pid>/maps names a file that is gone by then."""
    seen: set[FileId] = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as maps:
                for line in maps:
                    parts = line.split(maxsplit=5)
                    if len(parts) == 6 and parts[4] != "0":
                        major, minor = (int(x, 16) for x in parts[3].split(":"))
                        seen.add((os.makedev(major, minor), int(parts[4])))
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    st = os.stat(f"/proc/{pid}/fd/{fd}")  # follows the link to the open file itself
                    seen.add((st.st_dev, st.st_ino))
                except OSError:
                    pass
        except OSError:
            continue  # gone, or not ours to read
    return seen


def remove_orphaned_segments(since: float, directory: str = SHM_DIR) -> list[str]:
    """Unlink vLLM's segments in `directory` changed at or after `since` (a time.time()) that no
    live process references; returns their names."""
    try:
        candidates = [p for p in Path(directory).iterdir()
                      if VLLM_SEGMENT.match(p.name) and p.is_file() and p.stat().st_mtime >= since]
    except OSError:
        return []
    if not candidates:
        return []
    used = referenced_files()
    removed = []
    for path in candidates:
        try:
            st = path.stat()
        except OSError:
            continue
        if (st.st_dev, st.st_ino) not in used:
            try:
                path.unlink()
                removed.append(path.name)
            except OSError:
                pass
    return removed
