"""ClientPool: a consumer's authenticated connections to producers, kept for the next pull.

A pull on a fresh connection pays for the TCP connect, the handshake's round trips (and its proof
with a secret), a thread started on the producer for the connection and the close: about 1.5 ms of
a 16 ms shm pull of 256 MiB on the benchmark VM, more across hosts. So a pull that went well hands
its connection back here and the next pull to the same producer takes it, as NixlConnector keeps
its handshake per remote engine.

What is kept: at most `max_idle_per_peer` idle connections per producer address. One idle for
longer than `max_idle_s` is never handed out, and is closed at the pool's next use for any producer
(so a producer not asked again does not keep sockets here). The worker sets `max_idle_s` to at
most half its `server_idle_timeout_s`, so a producer of the same configuration never times out a
connection this pool would still hand out. A connection goes back only when everything on it went
well: one that saw an error of any kind may be out of step, so it is closed. One the producer
closed meanwhile (it restarted) is readable at checkout (EOF) and is closed instead of used; a
producer restarting at the very moment a kept connection is taken fails that pull as
peer_unreachable, as a pull to a restarting producer can fail anyway (failure_policy "retry"
tries again on a new connection). Kept connections count against the producer's per-peer and
total connection caps (store server: max_per_peer, max_connections) and hold one of its threads
each while idle.
"""

from __future__ import annotations

import select
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from kvconnectors.transport.client import StoreClient

Addr = tuple[str, int]
MAX_IDLE_PER_PEER = 2  # idle connections kept per producer (testing/leaks.py allows a decode as many)


class ClientPool:
    def __init__(self, connect: Callable[[str, int], StoreClient], *, max_idle_per_peer: int = MAX_IDLE_PER_PEER,
                 max_idle_s: float = 30.0):
        self._connect = connect
        self.max_idle_per_peer, self.max_idle_s = max_idle_per_peer, max_idle_s
        self._idle: dict[Addr, list[tuple[float, StoreClient]]] = {}  # newest last
        self._lock = threading.Lock()
        self._closed = False

    @contextmanager
    def client(self, host: str, port: int) -> Iterator[StoreClient]:
        """A connection to host:port for the with-block: an idle one when there is one that is
        still good, else a new one (connect errors are the caller's, typed as StoreClient raises
        them). Kept for the next caller when the block ends without an exception."""
        addr = (host, port)
        c = self._take(addr) or self._connect(host, port)
        try:
            yield c
        except BaseException:
            c.close()
            raise
        self._give_back(addr, c)

    def idle(self) -> int:
        """Idle connections held now, over every producer."""
        with self._lock:
            return sum(len(v) for v in self._idle.values())

    def close(self) -> None:
        """Close every idle connection; connections in use are closed when their block ends."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, {}
        for entries in idle.values():
            for _, c in entries:
                c.close()

    def _take(self, addr: Addr) -> StoreClient | None:
        self._close_expired()
        while True:
            with self._lock:
                entries = self._idle.get(addr)
                if not entries:
                    self._idle.pop(addr, None)
                    return None
                _, c = entries.pop()
            if _still_open(c):
                return c
            c.close()

    def _close_expired(self) -> None:
        """Close every idle connection past max_idle_s, whichever producer it goes to."""
        cutoff = time.monotonic() - self.max_idle_s
        expired: list[StoreClient] = []
        with self._lock:
            for addr in list(self._idle):
                entries = self._idle[addr]
                expired += [c for since, c in entries if since < cutoff]
                entries[:] = [(since, c) for since, c in entries if since >= cutoff]
                if not entries:
                    del self._idle[addr]
        for c in expired:
            c.close()

    def _give_back(self, addr: Addr, c: StoreClient) -> None:
        keep = _still_open(c)  # (a caller may have closed it: an answer it gave up on could still come)
        with self._lock:
            entries = self._idle.setdefault(addr, [])
            if keep and not self._closed and len(entries) < self.max_idle_per_peer:
                entries.append((time.monotonic(), c))
                return
        c.close()


def _still_open(c: StoreClient) -> bool:
    """An idle connection has nothing to read: readable means the producer hung up (EOF) or sent
    something out of step; either way it is not used again."""
    try:
        readable, _, _ = select.select([c.sock], [], [], 0)
    except (OSError, ValueError):  # closed already
        return False
    return not readable and not getattr(c.sock, "pending", lambda: 0)()
