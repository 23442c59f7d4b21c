"""Leases: local deadlines, and the wire form (remaining TTL + sender clock) rebased elsewhere."""

from __future__ import annotations

import msgspec
import pytest

from kvconnectors.store.lease import (FakeClock, Lease, LeaseWire, MonotonicClock, offset_from_roundtrip, rebase,
                                      remaining_after_rebase)


def test_lease_deadline_renew_release():
    clk = FakeClock(100.0)
    lease = Lease.start(clk, 10)
    assert lease.remaining() == 10 and not lease.expired()
    clk.advance(4)
    assert lease.remaining() == 6
    assert lease.renew() == 10 and lease.deadline == 114
    assert lease.renew(2.5) == 2.5 and lease.deadline == 106.5
    clk.advance(2.5)
    assert lease.expired() and lease.remaining() == 0  # reaching the deadline ends it
    with pytest.raises(ValueError):
        lease.renew()
    other = Lease.start(clk, 5)
    other.release()
    assert other.expired() and other.remaining() == 0


@pytest.mark.parametrize("ttl", [0, -1, float("inf"), float("nan")])
def test_lease_rejects_bad_ttl(ttl):
    with pytest.raises(ValueError):
        Lease.start(FakeClock(), ttl)


def test_wire_roundtrip_is_msgspec():
    clk = FakeClock(50.0)
    wire = Lease.start(clk, 30).to_wire()
    assert wire == LeaseWire(remaining_s=30.0, sender_now=50.0)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(wire), type=LeaseWire) == wire
    assert msgspec.json.decode(msgspec.json.encode(wire), type=LeaseWire) == wire


def test_rebase_without_offset_is_now_plus_remaining_minus_margin():
    receiver = FakeClock(7.0)  # a different clock domain from the sender's 50.0
    wire = LeaseWire(remaining_s=30.0, sender_now=50.0)
    assert rebase(wire, receiver) == 37.0
    assert rebase(wire, receiver, margin_s=0.5) == 36.5
    assert remaining_after_rebase(wire, receiver, margin_s=0.5) == 29.5


def test_rebase_with_measured_offset_subtracts_transit():
    sender, receiver = FakeClock(50.0), FakeClock(1000.0)  # receiver = sender + 950
    # Handshake: ask at local 1000, sender answers at its 50.1, reply lands at local 1000.2.
    offset, unc = offset_from_roundtrip(1000.0, 50.1, 1000.2)
    assert offset == pytest.approx(950.0) and unc == pytest.approx(0.1)
    wire = Lease.start(sender, 30).to_wire()  # deadline on the sender = 80 = receiver 1030
    receiver.advance(0.3)  # the lease took 0.3 s to arrive; the naive rebase would say 1030.3
    assert rebase(wire, receiver, clock_offset_s=offset) == pytest.approx(1030.0)
    assert rebase(wire, receiver, clock_offset_s=offset, offset_uncertainty_s=unc) == pytest.approx(1029.9)


def test_clocks():
    m = MonotonicClock()
    assert m.now() <= m.now()
    f = FakeClock(1.0)
    assert f.advance(2) == 3.0
    with pytest.raises(ValueError):
        f.advance(-1)
    with pytest.raises(ValueError):
        offset_from_roundtrip(2.0, 0.0, 1.0)
