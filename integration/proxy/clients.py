"""Per-client defences of the proxy's listeners, around aiohttp's own HTTP server (which bounds
request lines and headers, 8190 bytes and 128 fields, and closes idle keep-alive connections after
--keepalive-timeout, but has no timer on an unfinished request head):

- a connection must deliver a whole request head within --header-timeout of its opening, and of the
  first byte of each later request on it, else it is closed (300 half-sent heads were held forever);
- one source address holds at most --max-client-connections connections (one more is closed at once,
  before aiohttp sees it) and --max-client-requests requests in flight (one more is answered 429).

`ClientGuard.factory(server)` wraps aiohttp's protocol factory (`web.Server`, which aiohttp documents
as a `loop.create_server` factory); `ClientGuard.middleware` goes on every app served through it.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Awaitable, Callable

from aiohttp import web

from kvconnectors.transport.admission import peer_key

from .errors import error_response
from .limits import RETRY_AFTER_S
from .metrics import ProxyMetrics



def client_address(peer: object) -> str:
    """What the per-client caps count by: the IPv4 address, or an IPv6 client's /64 (a host holds a
    whole /64: counted by address, it would have endless fresh ones), as the store server counts."""
    return peer_key(peer) if isinstance(peer, (tuple, list)) else str(peer or "")


class ClientGuard:
    """Counts of open connections and requests in flight per client address (one event loop: no
    lock), and the caps and header timeout over them. A cap of 0 is no cap."""

    def __init__(self, *, max_connections: int, max_requests: int, header_timeout: float, metrics: ProxyMetrics):
        self.max_connections, self.max_requests = max_connections, max_requests
        self.header_timeout = header_timeout
        self.connections: collections.Counter[str] = collections.Counter()
        self.requests: collections.Counter[str] = collections.Counter()
        self._by_handler: dict[asyncio.Protocol, _Connection] = {}  # aiohttp's handler -> its connection
        self._metrics = metrics

    def factory(self, server: web.Server) -> Callable[[], asyncio.Protocol]:
        """A protocol factory for `loop.create_server`: aiohttp's, behind the connection cap and the header timer."""
        return lambda: _Connection(self, server)

    def refused(self, reason: str) -> None:
        m = self._metrics
        m.child(m.client_refusals, reason).inc()

    @web.middleware
    async def middleware(self, request: web.Request,
                         handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        conn = self._by_handler.get(request.protocol)
        if conn is not None:
            conn.busy = True  # a whole head arrived: its timer stops until the next request's first byte
            conn.disarm()
        client = client_address(request.transport.get_extra_info("peername") if request.transport else None)
        try:
            if self.max_requests and self.requests[client] >= self.max_requests:
                self.refused("client_requests")
                return error_response(429, "rate_limit_exceeded", (
                    f"{client} has {self.requests[client]} requests in flight, the most the proxy takes from one "
                    f"client address (--max-client-requests); retry in {RETRY_AFTER_S} s"),
                    {"Retry-After": str(RETRY_AFTER_S)})
            self.requests[client] += 1
            try:
                return await handler(request)
            finally:
                _decrement(self.requests, client)
        finally:
            if conn is not None:
                conn.busy = False


def _decrement(counts: collections.Counter[str], key: str) -> None:
    counts[key] -= 1
    if counts[key] <= 0:
        del counts[key]  # the counters hold live clients only


class _Connection(asyncio.Protocol):
    """One client connection: counted against its address and closed when a request head is not
    whole in time; everything else is aiohttp's RequestHandler (`handler`), which sees the same transport."""

    def __init__(self, guard: ClientGuard, server: web.Server):
        self.guard, self.server = guard, server
        self.handler: asyncio.Protocol | None = None
        self.transport: asyncio.BaseTransport | None = None
        self.client: str | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.busy = False  # a request is being handled (the middleware sets this)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        g = self.guard
        client = client_address(transport.get_extra_info("peername"))
        if g.max_connections and g.connections[client] >= g.max_connections:
            g.refused("client_connections")
            transport.abort()
            return
        handler = self.server()
        handler.connection_made(transport)
        self.transport, self.client, self.handler = transport, client, handler
        g.connections[client] += 1  # counted once the handler stands: connection_lost uncounts it
        g._by_handler[handler] = self
        self.arm()

    def data_received(self, data: bytes) -> None:
        if self.handler is None:
            return
        if not self.busy and self.timer is None:  # the first byte of the next request
            self.arm()
        self.handler.data_received(data)

    def eof_received(self) -> bool | None:
        return self.handler.eof_received() if self.handler is not None else None

    def pause_writing(self) -> None:
        if self.handler is not None:
            self.handler.pause_writing()

    def resume_writing(self) -> None:
        if self.handler is not None:
            self.handler.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self.disarm()
        if self.handler is None:
            return
        g = self.guard
        g._by_handler.pop(self.handler, None)
        assert self.client is not None
        _decrement(g.connections, self.client)
        self.handler.connection_lost(exc)

    def arm(self) -> None:
        self.timer = asyncio.get_running_loop().call_later(self.guard.header_timeout, self._head_timed_out)

    def disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _head_timed_out(self) -> None:
        self.timer = None
        if self.busy or self.transport is None or self.transport.is_closing():
            return
        self.guard.refused("header_timeout")
        self.transport.abort()  # nothing to flush: no request, no response
