"""Scripted fault injection for the transfer plane (tests and chaos runs only).

A `FaultPlan` is a list of rules; the store server asks it before handling each request and
acts on the rule that fires: drop (never answer), delay, corrupt (flip bytes of the data it
sends, or on "push" of the data it received), truncate (send half, then hang up; on "push":
hang up before reading the data) or disconnect (hang up before answering).

Rates are exact: each event draws ONE random number and the rules due on it own consecutive
slices of [0, 1) (in rule order, each as wide as its probability), so at most one rule fires and
each fires at exactly its stated rate. The probabilities of the rules on one event (those
without `nth`) must therefore add up to at most 1. A rule with `nth` is due on one event only
(its nth: counted over the events that reach it, i.e. that no rule before it took); there it
takes its slice after the earlier rules', and it is left out of that sum.

Configured with the TieredConnector key `fault_injection`, e.g.
    [{"action": "corrupt", "on": "read", "nth": 2}, {"action": "delay", "delay_s": 3, "probability": 0.05}]
"""

from __future__ import annotations

import random
import threading
from typing import Literal

import msgspec
import numpy as np

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
        _check_exclusive(rules)
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
        """The rule that fires on this event, or None: one draw, walked over the due rules'
        cumulative probabilities (see the module docstring)."""
        with self._lock:
            draw: float | None = None
            upto = 0.0
            for i, r in enumerate(self.rules):
                if r.on != event or (r.times is not None and self.fired[i] >= r.times) or num_blocks < r.min_blocks:
                    continue
                self._seen[i] += 1
                if r.nth is not None and self._seen[i] != r.nth:
                    continue
                if draw is None:  # drawn only when a rule is due: other events leave the sequence alone
                    draw = self._rng.random()
                upto += r.probability
                if draw < upto:
                    self.fired[i] += 1
                    return r
        return None


def _check_exclusive(rules: list[FaultRule]) -> None:
    """One draw per event picks at most one rule: the rates on an event must fit in 1."""
    totals: dict[str, float] = {}
    for r in rules:
        if r.nth is None:
            totals[r.on] = totals.get(r.on, 0.0) + r.probability
    for event, total in totals.items():
        if total > 1.0 + 1e-9:
            raise ConfigError("fault_injection", [msgspec.to_builtins(r) for r in rules if r.on == event],
                              f"the probabilities of the rules on {event!r} add up to {total:g} > 1 "
                              f"(rules on one event are exclusive: one draw per {event!r} event)")


def corrupted(block: memoryview) -> bytes:
    """A copy of `block` with every byte flipped (what a stale or misdirected buffer delivers):
    every value changes, sign and exponent included, whatever the dtype, so even a one-block
    prompt decodes differently when the corruption goes unnoticed."""
    data = np.frombuffer(block.cast("B") if block.format != "B" else block, dtype=np.uint8) ^ np.uint8(0x5A)
    return data.tobytes()
