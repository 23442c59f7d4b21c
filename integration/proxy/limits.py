"""Bounded request bodies: the bytes of client bodies the proxy holds at once (`BodyBudget`) and
`read_body`, which reads one body against that budget and the per-body limit.

Nothing is buffered beyond the limits: a body whose Content-Length is over `--max-body-bytes` is
answered 413 before any of it is read, and one that does not fit in what is left of
`--max-inflight-body-bytes` 503 (with Retry-After), also unread. A body without a Content-Length
(chunked) is counted chunk by chunk as it arrives and refused the same way at the chunk that
crosses a limit. Until the handler reads, aiohttp's stream reader pauses the socket after a small
high-water mark (tens of KiB), so an unread body costs no more than that.

The budget counts raw body bytes, held from the first byte read until the request's response has
been sent (its decoded form and the bodies of both legs live as long). The proxy's memory per
request is a small multiple of its body (see the README's proxy limits).
"""

from __future__ import annotations

from aiohttp import web

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


class BodyLease:
    """One request's share of the budget; `release` gives it back (idempotent)."""

    def __init__(self, budget: BodyBudget):
        self.budget, self.nbytes = budget, 0

    def grow_to(self, nbytes: int) -> None:
        """Hold `nbytes` in all for this request, or raise the 503 ProxyError (holding what it had)."""
        extra = nbytes - self.nbytes
        if extra <= 0:
            return
        b = self.budget
        if b.held + extra > b.limit:
            b.refused += 1
            raise ProxyError(503, "service_unavailable", (
                f"the proxy holds {b.held} bytes of request bodies in flight and cannot take "
                f"{nbytes} more within its budget of {b.limit} (--max-inflight-body-bytes); "
                f"retry in {RETRY_AFTER_S} s"), "body_budget_exhausted")
        b.held += extra
        self.nbytes = nbytes

    def release(self) -> None:
        self.budget.held -= self.nbytes
        self.nbytes = 0


def too_large(nbytes: int | str, max_bytes: int) -> ProxyError:
    return ProxyError(413, "invalid_request_error", (
        f"request body of {nbytes} bytes is larger than the proxy accepts ({max_bytes} bytes, "
        "--max-body-bytes)"), "body_too_large")


async def read_body(request: web.Request, budget: BodyBudget, max_bytes: int) -> tuple[bytearray, BodyLease]:
    """The whole body of `request`, held under a lease of `budget` that the caller releases once the
    request is answered. 413 (over `max_bytes`) and 503 (budget exhausted) as ProxyError, raised
    before the body is read where its Content-Length tells, else at the chunk that crosses the limit."""
    lease = budget.lease()
    try:
        declared = request.content_length
        if declared is not None:
            if declared > max_bytes:
                raise too_large(declared, max_bytes)
            lease.grow_to(declared)
            data = bytearray(declared)  # filled in place: no second copy of a large body
            pos = 0
            async for chunk in request.content.iter_any():
                end = pos + len(chunk)
                if end > declared:  # aiohttp's parser stops at Content-Length; never trust it blindly
                    raise too_large(f"more than {declared}", max_bytes)
                data[pos:end] = chunk
                pos = end
            if pos != declared:
                raise ProxyError(400, "invalid_request_error",
                                 f"request body ended after {pos} of its {declared} bytes (Content-Length)")
            return data, lease
        data = bytearray()
        async for chunk in request.content.iter_any():
            n = len(data) + len(chunk)
            if n > max_bytes:
                raise too_large(f"more than {max_bytes}", max_bytes)
            lease.grow_to(n)
            data += chunk
        return data, lease
    except BaseException:
        lease.release()
        raise
