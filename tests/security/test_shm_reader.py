"""Issue 16, finding 8: the shm consumer trusted the producer's `shm_path`. A fake producer made it
copy an arbitrary file into KV blocks, and a FIFO path blocked a pull past its deadline.

Now (transport/paths/shm.py, `_shm_arena`) the consumer maps only SHM_DIR/<a store's shm_name>: a
symlink, FIFO, device, socket or directory is refused from its lstat, never opened; the name is
opened with O_NOFOLLOW | O_NONBLOCK, and mapped only when fstat says it is a regular file owned by
this user, whose size is whole slots and at least the slots the read needs, and whose exclusive
lock is held (a live store's arena, store/arena.py); all before the load deadline, every refusal a
typed TransferError and no byte copied.

The fake producer is a crafted ReadReply handed to ShmPull.read_into, the consumer's whole shm
step (no sockets). Every file a test makes in /dev/shm has a unique name and is removed. Seen to
fail on the code before the fix: the outside file, the `..` path, the symlinks, the lock-free file
and the short file are copied into the blocks; the FIFO blocks the pull past its deadline (the test
unblocks it by opening the FIFO's write end).
"""

from __future__ import annotations

import fcntl
import itertools
import os
import socket
import stat
import threading
import time
from collections.abc import Iterator

import msgspec
import numpy as np
import pytest

from kvconnectors.errors import FailureCause, TransferError
from kvconnectors.store import arena as arena_mod
from kvconnectors.store.arena import SHM_DIR, ArenaRefused, DramArena
from kvconnectors.transport import wire
from kvconnectors.transport.paths import shm as paths
from kvconnectors.transport.paths.shm import SHM_PULL

pytestmark = pytest.mark.timeout(60)

SLOT, SLOTS, BLOCKS = 4096, 8, 2
SECRET = b"not KV: an attacker's pick of a file\n" * 200
_names = itertools.count()


@pytest.fixture
def shm_files() -> Iterator[list[str]]:
    """Paths a test creates under SHM_DIR; removed (whatever they are) after the test."""
    made: list[str] = []
    yield made
    for p in made:
        try:
            if os.path.isdir(p) and not os.path.islink(p):
                os.rmdir(p)
            else:
                os.unlink(p)
        except FileNotFoundError:
            pass
    paths._shm_arenas.clear()  # the cached mappings of this test's arenas


def shm_name() -> str:
    return f"kvc_sectest_{os.getpid()}_{next(_names)}"


def new_path(made: list[str]) -> str:
    p = os.path.join(SHM_DIR, shm_name())
    made.append(p)
    return p


@pytest.fixture
def arena(shm_files) -> Iterator[DramArena]:
    """A live store arena (its lock held), slot i filled with byte i + 1."""
    a = DramArena(SLOT, SLOT * SLOTS, shm_name=shm_name())
    shm_files.append(a.shm_path)
    for i in range(SLOTS):
        a.slots[i] = i + 1
    yield a
    a.close()


def pull(path: str, offsets: list[int] | None = None, deadline_s: float = 2.0) -> np.ndarray:
    """What a consumer lands from a producer whose reply names `path`; raises what it raises."""
    offsets = [0, SLOT] if offsets is None else offsets
    dest = np.zeros((len(offsets), SLOT), dtype=np.uint8)
    read = wire.Read(transfer_id="t", layers=[0], first_block=0, num_blocks=len(offsets), fingerprint="fp",
                     data_path="shm")
    reply = wire.ReadReply(ok=True, shm_path=path, offsets=offsets)
    try:
        SHM_PULL.read_into(None, "fake-producer:1", read, reply, [memoryview(r) for r in dest],
                           deadline=time.monotonic() + deadline_s, sums=None)
    except TransferError:
        assert not dest.any(), "bytes were copied before the refusal"
        raise
    return dest


def refused(path: str, match: str, **kw) -> TransferError:
    with pytest.raises(TransferError, match=match) as exc:
        pull(path, **kw)
    assert exc.value.cause is FailureCause.PROTOCOL
    return exc.value


