"""Scripted fault injection for the transfer plane (tests and chaos runs only).

A `FaultPlan` is a list of rules; the store server asks it before handling each request and
acts on the first rule that fires: drop (never answer), delay, corrupt (flip bytes of the data
it sends, or on "push" of the data it received), truncate (send half, then hang up; on "push":
hang up before reading the data) or disconnect (hang up before answering).

Configured with the TieredConnector key `fault_injection`, e.g.
    [{"action": "corrupt", "on": "read", "nth": 2}, {"action": "delay", "delay_s": 3, "probability": 0.05}]
"""

from __future__ import annotations

import random
import threading
from typing import Literal

import msgspec

from kvconnectors.errors import ConfigError

Action = Literal["drop", "delay", "corrupt", "truncate", "disconnect"]
Event = Literal["read", "renew", "release", "handshake", "push", "push_end"]
DATA_ONLY = ("corrupt", "truncate")


class FaultRule(msgspec.Struct, forbid_unknown_fields=True):
    action: Action
    on: Event = "read"
    probability: float = 1.0      # chance of firing on each matching event
    nth: int | None = None        # fire only on the nth matching event (1-based)
    times: int | None = None      # stop after firing this many times
    delay_s: float = 0.5
    min_blocks: int = 0           # read / push only: fire only for at least this many blocks


class FaultPlan:
    def __init__(self, rules: list[FaultRule], seed: int = 0):
        for r in rules:
            if r.action in DATA_ONLY and r.on not in ("read", "push"):
                raise ConfigError("fault_injection", msgspec.to_builtins(r),
                                  f"{r.action} applies to data (on read or push) only")
            if not 0.0 <= r.probability <= 1.0:
                raise ConfigError("fault_injection", msgspec.to_builtins(r), "probability must be in [0, 1]")
        self.rules = rules
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._seen = [0] * len(rules)
        self.fired = [0] * len(rules)

    @classmethod
    def from_config(cls, raw: list | None, seed: int = 0) -> "FaultPlan | None":
        if not raw:
            return None
        try:
            rules = msgspec.convert(raw, list[FaultRule])
        except msgspec.ValidationError as exc:
            raise ConfigError("fault_injection", raw, str(exc)) from None
        return cls(rules, seed)

    def decide(self, event: str, num_blocks: int = 0) -> FaultRule | None:
        with self._lock:
            for i, r in enumerate(self.rules):
                if r.on != event or (r.times is not None and self.fired[i] >= r.times) or num_blocks < r.min_blocks:
                    continue
                self._seen[i] += 1
                if r.nth is not None and self._seen[i] != r.nth:
                    continue
                if self._rng.random() < r.probability:
                    self.fired[i] += 1
                    return r
        return None


def corrupted(block: memoryview) -> bytes:
    """A copy of `block` with its first eighth overwritten by other bytes (what a stale or
    misdirected buffer delivers); a contiguous run hits every byte position of the values,
    exponents included, whatever the dtype."""
    data = bytearray(block)
    run = max(1, len(data) // 8)
    data[:run] = bytes((b ^ 0x5A) for b in data[:run])
    return bytes(data)
