"""Scripted fault injection for the transfer plane (tests and chaos runs only).

A `FaultPlan` is a list of rules; the store server asks it before handling each request and
acts on the rule that fires: drop (never answer), delay, corrupt (flip bytes of the data it
sends, or on "push" of the data it received), truncate (send half, then hang up; on "push":
hang up before reading the data) or disconnect (hang up before answering). The control-level
actions (drop, delay, disconnect) act in the server's dispatch; the data ones (corrupt, truncate)
wrap the request's data path (`with_fault`) and touch only bytes a path streams on the socket
(shm / nixl pulls are fetched by the consumer itself: nothing to corrupt on the way).

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
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, Literal, TypeVar

import msgspec
import numpy as np

from kvconnectors.errors import ConfigError
from kvconnectors.transport import tamper
from kvconnectors.transport.protocol import HungUp

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
    data = np.frombuffer(block.cast("B") if block.format != "B" else block, dtype=np.uint8).copy()
    tamper.corrupt(data)  # the one corruption both fault plans and the per-request test hooks apply
    return data.tobytes()


P = TypeVar("P")


def with_fault(path: P, rule: FaultRule | None) -> P:
    """`path` with a fired data fault applied to what it carries; unchanged for no rule or a
    control-level one."""
    return path if rule is None or rule.action not in DATA_ONLY else FaultyPath(path, rule)  # type: ignore[return-value]


class FaultyPath:
    """A data path (paths.PullPath or PushPath) with one fired data fault; everything else is the
    wrapped path's. Pull, producer side: corrupt flips every streamed block, truncate hangs up once
    the next layer group would pass half the bytes. Push, landing side: truncate hangs up before
    the data is read, corrupt flips the first received block of a streamed push."""

    def __init__(self, inner: Any, rule: FaultRule):
        self._inner, self.rule = inner, rule

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    # pull, producer side
    def serve(self, ctx, sock, read, nvme_slots, ttl, checksums, outgoing=None) -> None:
        self._inner.serve(ctx, sock, read, nvme_slots, ttl, checksums,
                          outgoing=self._outgoing if self._inner.streams else outgoing)

    def _outgoing(self, layers: Iterable[list[memoryview]], nbytes: int, slot: int) -> Iterator[list[memoryview]]:
        sent = 0
        for blocks in layers:
            if self.rule.action == "corrupt":  # per block, whatever runs the views span
                blocks = [memoryview(corrupted(b[i:i + slot])) for b in blocks for i in range(0, len(b), slot)]
            elif sent + sum(len(b) for b in blocks) > nbytes // 2:  # truncate
                raise HungUp()
            sent += sum(len(b) for b in blocks)
            yield blocks

    # push, landing side
    def check(self, push, rows, row_bytes) -> None:
        self._inner.check(push, rows, row_bytes)
        if self.rule.action == "truncate":
            raise HungUp()

    @contextmanager
    def receive(self, sock, push, row_bytes, bounce) -> Iterator[np.ndarray]:
        with self._inner.receive(sock, push, row_bytes, bounce) as buf:
            if self.rule.action == "corrupt" and self._inner.streams:
                buf[0] = np.frombuffer(corrupted(memoryview(buf[0])), dtype=np.uint8)
            yield buf
