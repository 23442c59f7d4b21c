"""Who may hold a store server's connections: caps that a handful of addresses cannot exhaust.

Every connection is counted from accept until it closes, by its peer address (IPv4, or an IPv6
peer's /64) and by that address's prefix (IPv4 /24, IPv6 /48):

    max_connections          all open connections
    max_per_peer             all connections of one address
    max_pending              connections that have not finished their handshake
    max_pending_per_peer     of those, from one address (default half of max_pending)
    max_pending_per_prefix   of those, from one prefix (default half of max_pending)

A cap that is reached does not turn the newcomer away when room can be made: the connection that
has waited longest without finishing its handshake (pending caps), or the one idle longest
(connection caps: an unauthenticated session before an authenticated one; never one serving a
request), is closed instead. A peer that authenticates finishes its handshake in milliseconds, so
floods of connections that never do (from other addresses, other prefixes, or the peer's own
address) evict each other and not it: the pending budget is one that authenticated peers pass
through. Only when nothing may be evicted (every connection busy) is the newcomer refused.

Owned by the store server's accept thread and its connection threads; one lock.
"""

from __future__ import annotations

import ipaddress
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvconnectors.transport.exposure import numeric_address


@dataclass(eq=False)
class Seat:
    """One admitted connection."""

    sock: socket.socket
    peer: str            # what the per-address caps count by
    prefix: str          # what the per-prefix cap counts by
    since: float = field(default_factory=time.monotonic)  # accepted, then: last request answered
    pending: bool = True     # its handshake is not finished
    busy: bool = False       # serving a request: never evicted
    authenticated: bool = False
    evicted: bool = False    # closed to make room: its thread stops at its next step


@dataclass(frozen=True)
class Caps:
    max_connections: int = 256
    max_per_peer: int = 64
    max_pending: int = 64
    max_pending_per_peer: int | None = None     # default: half of max_pending
    max_pending_per_prefix: int | None = None   # default: half of max_pending

    @property
    def pending_per_peer(self) -> int:
        return max(1, self.max_pending // 2) if self.max_pending_per_peer is None else self.max_pending_per_peer

    @property
    def pending_per_prefix(self) -> int:
        return max(1, self.max_pending // 2) if self.max_pending_per_prefix is None else self.max_pending_per_prefix


class Admission:
    def __init__(self, caps: Caps, on_evict: Callable[[str], None] = lambda reason: None):
        """`on_evict(reason)`: told once per connection closed to make room (the cap's name)."""
        self.caps = caps
        self._on_evict = on_evict
        self._lock = threading.Lock()
        self._seats: dict[socket.socket, Seat] = {}

    def __len__(self) -> int:
        with self._lock:
            return len(self._seats)

    def sockets(self) -> list[socket.socket]:
        with self._lock:
            return list(self._seats)

    def admit(self, sock: socket.socket, addr: tuple) -> tuple[Seat | None, str, list[socket.socket]]:
        """(seat, "", sockets to close now) when `sock` is admitted, else (None, the cap that refuses
        it, []). The caller shuts the returned sockets down (their threads then end)."""
        peer, prefix = peer_key(addr), prefix_key(addr)
        c = self.caps
        evicted: list[tuple[Seat, str]] = []
        with self._lock:
            def live(pred: Callable[[Seat], bool]) -> list[Seat]:
                return [s for s in self._seats.values() if pred(s)]

            # (who counts, the cap, may an idle session go too, the cap's name); the address's own first
            for scope, cap, idle, reason in (
                    (lambda s: s.peer == peer, c.max_per_peer, True, "too_many_per_peer"),
                    (lambda s: s.pending and s.peer == peer, c.pending_per_peer, False, "too_many_per_peer"),
                    (lambda s: s.pending and s.prefix == prefix, c.pending_per_prefix, False, "too_many_per_prefix"),
                    (lambda s: s.pending, c.max_pending, False, "too_many_pending"),
                    (lambda s: True, c.max_connections, True, "too_many_connections")):
                seats = live(scope)
                if len(seats) >= cap:
                    victim = self._victim(seats, idle)
                    if victim is None:
                        for s, _ in evicted:  # nothing was closed after all: they keep their seats
                            s.evicted = False
                            self._seats[s.sock] = s
                        return None, reason, []
                    victim.evicted = True
                    del self._seats[victim.sock]
                    evicted.append((victim, reason))
            self._seats[sock] = Seat(sock, peer, prefix)
            seat = self._seats[sock]
        for _, reason in evicted:
            self._on_evict(reason)
        return seat, "", [s.sock for s, _ in evicted]

    @staticmethod
    def _victim(scope: list[Seat], idle: bool) -> Seat | None:
        """The seat of `scope` to close: the pending one waiting longest, or with `idle`, a pending
        or idle one (unauthenticated first, then the one waiting longest). None when none may go."""
        candidates = [s for s in scope if not s.busy and (idle or s.pending)]
        return min(candidates, key=lambda s: (s.authenticated, s.since), default=None)

    def handshake_done(self, seat: Seat, authenticated: bool) -> bool:
        """The seat's handshake succeeded; False when it was evicted meanwhile (close it)."""
        with self._lock:
            seat.pending, seat.authenticated, seat.since = False, authenticated, time.monotonic()
            return not seat.evicted

    def begin(self, seat: Seat) -> bool:
        """A request arrived on the seat: it is busy until `end`; False when it was evicted."""
        with self._lock:
            seat.busy = True
            return not seat.evicted

    def end(self, seat: Seat) -> None:
        with self._lock:
            seat.busy, seat.since = False, time.monotonic()

    def leave(self, seat: Seat) -> None:
        with self._lock:
            if self._seats.get(seat.sock) is seat:
                del self._seats[seat.sock]


def _ip(addr: tuple) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """A peer's address as accept() gave it (an IPv4-mapped IPv6 address: its IPv4 address)."""
    return numeric_address(str(addr[0])) if addr else None


def peer_key(addr: tuple) -> str:
    """What the per-address caps count by: the IPv4 address, or an IPv6 peer's /64."""
    ip = _ip(addr)
    if ip is None:
        return str(addr)
    if isinstance(ip, ipaddress.IPv6Address):
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


def prefix_key(addr: tuple) -> str:
    """What the per-prefix cap counts by: an IPv4 /24, an IPv6 /48 (what one site or tenant holds)."""
    ip = _ip(addr)
    if ip is None:
        return str(addr)
    return str(ipaddress.ip_network(f"{ip}/{24 if ip.version == 4 else 48}", strict=False))
