"""How the proxy fails: its exceptions, the OpenAI-style error body a client gets, and
`upstream_failure`, the one place that maps an instance's HTTP status and body to the proxy's outcome."""

from __future__ import annotations

import json
from typing import Any, Literal

import aiohttp
from aiohttp import web

# why a decode's KV load failed, as TieredConnector reports it (kvconnectors/errors.py imports no vLLM)
from kvconnectors.errors import CLIENT_ERROR_CAUSE_FIELD, FailureCause

Leg = Literal["prefill", "decode"]


class ProxyError(Exception):
    """A request failure to report to the client as OpenAI-style error JSON."""

    def __init__(self, status: int, type_: str, message: str, reason: str = "", retryable: bool = False):
        super().__init__(message)
        self.status, self.type, self.message = status, type_, message
        self.reason = reason or type_
        self.retryable = retryable


class ClientGone(Exception):
    """The client closed its connection mid-response; `response` is what was being written."""

    def __init__(self, response: web.StreamResponse):
        super().__init__("client disconnected")
        self.response = response


class PassThrough(Exception):
    """An upstream 4xx (the client's request is at fault): hand it back unchanged."""

    reason = "http_4xx"  # the failure metrics' label

    def __init__(self, status: int, body: bytes, content_type: str):
        super().__init__(status)
        self.status, self.body, self.content_type = status, body, content_type


def error_body(status: int, type_: str, message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": None, "code": status}}


def error_response(status: int, type_: str, message: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response(error_body(status, type_, message), status=status, headers=headers)


def upstream_failure(leg: Leg, url: str, status: int, body: bytes,
                     content_type: str = "") -> ProxyError | PassThrough | None:
    """What the proxy makes of a `leg` instance's answer: None for a status below 400 (not a
    failure); a 4xx passes through unchanged (the client's request is at fault); a decode 5xx whose
    body carries TieredConnector's cause field is a kv_transfer_error labelled `kv_<cause>`; any
    other 5xx is an upstream_error (http_5xx), retryable on a prefill leg only (decode is not retried).
    The prefill leg loads no KV, so its body's cause field is not read. Each outcome's `reason` is
    its failure-metric label."""
    if status < 400:
        return None
    if status < 500:
        return PassThrough(status, body, content_type)
    text = snippet(body)
    cause = kv_failure_cause(body) if leg == "decode" else None
    if cause is not None:
        return ProxyError(502, "kv_transfer_error", f"decode instance {url} could not load the prompt's KV cache: "
                          f"{text}", f"kv_{cause.value}")
    return ProxyError(502, "upstream_error", f"{leg} instance {url} returned HTTP {status}: {text}", "http_5xx",
                      retryable=leg == "prefill")


def kv_failure_cause(data: bytes) -> FailureCause | None:
    """The cause a TieredConnector decode put in its error body's own field (client_errors.py);
    None for any other body, and for a value this version does not know (metric labels stay bounded)."""
    try:
        return FailureCause(json.loads(data)["error"][CLIENT_ERROR_CAUSE_FIELD])
    except (ValueError, KeyError, TypeError):
        return None


def snippet(data: bytes | str, n: int = 300) -> str:
    """An upstream body for an error message: vLLM's own message when it is vLLM's error JSON, on one
    line, cut at `n` characters."""
    text = data.decode(errors="replace") if isinstance(data, bytes) else data
    try:  # vLLM's own error JSON: keep just its message
        text = json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        pass
    text = " ".join(str(text).split())
    return text[:n] + ("..." if len(text) > n else "")


def is_connect_error(exc: BaseException) -> bool:
    """The connection was never made (refused, unresolvable, connect timeout): the instance is down."""
    return isinstance(exc, (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError))
