"""Issue 16, finding 6 (push half): every producer connection kept its own receive buffer, as large
as the largest push it was sent, outside any budget: connections x largest push. Now the
buffers of all connections together stay under one cap (`max_receive_bytes`; by default a quarter
of the landing store's DRAM, at least 128 MiB); a push that would need more is refused in step
with store_full instead of allocating, and the buffers are lent per push and reused.

A tcp push lands in place (issue 15, item 9): its bytes go straight into the store's slots a chunk
at a time, reserved just ahead of the bytes, so it borrows one chunk (for rows bound for NVMe), not
the whole push; a stalled push holds at most a chunk of buffer and about a chunk of the store."""

from __future__ import annotations

import time

import numpy as np

from kvconnectors.errors import FailureCause
from kvconnectors.transport import wire

from landing_kit import LAYERS, RPC_S, SLOT, LandingServer, blocks, push, push_all, push_msg, refused, still_serves

MIB = 1 << 20
STORE_SLOTS = 64 * MIB // SLOT
CAP = 16 * MIB
BIG = 1024                       # blocks per layer: a push of both layers is 8 MiB


def send_head(c, tid: str, data: np.ndarray, sent: int) -> None:
    """A streamed Push (every layer, sealing) and the first `sent` bytes of its data."""
    wire.send_msg(c.sock, push_msg(tid, list(range(LAYERS)), 0, BIG, BIG, data, seal=True))
    c.sock.sendall(memoryview(data.reshape(-1))[:sent])


def test_stalled_pushes_hold_a_chunk_each_and_all_land_when_they_go_on() -> None:
    """Three 8 MiB pushes at a 16 MiB cap stall after 1 MiB: each holds one chunk of receive buffer and
    no more of the store than the bytes it delivered plus a chunk; then all three land byte-exact (an
    8 MiB push no longer needs an 8 MiB buffer)."""
    from kvconnectors.transport.push_writes import IN_PLACE_CHUNK_BYTES

    srv = LandingServer(dram_slots=STORE_SLOTS, max_receive_bytes=CAP)
    try:
        conns = [srv.client() for _ in range(3)]
        data = [blocks(list(range(LAYERS)), BIG, seed=i) for i in range(3)]
        for i, c in enumerate(conns):  # three 8 MiB pushes stall after 1 MiB
            send_head(c, f"s{i}", data[i], MIB)
        buffers = srv.landing.receive_buffers
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline and srv.used_slots() * SLOT < 3 * MIB:
            time.sleep(0.02)  # until the landing side has read what was sent
        time.sleep(0.1)
        assert buffers.held_bytes <= 3 * IN_PLACE_CHUNK_BYTES, buffers.held_bytes
        assert srv.used_slots() * SLOT <= 3 * (MIB + IN_PLACE_CHUNK_BYTES), \
            f"stalled pushes reserved {srv.used_slots() * SLOT} B for 3 MiB delivered"
        for i, c in enumerate(conns):
            c.sock.sendall(memoryview(data[i].reshape(-1))[MIB:])
        replies = [wire.recv_msg(c.sock, time.monotonic() + RPC_S) for c in conns]
        assert all(r.ok for r in replies), replies
        for i, c in enumerate(conns):
            assert np.array_equal(srv.landed(f"s{i}", BIG).reshape(-1, SLOT), data[i])
            still_serves(c)
        assert buffers.held_bytes <= CAP
    finally:
        srv.close()


def test_a_cap_below_one_chunk_refuses_in_step_and_allocates_nothing() -> None:
    """The cap still bounds what pushes borrow: below one chunk, a tcp push is refused with
    store_full before its bytes (which are read and dropped), nothing is reserved, and the
    connection serves on; a push far larger than a normal cap lands."""
    srv = LandingServer(dram_slots=STORE_SLOTS, max_receive_bytes=MIB // 2)
    try:
        c = srv.client()
        exc = refused(push, c, "huge", list(range(LAYERS)), 0, 256, 256, seal=True)  # 2 MiB: a 1 MiB chunk
        assert exc.cause is FailureCause.STORE_FULL
        assert not srv.store.contains("huge") and srv.used_slots() == 0
        still_serves(c)
    finally:
        srv.close()
    srv = LandingServer(dram_slots=STORE_SLOTS, max_receive_bytes=CAP)
    try:
        c = srv.client()
        n = 2 * CAP // (LAYERS * SLOT)  # twice the cap, in one push
        data = push(c, "twice-the-cap", list(range(LAYERS)), 0, n, n, seal=True)
        assert np.array_equal(srv.landed("twice-the-cap", n).reshape(-1, SLOT), data)
        assert srv.landing.receive_buffers.held_bytes <= CAP
    finally:
        srv.close()


def test_many_connections_pushing_at_once_all_land_within_the_cap() -> None:
    """Concurrent producers, each with its own connection, pushing groups of 1 MiB: none is
    refused (the cap holds many), every transfer lands, and the buffers held stay under the cap."""
    import threading

    srv = LandingServer(dram_slots=STORE_SLOTS, max_receive_bytes=CAP)
    errors: list[BaseException] = []
    try:
        conns = [srv.client() for _ in range(6)]

        def producer(i: int) -> None:
            try:
                for k in range(3):
                    push_all(conns[i], f"p{i}-{k}", 128, seed=10 * i + k)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=producer, args=(i,)) for i in range(len(conns))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert not any(t.is_alive() for t in threads), "a producer hung"
        assert not errors, errors
        for i in range(len(conns)):
            for k in range(3):
                srv.landed(f"p{i}-{k}", 128)
        assert srv.landing.receive_buffers.held_bytes <= srv.landing.receive_buffers.cap
    finally:
        srv.close()


def test_the_default_cap_holds_two_of_the_largest_pushes_a_sender_sends() -> None:
    from kvconnectors.transport.protocol import MAX_PUSH_BYTES

    srv = LandingServer(dram_slots=16)  # a tiny store: the floor
    try:
        assert srv.landing.receive_buffers.cap == 2 * MAX_PUSH_BYTES
    finally:
        srv.close()
    srv = LandingServer(dram_slots=STORE_SLOTS, max_receive_bytes=CAP)
    try:
        assert srv.landing.receive_buffers.cap == CAP
    finally:
        srv.close()


def test_the_pool_reuses_buffers_and_frees_idle_ones_to_make_room() -> None:
    import pytest

    from kvconnectors.errors import TransferError
    from kvconnectors.transport.receive_buffers import ReceiveBuffers

    pool = ReceiveBuffers(MIB)
    a = pool.lend(300_000)
    assert a.size >= 300_000 and pool.held_bytes == a.size
    pool.give_back(a)
    b = pool.lend(200_000)
    assert b is a, "a free buffer large enough is reused, not allocated anew"
    c = pool.lend(MIB - a.size)  # exactly what is left
    with pytest.raises(TransferError) as exc:
        pool.lend(1)
    assert exc.value.cause is FailureCause.STORE_FULL and pool.refusals == 1
    pool.give_back(b)
    pool.give_back(c)
    d = pool.lend(MIB)  # neither free buffer is large enough: both are dropped to make room
    assert d.size == MIB and pool.held_bytes == MIB
    pool.give_back(d)
    pool.account(MIB // 2)  # a data path's own allocation: counted, the free buffer dropped for it
    assert pool.held_bytes == MIB // 2
    pool.give_back(nbytes=MIB // 2)
    pool.drop_free()
    assert pool.held_bytes == 0
