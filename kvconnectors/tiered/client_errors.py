"""Tell the HTTP client WHY its request failed when its KV load failed.

vLLM 0.32 answers a request whose KV load failed under `kv_load_failure_policy="fail"` with a
bare "Internal server error" (HTTP 500, or an SSE error event when streaming): the connector's
cause never reaches the client (vllm/entrypoints/generate/base/serving.py `_raise_if_error`).

The cause does reach the API-server process through vLLM's own stats channel: the worker records
`errors[request id] = [cause, detail]` in the interval's `TieredStats`, vLLM ships it to the
API server, and `TieredPromMetrics.observe` hands it to `remember()` here. The worker reports the
failure to the scheduler one step after recording it, so the stats always arrive before the
error output. `install()` wraps `_raise_if_error` so the error names the cause, in the message for
people and in a field of its own for code; the plugin entry point (registry.py `setup_process`)
installs it in every vLLM process, once (a second install sees its mark on the hook and leaves it):

    {"error": {"message": "KV transfer failed [checksum_mismatch]: transfer '...': block 3 of 12 ...",
               "type": "InternalServerError", "param": null, "code": 500,
               "kv_transfer_cause": "checksum_mismatch"}}

How the field gets there. vLLM turns a `GenerationError` into that body in two places, and lets the
exception set neither `type` (fixed "InternalServerError"), `param` (forced to None) nor `code`
(the HTTP status): a JSON response by the FastAPI handler `generation_error_handler`
(vllm/entrypoints/serve/exception_handling/handlers/vllm_error.py, via `create_error_response`),
and an SSE event by `GenerateBaseServing._convert_generation_error_to_streaming_response`. Reusing
`type` or `param` would change what OpenAI clients read there, so the cause gets its own key
(`CLIENT_ERROR_CAUSE_FIELD`): vLLM's `ErrorInfo` is an OpenAI model with `extra="allow"`, and
OpenAI clients ignore keys they do not know. `_raise_if_error` raises a `GenerationError`
subclass that knows its cause; both converters are wrapped to let vLLM build its body as always
and add that one key when the exception is ours, so vLLM's message, type and status are untouched.
The proxy reads the key (integration/proxy/errors.py). With `--disable-log-stats` (no stats channel) or if
a later vLLM moves a hook, clients get vLLM's generic error (or the message without the field)
and the cause is still in the decode instance's log and in `kvconnectors:transfer_failures_total`.
"""

from __future__ import annotations

import importlib
import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from kvconnectors.errors import CLIENT_ERROR_CAUSE_FIELD, client_error_message
from kvconnectors.logs import get_logger

logger = get_logger(__name__)

MAX_REMEMBERED = 4096       # failures kept while their error output is on its way
TTL_S = 300.0

_lock = threading.Lock()
_failures: OrderedDict[str, tuple[str, str, float]] = OrderedDict()  # engine request id -> (cause, detail, t)
_install_lock = threading.Lock()


@dataclass(frozen=True)
class Hook:
    """Where vLLM has the method to wrap, and the exception it raises for a failed request."""
    module: str
    owner: str
    method: str
    error_module: str
    error: str


# vLLM 0.32-0.33 (vllm/entrypoints/generate/base/serving.py)
HOOK = Hook("vllm.entrypoints.generate.base.serving", "GenerateBaseServing", "_raise_if_error",
            "vllm.exceptions", "GenerationError")
_MARK = "_kvconnectors_client_errors"  # set on the wrapper: the hook says itself whether it is patched


def remember(errors: dict[str, list[str]] | None) -> None:
    if not errors:
        return
    now = time.monotonic()
    with _lock:
        for req_id, (cause, message) in errors.items():
            _failures[req_id] = (str(cause), str(message), now)
            _failures.move_to_end(req_id)
        while _failures and (len(_failures) > MAX_REMEMBERED or now - next(iter(_failures.values()))[2] > TTL_S):
            _failures.popitem(last=False)


def take(api_request_id: str) -> tuple[str, str] | None:
    """The failure of the engine request that serves `api_request_id` (vLLM appends
    "-<index>-<random>" to the API request id), forgotten once taken."""
    with _lock:
        for req_id in list(_failures):
            if req_id == api_request_id or req_id.startswith(api_request_id + "-"):
                cause, message, _ = _failures.pop(req_id)
                return cause, message
    return None


