"""Issue 16, finding 6 (push half): every producer connection kept its own receive buffer, as large
as the largest push it was sent, outside any budget: connections x largest push. Now the
buffers of all connections together stay under one cap (`max_receive_bytes`; by default a quarter
of the landing store's DRAM, at least 128 MiB); a push that would need more is refused in step
with store_full instead of allocating, and the buffers are lent per push and reused."""

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


def test_receive_buffers_of_all_connections_share_one_cap() -> None:
    srv = LandingServer(dram_slots=STORE_SLOTS, max_receive_bytes=CAP)
    try:
        conns = [srv.client() for _ in range(3)]
        data = [blocks(list(range(LAYERS)), BIG, seed=i) for i in range(3)]
        for i, c in enumerate(conns):  # three 8 MiB pushes stall after 1 MiB: 24 MiB of buffers asked
            send_head(c, f"s{i}", data[i], MIB)
        buffers = getattr(srv.landing, "receive_buffers", None)
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline and (buffers is None or buffers.refusals < 1):
            time.sleep(0.02)  # until the landing side has seen all three headers
        time.sleep(0.1)
        for i, c in enumerate(conns):  # now every push sends the rest; a refused one is read and dropped
            c.sock.sendall(memoryview(data[i].reshape(-1))[MIB:])
        replies = [wire.recv_msg(c.sock, time.monotonic() + RPC_S) for c in conns]
        causes = sorted(r.cause for r in replies if not r.ok)
        assert causes == [FailureCause.STORE_FULL.value], \
            f"one of three 8 MiB pushes must be refused at a 16 MiB cap: {replies}"
        for i, (c, r) in enumerate(zip(conns, replies)):
            still_serves(c)  # the refused push's bytes were read: its connection stays in step
            if r.ok:
                assert np.array_equal(srv.landed(f"s{i}", BIG).reshape(-1, SLOT), data[i])
        # buffers went back when their pushes were done: the refused connection can push now
        (loser,) = [c for c, r in zip(conns, replies) if not r.ok]
        push(loser, "again", list(range(LAYERS)), 0, BIG, BIG, seal=True)
        srv.landed("again", BIG)
        assert srv.landing.receive_buffers.held_bytes <= CAP
    finally:
        srv.close()


def test_a_push_larger_than_the_cap_is_refused_not_allocated() -> None:
    srv = LandingServer(dram_slots=STORE_SLOTS, max_receive_bytes=CAP)
    try:
        c = srv.client()
        n = CAP // (LAYERS * SLOT) + 1  # one block more than the cap
        exc = refused(push, c, "huge", list(range(LAYERS)), 0, n, n, seal=True)
        assert exc.cause is FailureCause.STORE_FULL
        assert not srv.store.contains("huge") and srv.used_slots() == 0
        still_serves(c)
        push_all(c, "fine", 64)
        srv.landed("fine", 64)
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
    from kvconnectors.transport.push import MAX_PUSH_BYTES

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
    from kvconnectors.transport.landing import ReceiveBuffers

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
