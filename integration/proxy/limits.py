"""Bounded request bodies: the bytes of client bodies the proxy holds at once (`BodyBudget`) and
`read_body`, which reads one body against that budget, the per-body limit and the body timeout.

The budget counts bytes that have arrived, never what a Content-Length declares: a socket that
declares 64 MiB and sends nothing holds nothing (declared lengths once let four idle sockets take
the whole budget). A body whose Content-Length is over `--max-body-bytes` is answered 413 before any
of it is read, and one whose Content-Length does not fit in what is left of
`--max-inflight-body-bytes` right now 503 (with Retry-After), also unread. Any body, declared or
chunked, is refused the same way at the chunk that crosses a limit. Until the handler reads,
aiohttp's stream reader pauses the socket after a small high-water mark (tens of KiB), so an unread
body costs no more than that. A body that goes `--body-timeout` seconds without a byte is a 408.

Bytes are held from their arrival until the request's response has been sent (the bodies of both
legs live as long). The proxy's memory per request is a small multiple of its body (see the
README's proxy limits).
"""

from __future__ import annotations

import asyncio

from aiohttp import StreamReader, web

from .errors import ProxyError

RETRY_AFTER_S = 1  # what a 503 for an exhausted budget tells the client to wait


class BodyBudget:
    """Bytes of request bodies held at once, over all requests in flight. One event loop: no lock."""

    def __init__(self, limit: int):
        self.limit = int(limit)
        self.held = 0
        self.refused = 0  # requests turned away with 503 since start

    def lease(self) -> "BodyLease":
        return BodyLease(self)

    def check_room(self, nbytes: int) -> None:
        """Raise the 503 ProxyError unless `nbytes` more fit in what is left now (nothing is taken)."""
        if self.held + nbytes > self.limit:
            self.refused += 1
            raise ProxyError(503, "service_unavailable", (
                f"the proxy holds {self.held} bytes of request bodies in flight and cannot take "
                f"{nbytes} more within its budget of {self.limit} (--max-inflight-body-bytes); "
                f"retry in {RETRY_AFTER_S} s"), "body_budget_exhausted")


class BodyLease:
    """One request's share of the budget; `release` gives it back (idempotent)."""

    def __init__(self, budget: BodyBudget):
        self.budget, self.nbytes = budget, 0

    def grow_to(self, nbytes: int) -> None:
        """Hold `nbytes` in all for this request, or raise the 503 ProxyError (holding what it had)."""
        extra = nbytes - self.nbytes
        if extra <= 0:
            return
        self.budget.check_room(extra)
        self.budget.held += extra
        self.nbytes = nbytes

    def release(self) -> None:
        self.budget.held -= self.nbytes
        self.nbytes = 0


def too_large(nbytes: int | str, max_bytes: int) -> ProxyError:
    return ProxyError(413, "invalid_request_error", (
        f"request body of {nbytes} bytes is larger than the proxy accepts ({max_bytes} bytes, "
        "--max-body-bytes)"), "body_too_large")


async def next_chunk(stream: StreamReader, idle_timeout: float) -> bytes:
    """The body bytes that arrived since the last call, waiting at most `idle_timeout` s for one
    (b"" at the body's end). 408 ProxyError when none came in time."""
    chunk = stream.read_nowait()  # already here (most small bodies): no timer to set up
    if chunk or stream.at_eof():
        return chunk
    try:
        return await asyncio.wait_for(stream.readany(), idle_timeout)
    except asyncio.TimeoutError:
        raise ProxyError(408, "invalid_request_error", (
            f"no byte of the request body arrived for {idle_timeout:g} s (--body-timeout)"),
            "body_timeout") from None


async def read_body(request: web.Request, budget: BodyBudget, max_bytes: int,
                    idle_timeout: float) -> tuple[bytearray, BodyLease]:
    """The whole body of `request`, held under a lease of `budget` that the caller releases once the
    request is answered. 413 (over `max_bytes`) and 503 (budget exhausted) as ProxyError, raised
    before the body is read where its Content-Length tells, else at the chunk that crosses the
    limit; 408 when the body stalls for `idle_timeout` s."""
    lease = budget.lease()
    try:
        declared = request.content_length
        limit = max_bytes
        if declared is not None:
            if declared > max_bytes:
                raise too_large(declared, max_bytes)
            budget.check_room(declared)  # refused now if it could not fit; taken only as it arrives
            limit = declared
        data = bytearray()
        while chunk := await next_chunk(request.content, idle_timeout):
            n = len(data) + len(chunk)
            if n > limit:  # aiohttp's parser stops at Content-Length; never trust it blindly
                raise too_large(f"more than {limit}", max_bytes)
            lease.grow_to(n)
            data += chunk
        if declared is not None and len(data) != declared:
            raise ProxyError(400, "invalid_request_error",
                             f"request body ended after {len(data)} of its {declared} bytes (Content-Length)")
        return data, lease
    except BaseException:
        lease.release()
        raise