def with_cause(body: dict[str, Any], cause: str) -> dict[str, Any]:
    """vLLM's error body {"error": {...}} with the cause in its own key (nothing else changes)."""
    return {**body, "error": {**body["error"], CLIENT_ERROR_CAUSE_FIELD: cause}}


def install() -> bool:
    """Wrap vLLM's `_raise_if_error` (idempotent), and the two places that turn its error into a
    body, to add the cause field. False when the hook is not where this vLLM version was known to
    have it (a later vLLM moved it): a warning, and nothing changes."""
    with _install_lock:
        try:
            owner = getattr(importlib.import_module(HOOK.module), HOOK.owner)
            error_cls = getattr(importlib.import_module(HOOK.error_module), HOOK.error)
        except Exception as exc:  # ImportError, AttributeError, or the module failing as it loads
            logger.warning("KV failure causes will not reach HTTP clients (vLLM hook %s.%s not found: %s)",
                           HOOK.module, HOOK.owner, exc)
            return False
        original = getattr(owner, HOOK.method, None)
        if original is None:
            logger.warning("KV failure causes will not reach HTTP clients (%s.%s.%s not found)",
                           HOOK.module, HOOK.owner, HOOK.method)
            return False
        if getattr(original, _MARK, False):
            return True  # the mark is on the hook, not here: a re-imported module does not wrap twice

        class KVLoadError(error_cls):
            """vLLM's GenerationError (same status, same handling) that knows its FailureCause
            (`kv_cause` is what the body wrappers look for, whichever install made the class)."""

            def __init__(self, cause: str, detail: str):
                super().__init__(client_error_message(cause, detail))
                self.cause, self.detail, self.kv_cause = cause, detail, cause

        def _raise_if_error(self, finish_reason, request_id):  # noqa: ANN001 - vLLM's signature
            if finish_reason == "error":
                failure = take(request_id)
                if failure is not None:
                    logger.error("Request %s failed: its KV load failed [%s]: %s", request_id, *failure)
                    raise KVLoadError(*failure)
            return original(self, finish_reason, request_id)

        _raise_if_error.__wrapped__ = original  # type: ignore[attr-defined]
        setattr(_raise_if_error, _MARK, True)
        setattr(owner, HOOK.method, _raise_if_error)
        _install_cause_field(owner, KVLoadError)
        return True


def _install_cause_field(serving: type, error_class: type) -> None:
    """Add the cause field to the JSON body and the SSE error event vLLM builds for `error_class`
    (each wrapper marked, so a second install leaves it)."""
    stream = getattr(serving, "_convert_generation_error_to_streaming_response", None)
    if stream is None:
        logger.warning("streamed KV failure errors will not carry %s (vLLM hook not found)", CLIENT_ERROR_CAUSE_FIELD)
    elif not getattr(stream, _MARK, False):
        def _convert_generation_error_to_streaming_response(self, e):  # noqa: ANN001 - vLLM's signature
            text = stream(self, e)
            cause = getattr(e, "kv_cause", None)
            return json.dumps(with_cause(json.loads(text), cause)) if cause is not None else text

        _convert_generation_error_to_streaming_response.__wrapped__ = stream  # type: ignore[attr-defined]
        setattr(_convert_generation_error_to_streaming_response, _MARK, True)
        serving._convert_generation_error_to_streaming_response = _convert_generation_error_to_streaming_response
    try:
        from starlette.responses import JSONResponse
        from vllm.entrypoints.serve.exception_handling.handlers import vllm_error
        handler = vllm_error.generation_error_handler  # looked up by vllm_error_handler at each call
    except (ImportError, AttributeError) as exc:
        logger.warning("KV failure error bodies will not carry %s (vLLM hook not found: %s)",
                       CLIENT_ERROR_CAUSE_FIELD, exc)
        return
    if getattr(handler, _MARK, False):
        return

    async def generation_error_handler(req, exc):  # noqa: ANN001 - vLLM's signature
        response = await handler(req, exc)
        cause = getattr(exc, "kv_cause", None)
        if cause is None:
            return response
        return JSONResponse(with_cause(json.loads(response.body), cause), status_code=response.status_code)

    generation_error_handler.__wrapped__ = handler  # type: ignore[attr-defined]
    setattr(generation_error_handler, _MARK, True)
    vllm_error.generation_error_handler = generation_error_handler
