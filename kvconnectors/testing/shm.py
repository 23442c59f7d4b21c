"""Shared-memory segments that killed vLLM engines leave in /dev/shm (tests kill engines on purpose).

vLLM's message queues (`psm_*`, Python's SharedMemory), its CPU tensor-parallel buffers
(`vllm_dist_*`) and multiprocessing semaphores (`sem.mp-*`) are RAM until someone unlinks them; a
SIGKILLed engine never does (a full test run left ~3 GiB). A segment is an orphan when no live
process maps it or holds it open: whoever still uses one maps it (SharedMemory keeps its fd open
too), so nothing in use is ever removed. Only segments made since `since` are considered: what a
test session made, not what other programs on the host may own.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from kvconnectors.store.arena import SHM_DIR

VLLM_SEGMENT = re.compile(r"^(psm_[0-9a-f]+|vllm_dist_.+|sem\.mp-.+)$")


def referenced_paths() -> set[str]:
    """Every file some live process maps or holds open (what /proc shows to this user)."""
    seen: set[str] = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as maps:
                for line in maps:
                    parts = line.split(maxsplit=5)
                    if len(parts) == 6:
                        seen.add(parts[5].rstrip("\n").removesuffix(" (deleted)"))
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    seen.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
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
    used = referenced_paths()
    removed = []
    for path in candidates:
        if str(path) not in used:
            try:
                path.unlink()
                removed.append(path.name)
            except OSError:
                pass
    return removed
