"""Tell the HTTP client WHY its request failed when its KV load failed.

vLLM 0.32 answers a request whose KV load failed under `kv_load_failure_policy="fail"` with a
bare "Internal server error" (HTTP 500, or an SSE error event when streaming): the connector's
cause never reaches the client (vllm/entrypoints/generate/base/serving.py `_raise_if_error`).

The cause does reach the API-server process through vLLM's own stats channel: the worker records
`errors[request id] = [cause, message]` in the interval's `TieredStats`, vLLM ships it to the
API server, and `TieredPromMetrics.observe` hands it to `remember()` here. The worker reports the
failure to the scheduler one step after recording it, so the stats always arrive before the
error output. `install()` wraps `_raise_if_error` so the error names the cause; the plugin entry
point (registry.py `setup_process`) installs it in every vLLM process, once (a second install sees
its mark on the hook and leaves it):

    {"error": {"message": "KV transfer failed [checksum_mismatch]: transfer '...': block 3 of 12 ...",
               "type": "InternalServerError", "code": 500}}

The proxy reads the `[cause]` back out of that message. With `--disable-log-stats` (no stats
channel) or if a later vLLM moves the hook, clients get vLLM's generic error as before, and the
cause is still in the decode instance's log and in `kvconnectors:transfer_failures_total`.
"""

from __future__ import annotations

import importlib
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from kvconnectors.errors import client_error_message
from kvconnectors.logs import get_logger

logger = get_logger(__name__)

MAX_REMEMBERED = 4096       # failures kept while their error output is on its way
TTL_S = 300.0

_lock = threading.Lock()
_failures: OrderedDict[str, tuple[str, str, float]] = OrderedDict()  # engine request id -> (cause, msg, t)
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


def install() -> bool:
    """Wrap vLLM's `_raise_if_error` (idempotent). False when the hook is not where this vLLM version
    was known to have it (a later vLLM moved it): a warning, and nothing changes."""
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

        def _raise_if_error(self, finish_reason, request_id):  # noqa: ANN001 - vLLM's signature
            if finish_reason == "error":
                failure = take(request_id)
                if failure is not None:
                    logger.error("Request %s failed: its KV load failed [%s]: %s", request_id, *failure)
                    raise error_cls(client_error_message(*failure))
            return original(self, finish_reason, request_id)

        _raise_if_error.__wrapped__ = original  # type: ignore[attr-defined]
        setattr(_raise_if_error, _MARK, True)
        setattr(owner, HOOK.method, _raise_if_error)
        return True
