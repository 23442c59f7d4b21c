"""Issue 16, finding 4: one small push reserved the whole landing store. A 4 KiB push claiming
total_blocks=128 took all 256 slots (others got store_full), and a third party's Renew kept that
reservation alive. Now a landing entry holds only the slots of the groups that arrived (the first
Push checks that the whole transfer would fit, but reserves only its own group), and only its
owner's pushes renew it until it is sealed."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvconnectors.errors import FailureCause

from landing_kit import LAYERS, RPC_S, LandingServer, push, push_all, refused, still_serves


def test_a_small_push_claiming_a_large_transfer_reserves_only_what_it_carries() -> None:
    srv = LandingServer(dram_slots=256)
    try:
        attackers = [srv.client() for _ in range(3)]
        for i, c in enumerate(attackers):  # 4 KiB each, "of" 2 layers x 100 blocks: 200 of 256 slots
            push(c, f"claim{i}", [0], 0, 1, 100)
        assert srv.used_slots() == 3, "each claim holds the one slot it delivered"
        producer = srv.client()
        data = push_all(producer, "real", 100)  # 200 slots: fits beside the claims
        assert np.array_equal(srv.landed("real", 100), data)
        for c in attackers:
            still_serves(c)
    finally:
        srv.close()


def test_a_transfer_that_cannot_grow_fails_typed_in_step_and_frees_what_it_held() -> None:
    """The price of reserving as groups arrive: two transfers admitted side by side may not both
    find room for their last groups. The one that does not is refused in step (its producer keeps
    its copy: the consumer pulls it) and gives its slots back; the other lands."""
    srv = LandingServer(dram_slots=256)
    try:
        a, b = srv.client(), srv.client()
        push(a, "A", [0], 0, 2, 100)  # both admitted: each would fit alone
        push(b, "B", [0], 0, 2, 100)
        push(a, "A", [0], 2, 98, 100)
        push(b, "B", [0], 2, 98, 100)  # 200 of 256 slots held, 56 free
        exc = refused(push, a, "A", [1], 0, 100, 100, seal=True)
        assert exc.cause is FailureCause.STORE_FULL
        assert not srv.store.contains("A") and srv.used_slots() == 100
        push(b, "B", [1], 0, 100, 100, seal=True)
        srv.landed("B", 100)
        still_serves(a)
    finally:
        srv.close()


def test_only_the_owners_pushes_keep_an_unfinished_reservation_alive() -> None:
    ttl = 0.6
    srv = LandingServer(ttl_s=ttl)
    try:
        owner, stranger = srv.client(), srv.client()
        push(owner, "kept", [0], 0, 1, 64)
        push(owner, "left", [0], 0, 1, 64)
        t_end = time.monotonic() + 2.5 * ttl
        block = 1
        while time.monotonic() < t_end:  # the owner goes on pushing "kept"; a stranger renews "left"
            reply = stranger.renew(["left", "kept"], time.monotonic() + RPC_S)
            assert "left" not in reply.remaining and "kept" not in reply.remaining, reply
            push(owner, "kept", [0], block, 1, 64, seed=block)
            block += 1
            time.sleep(ttl / 6)
        srv.store.expire_now()
        assert srv.store.contains("kept"), "the owner's pushes renew its reservation"
        assert not srv.store.contains("left"), "a stranger's Renew must not keep a reservation alive"
        assert srv.used_slots() == block
        with pytest.raises(Exception) as exc:
            srv.landing.entries.wait("left", time.monotonic() + 1, time.monotonic() + 1)
        assert getattr(exc.value, "cause", None) is FailureCause.LEASE_EXPIRED
        # once sealed, the landed copy is the consumer's: its lease keeper renews it (any connection
        # presenting the ticket's token, issue 34)
        token = "done-token-0123456789abcdefghijk"
        for layer in range(LAYERS):
            push(owner, "done", [layer], 0, 2, 2, seed=layer, seal=layer == LAYERS - 1, token=token)
        assert "done" in stranger.renew(["done"], time.monotonic() + RPC_S, tokens=[token]).remaining
        still_serves(owner)
    finally:
        srv.close()


def test_layers_arrive_in_order_and_reserve_per_group() -> None:
    """The happy path stays one reservation per group: after each group exactly its slots are held."""
    srv = LandingServer(dram_slots=64)
    try:
        c = srv.client()
        for layer in range(LAYERS):
            push(c, "g", [layer], 0, 16, 16, seal=layer == LAYERS - 1)
            assert srv.used_slots() == 16 * (layer + 1)
        srv.landed("g", 16)
    finally:
        srv.close()
