"""shm: producer and consumer on one host; the consumer copies the blocks out of the producer's
/dev/shm arena (one copy per block, hashed while in cache; in C without the GIL when built).

Only the sink end is the medium's own (`ShmPull.read_into`); the source end answers offsets
(offsets.py). The consumer keeps read-only mappings of producers' arenas across pulls, and opens
only a live store's arena under SHM_DIR (`_shm_arena`, issue 16).
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from collections import OrderedDict
from typing import Any

from kvconnectors.errors import FailureCause, TransferError
from kvconnectors.mover import block_shares
from kvconnectors.mover.checksums import checksum_mismatch
from kvconnectors.store.arena import SHM_DIR, ArenaRefused, open_peer_arena
from kvconnectors.store.config import _NAME_RE as SHM_NAME_RE  # a store's shm_name: its arena's file name
from kvconnectors.transport.paths.offsets import ArenaPull


class ShmPull(ArenaPull):
    """One copy per block out of the producer's /dev/shm arena (same host).

    `arena`: the arena the ticket names for this producer rank (tiered.params.shm_arena). A reply
    naming any other (another live store of this host: another request's KV) is refused before
    anything is mapped; "" (the ticket names none) refuses every reply. None: unbound (the
    producer's end, which only answers, and readers of a trusted reply)."""
    name = label = "shm"

    def __init__(self, arena: str | None = None):
        self.arena = arena

    def reply_fields(self, pv) -> dict[str, Any]:
        return {"shm_path": pv.shm_path or ""}

    def read_into(self, sock, peer, read, reply, dest, *, deadline, sums, dest_addrs=None) -> int:
        """One copy per block out of the producer's arena (mapped once per arena, see _shm_arena),
        each block hashed right after its copy, while it is still in cache (the slot, or the
        destination: see mover/block_shares.copy_blocks), in parallel shares. The
        reply's shm_path is the producer's word: only a live store's arena under SHM_DIR is opened
        (see _shm_arena), and its offsets are checked before anything is copied."""
        if not reply.offsets or len(reply.offsets) != len(dest):
            raise TransferError(FailureCause.PROTOCOL, "shm reply without one offset per block")
        if self.arena is not None and reply.shm_path != self.arena:
            raise _shm_refused(str(reply.shm_path)[:200], peer, (
                "is not the arena its ticket names" + (f" ({self.arena})" if self.arena else
                                                       ": the ticket names no shm arena for this producer rank")))
        slot = dest[0].nbytes
        arena = _shm_arena(reply.shm_path, slot, len(dest), deadline, peer)
        bad = block_shares.copy_blocks(arena, reply.offsets, dest, sums, slot, dest_addrs)
        if bad is not None:
            raise checksum_mismatch(read.transfer_id, bad, len(dest), dest[bad], sums[bad])
        return slot * len(dest)


SHM_PULL = ShmPull()


# Read-only mappings of producers' shm arenas, kept across pulls: mapping (and faulting in) a
# 256 MiB arena costs tens of ms per pull. path -> ((dev, inode, size), memoryview of the mapping)
_SHM_MAX_ARENAS = 8
_shm_arenas: OrderedDict[str, tuple[tuple[int, int, int], memoryview]] = OrderedDict()
_shm_lock = threading.Lock()


def _shm_refused(path: str, peer: str, why: str) -> TransferError:
    return TransferError(FailureCause.PROTOCOL, f"producer {peer} named shm arena {path!r}, which {why}; "
                                                "refusing to read it")


def _shm_arena(path: str, slot: int, nblocks: int, deadline: float, peer: str = "?") -> memoryview:
    """The mapping of the arena at `path`, made once (MAP_POPULATE: no page fault per pull) and made
    again when the file changed (a restarted producer). Mappings of arenas that are gone are dropped
    (a mapping would keep an unlinked arena's memory alive), and the least recently used beyond
    _SHM_MAX_ARENAS. Dropped mappings are unmapped once no pull still copies from them.

    `path` comes from the producer, so it is checked before anything is mapped (issue 16, finding 8):
    it must be SHM_DIR/<name> with a store's shm_name (no other directory, no ".."); the name must
    be a regular file (lstat: a symlink, FIFO, device, socket or directory is refused unopened); it
    is opened with O_NOFOLLOW | O_NONBLOCK (a swap since the lstat neither follows a link nor
    blocks), and what was opened must again be a regular file (fstat), owned by this process's user
    (a store creates its arena 0600), whose size is whole `slot`-byte slots and at least the
    `nblocks` slots this read needs, and whose exclusive lock is held (store/arena.py: a live
    store's arena; any other file in SHM_DIR is not). All before `deadline`. Every refusal is a
    typed TransferError (protocol), and nothing of the file is read. What this cannot tell apart:
    another live store's arena of the same user on this host (see the README's shm threat model)."""
    if time.monotonic() >= deadline:
        raise TransferError(FailureCause.TIMEOUT, "the load deadline passed before the shm arena was opened")
    name = os.path.basename(path) if isinstance(path, str) else ""
    if (not isinstance(path, str) or os.path.dirname(path) != SHM_DIR or not SHM_NAME_RE.match(name)
            or name in (".", "..")):
        raise _shm_refused(str(path), peer, f"is not {SHM_DIR}/<name> with a store's shm_name "
                                            "(1-64 characters of [A-Za-z0-9_.])")
    with _shm_lock:
        for other in list(_shm_arenas):
            if other != path and _file_id(other) != _shm_arenas[other][0]:
                del _shm_arenas[other]
        ident = _file_id(path)
        cached = _shm_arenas.get(path)
        if cached is not None and cached[0] == ident:
            _shm_arenas.move_to_end(path)
            return cached[1]
        _shm_arenas.pop(path, None)
        try:  # store/arena.py checks what the name is before opening it, then what was opened
            fd, st = open_peer_arena(path, slot=slot, min_bytes=slot * max(1, nblocks))
        except ArenaRefused as exc:
            raise _shm_refused(path, peer, exc.why) from None
        except OSError as exc:
            raise TransferError(FailureCause.PEER_UNREACHABLE,
                                f"cannot open the producer's shm arena {path}: {exc.strerror}") from None
        try:
            if time.monotonic() >= deadline:
                raise TransferError(FailureCause.TIMEOUT, "the load deadline passed while opening the shm arena")
            arena = memoryview(mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                                         prot=mmap.PROT_READ))
        except (OSError, ValueError) as exc:  # ValueError: an empty file
            raise TransferError(FailureCause.PEER_UNREACHABLE,
                                f"cannot map the producer's shm arena {path}: {exc}") from None
        finally:
            os.close(fd)
        _shm_arenas[path] = ((st.st_dev, st.st_ino, st.st_size), arena)
        while len(_shm_arenas) > _SHM_MAX_ARENAS:
            _shm_arenas.popitem(last=False)
        return arena


def _file_id(path: str) -> tuple[int, int, int] | None:
    try:
        st = os.lstat(path)  # a symlink swapped in for a mapped arena is a different file
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size
