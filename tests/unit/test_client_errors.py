"""A failed KV load's cause reaches the HTTP client's error (vLLM's hook wrapped once): in the
message for people, in the body's own `kv_transfer_cause` field for code.

Negative controls, run once by hand and seen failing: without the handler wrap in
`_install_cause_field` the JSON body test fails (vLLM's body has no field); without the streaming
wrap the SSE test fails; adding the field to every GenerationError fails their "vLLM's own error"
halves."""

from __future__ import annotations

import json

import pytest

from kvconnectors.errors import CLIENT_ERROR_CAUSE_FIELD
from kvconnectors.tiered import client_errors
from kvconnectors.tiered.stats import TieredStats


def test_the_cause_replaces_vllms_generic_error() -> None:
    from vllm.entrypoints.generate.base.serving import GenerateBaseServing
    from vllm.exceptions import GenerationError

    assert client_errors.install() and client_errors.install()  # idempotent
    client_errors.remember({"cmpl-abc-0-1f2e": ["checksum_mismatch", "block 3 of 12 differs"]})
    with pytest.raises(GenerationError) as exc:
        GenerateBaseServing._raise_if_error(None, "error", "cmpl-abc")
    assert str(exc.value) == "KV transfer failed [checksum_mismatch]: block 3 of 12 differs"
    assert exc.value.cause == "checksum_mismatch" and exc.value.detail == "block 3 of 12 differs"
    # taken once; an unrelated failure keeps vLLM's own error; a normal finish raises nothing
    with pytest.raises(GenerationError, match="Internal server error"):
        GenerateBaseServing._raise_if_error(None, "error", "cmpl-abc")
    GenerateBaseServing._raise_if_error(None, "stop", "cmpl-abc")


def _failed_load(cause: str, detail: str) -> Exception:
    """The exception the wrapped `_raise_if_error` raises for a request whose load failed."""
    from vllm.entrypoints.generate.base.serving import GenerateBaseServing

    assert client_errors.install()
    client_errors.remember({"cmpl-body-0-1f2e": [cause, detail]})
    try:
        GenerateBaseServing._raise_if_error(None, "error", "cmpl-body")
    except Exception as exc:  # noqa: BLE001 - returned to the caller to inspect
        return exc
    raise AssertionError("_raise_if_error raised nothing for a failed load")


def test_the_json_error_body_carries_the_cause_in_its_own_field() -> None:
    """Through vLLM's own exception handlers on a FastAPI app, as `vllm serve` registers them."""
    from fastapi import FastAPI
    from starlette.testclient import TestClient
    from vllm.entrypoints.serve.exception_handling.register import init_exception_handler
    from vllm.exceptions import GenerationError

    errors = {"kv": _failed_load("checksum_mismatch", "block 3 of 12 differs"),
              "other": GenerationError("Internal server error")}
    app = FastAPI()
    init_exception_handler(app)

    @app.get("/{which}")
    async def fail(which: str) -> None:
        raise errors[which]

    with TestClient(app) as http:
        kv, other = http.get("/kv"), http.get("/other")
    assert kv.status_code == 500 and other.status_code == 500
    assert kv.json() == {"error": {"message": "KV transfer failed [checksum_mismatch]: block 3 of 12 differs",
                                   "type": "InternalServerError", "param": None, "code": 500,
                                   CLIENT_ERROR_CAUSE_FIELD: "checksum_mismatch"}}
    # vLLM's own errors stay exactly vLLM's
    assert other.json() == {"error": {"message": "Internal server error", "type": "InternalServerError",
                                      "param": None, "code": 500}}


def test_the_streamed_error_event_carries_the_cause_too() -> None:
    from vllm.entrypoints.generate.base.serving import GenerateBaseServing
    from vllm.exceptions import GenerationError

    kv = _failed_load("timeout", "no answer in 2 s")
    serving = object.__new__(GenerateBaseServing)  # the converter uses no instance state
    event = json.loads(serving._convert_generation_error_to_streaming_response(kv))
    assert event["error"][CLIENT_ERROR_CAUSE_FIELD] == "timeout"
    assert event["error"]["message"] == "KV transfer failed [timeout]: no answer in 2 s"
    plain = json.loads(serving._convert_generation_error_to_streaming_response(GenerationError()))
    assert CLIENT_ERROR_CAUSE_FIELD not in plain["error"] and plain["error"]["message"] == "Internal server error"


def test_with_cause_adds_one_key_and_changes_nothing_else() -> None:
    body = {"error": {"message": "m", "type": "InternalServerError", "param": None, "code": 500}, "x": 1}
    assert client_errors.with_cause(body, "auth") == {"error": {**body["error"], CLIENT_ERROR_CAUSE_FIELD: "auth"},
                                                      "x": 1}
    assert CLIENT_ERROR_CAUSE_FIELD not in body["error"], "with_cause changed its input"


def test_prefix_match_does_not_confuse_request_ids() -> None:
    client_errors.remember({"cmpl-12-0-aa": ["timeout", "x"]})
    assert client_errors.take("cmpl-1") is None
    assert client_errors.take("cmpl-12") == ("timeout", "x")


def test_memory_is_bounded() -> None:
    client_errors.remember({f"r{i}-0-x": ["timeout", "m"] for i in range(client_errors.MAX_REMEMBERED + 50)})
    assert len(client_errors._failures) <= client_errors.MAX_REMEMBERED
    assert client_errors.take("r0") is None and client_errors.take(f"r{client_errors.MAX_REMEMBERED + 49}")


def test_errors_travel_in_the_interval_stats_and_merge_across_ranks() -> None:
    a, b = TieredStats(), TieredStats()
    a.record_error("r1", "timeout", "slow")
    b.record_error("r2", "auth", "bad secret" * 100)
    merged = a.aggregate(b)
    assert merged.data["errors"]["r1"] == ["timeout", "slow"]
    assert merged.data["errors"]["r2"][0] == "auth" and len(merged.data["errors"]["r2"][1]) == 500
    assert TieredStats().data["errors"] == {}
