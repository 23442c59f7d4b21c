"""`upstream_failure`: the one mapping of a prefill or decode instance's HTTP status and body to the
proxy's outcome (nothing, a pass-through 4xx, or a ProxyError with its type, reason and
retryability). Pure function: no servers, no event loop."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvconnectors.errors import CLIENT_ERROR_CAUSE_FIELD, FailureCause
from kvconnectors.integration.proxy import PassThrough, ProxyError
from kvconnectors.integration.proxy.errors import upstream_failure

URL = "http://127.0.0.1:8200"
VLLM_500 = b'{"error": {"message": "Internal server error", "type": "InternalServerError", "code": 500}}'
VLLM_400 = b'{"error": {"message": "max_tokens must be at least 1", "type": "BadRequestError", "code": 400}}'


def _with_cause(cause: Any, message: str = "KV transfer failed [checksum_mismatch]: block 3") -> bytes:
    return json.dumps({"error": {"message": message, "code": 500, CLIENT_ERROR_CAUSE_FIELD: cause}}).encode()


def outcome(failure: ProxyError | PassThrough | None) -> tuple[Any, ...] | None:
    """Every field a caller reads, as one comparable tuple."""
    if failure is None:
        return None
    if isinstance(failure, PassThrough):
        return ("pass", failure.status, failure.body, failure.content_type, failure.reason)
    return ("error", failure.status, failure.type, failure.reason, failure.retryable, failure.message)


CAUSED = _with_cause("checksum_mismatch")
TABLE = [
    # not failures: the caller goes on with the body (prefill: kv_transfer_params; decode: relay it)
    ("decode", 200, b'{"choices": []}', None),
    ("prefill", 200, b'{"kv_transfer_params": {}}', None),
    ("decode", 399, b"", None),
    # 4xx: the client's request is at fault, handed back byte for byte, even with a cause field
    ("decode", 400, VLLM_400, ("pass", 400, VLLM_400, "application/json", "http_4xx")),
    ("prefill", 404, b"not found", ("pass", 404, b"not found", "application/json", "http_4xx")),
    ("decode", 499, CAUSED, ("pass", 499, CAUSED, "application/json", "http_4xx")),
    # a decode 5xx with TieredConnector's cause field: a kv_transfer_error labelled by the cause
    ("decode", 500, CAUSED, ("error", 502, "kv_transfer_error", "kv_checksum_mismatch", False,
                             f"decode instance {URL} could not load the prompt's KV cache: "
                             "KV transfer failed [checksum_mismatch]: block 3")),
    ("decode", 503, _with_cause("timeout", "x"), ("error", 502, "kv_transfer_error", "kv_timeout", False,
                                                  f"decode instance {URL} could not load the prompt's KV cache: x")),
    # any other 5xx: an upstream_error; only a prefill one is retried on another instance
    ("decode", 500, VLLM_500, ("error", 502, "upstream_error", "http_5xx", False,
                               f"decode instance {URL} returned HTTP 500: Internal server error")),
    ("prefill", 502, b"<html>\n bad  gateway </html>", ("error", 502, "upstream_error", "http_5xx", True,
                                                        f"prefill instance {URL} returned HTTP 502: "
                                                        "<html> bad gateway </html>")),
    # negative controls: the cause only in the message, an unknown cause value, a cause on the
    # prefill leg (it loads no KV): all plain 5xx
    ("decode", 500, b'{"error": {"message": "KV transfer failed [timeout]: x"}}',
     ("error", 502, "upstream_error", "http_5xx", False,
      f"decode instance {URL} returned HTTP 500: KV transfer failed [timeout]: x")),
    ("decode", 500, _with_cause("not_a_cause", "m"), ("error", 502, "upstream_error", "http_5xx", False,
                                                      f"decode instance {URL} returned HTTP 500: m")),
    ("prefill", 500, _with_cause("checksum_mismatch", "m"), ("error", 502, "upstream_error", "http_5xx", True,
                                                             f"prefill instance {URL} returned HTTP 500: m")),
]


@pytest.mark.parametrize("leg, status, body, expected", TABLE)
def test_upstream_status_and_body_map_to_one_outcome(leg, status, body, expected):
    """Seen to fail once each: with the 4xx bound moved to `status <= 500` (the 500 rows become
    pass-throughs), and with the cause read on both legs (the prefill negative control becomes a
    kv_transfer_error); both reverted."""
    assert outcome(upstream_failure(leg, URL, status, body, "application/json")) == expected


@pytest.mark.parametrize("cause", list(FailureCause))
def test_every_decode_cause_is_its_own_label(cause):
    failure = upstream_failure("decode", URL, 500, _with_cause(cause.value), "application/json")
    assert isinstance(failure, ProxyError) and failure.reason == f"kv_{cause.value}"
    assert failure.type == "kv_transfer_error"


def _strings(value) -> int:
    """JSON strings in a decoded value: its keys and string values at any depth."""
    if isinstance(value, str):
        return 1
    if isinstance(value, dict):
        return sum(1 + _strings(v) for v in value.values())
    if isinstance(value, list):
        return sum(_strings(v) for v in value)
    return 0


def test_json_strings_counts_json_in_json_exactly_when_it_matters() -> None:
    """--max-body-strings counts strings before decoding. Runs of backslashes (JSON in JSON: tool
    calls, agent transcripts) must not be taken for strings: a body of 2 strings whose text holds
    thousands of escaped quotes behind escaped backslashes is under a limit of 16 (the first count
    took each run for half a string: 6,002 here). Control: a body of that many real strings is over."""
    import json

    from kvconnectors.integration.proxy.jsonbody import json_strings

    inner = json.dumps({"args": json.dumps({"q": 'say "hi"' * 1000})})  # quotes behind 3 backslashes
    body = json.dumps({"prompt": inner}).encode()
    assert _strings(json.loads(body)) == 2
    assert json_strings(body, 16) == 2
    many = json.dumps({"prompt": [f"s{i}" for i in range(40)]}).encode()
    assert json_strings(many, 16) == 41 == _strings(json.loads(many))
    for text in ('a\\\\"b', '\\"', '\\\\\\"', "plain"):  # runs of 1-4 backslashes before a quote, as text
        doc = json.dumps({"k": text, "l": [text, {"m": text}]}).encode()
        assert json_strings(doc, 0) == _strings(json.loads(doc)), text