def test_a_live_store_arena_is_read(arena):
    out = pull(arena.shm_path, [3 * SLOT, 0])
    assert (out[0] == 4).all() and (out[1] == 1).all()


def test_paths_outside_the_shm_directory_are_refused(tmp_path, arena):
    outside = tmp_path / "secret"
    outside.write_bytes(SECRET.ljust(4 * SLOT, b"\0"))
    refused(str(outside), "is not /dev/shm/<name>")
    refused(f"{SHM_DIR}/../..{outside}", "is not /dev/shm/<name>")
    refused(f"{SHM_DIR}/sub/{os.path.basename(arena.shm_path)}", "is not /dev/shm/<name>")
    refused(f"{SHM_DIR}/..", "is not /dev/shm/<name>")
    refused(f"{SHM_DIR}/bad-name", "is not /dev/shm/<name>")  # "-" is never in a store's shm_name
    refused("", "is not /dev/shm/<name>")


def test_symlinks_are_refused_even_to_a_real_arena(tmp_path, arena, shm_files):
    outside = tmp_path / "secret"
    outside.write_bytes(SECRET.ljust(4 * SLOT, b"\0"))
    for target in (str(outside), arena.shm_path):
        link = new_path(shm_files)
        os.symlink(target, link)
        refused(link, "symbolic link")


def test_a_fifo_is_refused_within_the_deadline(shm_files):
    fifo = new_path(shm_files)
    os.mkfifo(fifo, 0o600)
    outcome: list[BaseException | None] = []

    def consumer() -> None:
        try:
            pull(fifo, deadline_s=1.0)
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - reported below
            outcome.append(exc)
    t0 = time.monotonic()
    th = threading.Thread(target=consumer, daemon=True)
    th.start()
    th.join(3.0)
    blocked = th.is_alive()
    if blocked:  # the code before the fix: open() waits for a writer; give it one so the thread ends
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        th.join(5.0)
    assert not blocked, "the pull blocked on the FIFO past its 1 s deadline"
    assert time.monotonic() - t0 < 1.0
    assert isinstance(outcome[0], TransferError) and "is a FIFO" in str(outcome[0]), outcome


def test_devices_directories_and_sockets_are_refused(shm_files):
    d = new_path(shm_files)
    os.mkdir(d)
    refused(d, "is a directory")
    dev = new_path(shm_files)
    try:
        os.mknod(dev, stat.S_IFCHR | 0o600, os.makedev(1, 3))  # /dev/null's numbers
    except PermissionError:  # no CAP_MKNOD here: check the same guard on /dev/null itself
        fd = os.open("/dev/null", os.O_RDONLY)
        try:
            with pytest.raises(ArenaRefused, match="is a device"):  # what the reader's open checks (store/arena.py)
                arena_mod._check_peer_arena(fd, os.fstat(fd), "/dev/null", SLOT, SLOT, True)
        finally:
            os.close(fd)
    else:
        refused(dev, "is a device")
    sock_path = new_path(shm_files)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(sock_path)
        refused(sock_path, "is a socket")


def test_a_file_no_live_store_holds_is_refused(shm_files):
    """A regular, well-sized file in SHM_DIR that no store holds: another program's, or a dead store's."""
    p = new_path(shm_files)
    with open(p, "wb") as f:
        f.write(SECRET.ljust(4 * SLOT, b"\0"))
    refused(p, "not held by a live store")


def test_size_owner_alignment_and_deadline(shm_files, arena, monkeypatch):
    p = new_path(shm_files)
    fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a live store would hold it
        os.write(fd, b"x" * (SLOT + 1))
        refused(p, "not whole 4096-byte slots")
        os.ftruncate(fd, SLOT)
        refused(p, "fewer than the 2 slots", offsets=[0, 0])
    finally:
        os.close(fd)
    refused(arena.shm_path, "not at a slot boundary", offsets=[100, 0])
    with pytest.raises(TransferError) as exc:
        pull(arena.shm_path, deadline_s=-1.0)
    assert exc.value.cause is FailureCause.TIMEOUT
    paths._shm_arenas.clear()
    real = os.geteuid()
    monkeypatch.setattr(paths.os, "geteuid", lambda: real + 1)
    refused(arena.shm_path, f"owned by uid {real}")


