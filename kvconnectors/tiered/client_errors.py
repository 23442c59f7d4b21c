"""Tell the HTTP client WHY its request failed when its KV load failed.

vLLM 0.32 answers a request whose KV load failed under `kv_load_failure_policy="fail"` with a
bare "Internal server error" (HTTP 500, or an SSE error event when streaming): the connector's
cause never reaches the client (vllm/entrypoints/generate/base/serving.py `_raise_if_error`).

The cause does reach the API-server process through vLLM's own stats channel: the worker records
`errors[request id] = [cause, message]` in the interval's `TieredStats`, vLLM ships it to the
API server, and `TieredPromMetrics.observe` hands it to `remember()` here. The worker reports the
failure to the scheduler one step after recording it, so the stats always arrive before the
error output. `install()` wraps `_raise_if_error` once per process so the error names the cause:

    {"error": {"message": "KV transfer failed [checksum_mismatch]: transfer '...': block 3 of 12 ...",
               "type": "InternalServerError", "code": 500}}

The proxy reads the `[cause]` back out of that message. With `--disable-log-stats` (no stats
channel) or if a later vLLM moves the hook, clients get vLLM's generic error as before, and the
cause is still in the decode instance's log and in `kvconnectors:transfer_failures_total`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict

from kvconnectors.errors import client_error_message

logger = logging.getLogger(__name__)

MAX_REMEMBERED = 4096       # failures kept while their error output is on its way
TTL_S = 300.0

_lock = threading.Lock()
_failures: OrderedDict[str, tuple[str, str, float]] = OrderedDict()  # engine request id -> (cause, msg, t)
_installed = False


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


def install() -> bool:
    """Wrap vLLM's `_raise_if_error` (once per process). False when the hook is not where this
    vLLM version was known to have it; then nothing changes."""
    global _installed
    with _lock:
        if _installed:
            return True
        try:
            from vllm.entrypoints.generate.base.serving import GenerateBaseServing
            from vllm.exceptions import GenerationError
        except ImportError as exc:
            logger.warning("KV failure causes will not reach HTTP clients (vLLM hook not found: %s)", exc)
            return False
        original = getattr(GenerateBaseServing, "_raise_if_error", None)
        if original is None:
            logger.warning("KV failure causes will not reach HTTP clients (_raise_if_error not found)")
            return False

        def _raise_if_error(self, finish_reason, request_id):  # noqa: ANN001 - vLLM's signature
            if finish_reason == "error":
                failure = take(request_id)
                if failure is not None:
                    logger.error("Request %s failed: its KV load failed [%s]: %s", request_id, *failure)
                    raise GenerationError(client_error_message(*failure))
            return original(self, finish_reason, request_id)

        _raise_if_error.__wrapped__ = original  # type: ignore[attr-defined]
        GenerateBaseServing._raise_if_error = _raise_if_error
        _installed = True
        return True

