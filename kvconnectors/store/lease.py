"""Leases: a deadline on a local monotonic clock, plus the wire form that crosses processes.

Monotonic clocks do not cross processes or hosts, so a lease travels as (remaining TTL, the
sender's clock reading when it computed that TTL). The receiver rebases it onto its own clock:
either with a clock offset it measured (handshake round trip), or conservatively as "now + remaining"
minus a safety margin.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import msgspec


@runtime_checkable
class Clock(Protocol):
    def now(self) -> float:
        """Seconds on a monotonic scale (only differences mean anything)."""
        ...


class MonotonicClock:
    def now(self) -> float:
        return time.monotonic()


class FakeClock:
    """A clock tests move by hand, so expiry is deterministic."""

    def __init__(self, start: float = 1000.0):
        self._t = float(start)
        self._lock = threading.Lock()

    def now(self) -> float:
        with self._lock:
            return self._t

    def advance(self, dt: float) -> float:
        if dt < 0:
            raise ValueError(f"a monotonic clock cannot go back ({dt})")
        with self._lock:
            self._t += dt
            return self._t


def check_ttl(ttl_s: float, key: str = "ttl_s") -> float:
    ttl = float(ttl_s)
    if not math.isfinite(ttl) or ttl <= 0:
        raise ValueError(f"{key} must be a finite number > 0, got {ttl_s!r}")
    return ttl


class LeaseWire(msgspec.Struct, frozen=True, tag="lease.v1"):
    """What a lease looks like on the wire. `sender_now` is the sender's clock when it computed
    `remaining_s`; with a known clock offset the receiver can subtract the transit time."""

    remaining_s: float
    sender_now: float


@dataclass
class Lease:
    clock: Clock
    ttl_s: float
    deadline: float
    released: bool = False

    @classmethod
    def start(cls, clock: Clock, ttl_s: float) -> "Lease":
        ttl = check_ttl(ttl_s)
        return cls(clock=clock, ttl_s=ttl, deadline=clock.now() + ttl)

    def remaining(self, now: float | None = None) -> float:
        if self.released:
            return 0.0
        return max(0.0, self.deadline - (self.clock.now() if now is None else now))

    def expired(self, now: float | None = None) -> bool:
        # A deadline that is reached counts as passed: remaining == 0 must never be readable.
        return self.released or (self.clock.now() if now is None else now) >= self.deadline

    def renew(self, ttl_s: float | None = None) -> float:
        if self.expired():
            raise ValueError("cannot renew a lease that has ended")
        ttl = self.ttl_s if ttl_s is None else check_ttl(ttl_s)
        self.deadline = self.clock.now() + ttl
        return ttl

    def release(self) -> None:
        self.released = True

    def to_wire(self) -> LeaseWire:
        now = self.clock.now()
        return LeaseWire(remaining_s=self.remaining(now), sender_now=now)


def offset_from_roundtrip(local_sent: float, sender_now: float, local_received: float) -> tuple[float, float]:
    """NTP-style estimate of (local clock - sender clock) from one request/response, and its
    uncertainty (half the round trip). Use the sample with the smallest uncertainty."""
    if local_received < local_sent:
        raise ValueError("received before sent")
    return (local_sent + local_received) / 2.0 - sender_now, (local_received - local_sent) / 2.0


def rebase(wire: LeaseWire, clock: Clock, *, clock_offset_s: float | None = None,
           offset_uncertainty_s: float = 0.0, margin_s: float = 0.0) -> float:
    """Return the lease deadline on `clock`.

    With a measured offset (local - sender), the deadline is exact up to the offset's uncertainty,
    which is subtracted so the receiver never believes in time the sender will not grant. Without
    one, "now + remaining" over-estimates by the transit time; pass `margin_s` to cover it.
    """
    if clock_offset_s is None:
        deadline = clock.now() + wire.remaining_s
    else:
        deadline = wire.sender_now + clock_offset_s + wire.remaining_s - offset_uncertainty_s
    return deadline - margin_s


def remaining_after_rebase(wire: LeaseWire, clock: Clock, **kw: float) -> float:
    return max(0.0, rebase(wire, clock, **kw) - clock.now())  # type: ignore[arg-type]