def test_a_mapped_arena_replaced_by_a_symlink_is_not_read_through_the_cache(tmp_path, arena):
    """The cache is keyed by (dev, inode, size) from lstat: a symlink put in place of a mapped arena's
    name is a new file, opened (and refused) afresh, never served from the old mapping."""
    assert pull(arena.shm_path)[0, 0] == 1
    outside = tmp_path / "secret"
    outside.write_bytes(SECRET.ljust(4 * SLOT, b"\0"))
    os.unlink(arena.shm_path)
    os.symlink(str(outside), arena.shm_path)
    refused(arena.shm_path, "symbolic link")


# ---------------------------------------------------------------- issue 34, row 6: the arena is the ticket's
@pytest.fixture
def two_arenas(shm_files) -> Iterator[tuple[DramArena, DramArena]]:
    """Two live store arenas of this user on this host: the ticket's producer's, and another's."""
    made = []
    for fill in (1, 0xAB):
        a = DramArena(SLOT, SLOT * SLOTS, shm_name=shm_name())
        shm_files.append(a.shm_path)
        a.slots[:] = fill
        made.append(a)
    yield made[0], made[1]
    for a in made:
        a.close()


def test_a_reply_naming_another_live_arena_than_the_tickets_is_refused(two_arenas) -> None:
    ticketed, other = two_arenas
    read = wire.Read(transfer_id="t", layers=[0], first_block=0, num_blocks=2, fingerprint="fp", data_path="shm")
    bound = paths.ShmPull(arena=ticketed.shm_path)
    dest = np.zeros((2, SLOT), dtype=np.uint8)
    with pytest.raises(TransferError, match="not the arena its ticket names") as exc:
        bound.read_into(None, "fake-producer:1", read, wire.ReadReply(ok=True, shm_path=other.shm_path,
                                                                      offsets=[0, SLOT]),
                        [memoryview(r) for r in dest], deadline=time.monotonic() + 2, sums=None)
    assert exc.value.cause is FailureCause.PROTOCOL and not dest.any(), "another request's KV was copied"
    bound.read_into(None, "producer:1", read, wire.ReadReply(ok=True, shm_path=ticketed.shm_path, offsets=[0, SLOT]),
                    [memoryview(r) for r in dest], deadline=time.monotonic() + 2, sums=None)
    assert (dest == 1).all()
    with pytest.raises(TransferError, match="names no shm arena"):
        paths.ShmPull(arena="").read_into(None, "p:1", read, wire.ReadReply(ok=True, shm_path=ticketed.shm_path,
                                                                            offsets=[0, SLOT]),
                                          [memoryview(r) for r in dest], deadline=time.monotonic() + 2, sums=None)


def test_the_ticket_names_each_producer_ranks_arena() -> None:
    from kvconnectors.tiered import params as kvparams

    ticket = kvparams.TransferParams(
        v=kvparams.PARAMS_VERSION, transfer_id="t", addrs=[kvparams.PeerAddress("127.0.0.1", 7000 + r) for r in range(2)],
        num_tokens=64, num_blocks=2, block_size=32, fingerprint="fp", prompt_hash="h", lease_ttl_s=30, issued_at=0,
        transport="shm", shm_path="/dev/shm/kvc_a_0_1", shm_paths=["/dev/shm/kvc_a_0_1", "/dev/shm/kvc_a_1_2"],
        token="t" * 32, tp_size=2, kv_heads=2)
    assert [kvparams.shm_arena(ticket, r) for r in range(2)] == ["/dev/shm/kvc_a_0_1", "/dev/shm/kvc_a_1_2"]
    older = msgspec.structs.replace(ticket, shm_paths=[])
    assert kvparams.shm_arena(older, 0) == "/dev/shm/kvc_a_0_1" and kvparams.shm_arena(older, 1) == ""
