"""A failed KV load's cause reaches the HTTP client's error (vLLM's hook wrapped once)."""

from __future__ import annotations

import pytest

from kvconnectors.errors import CLIENT_ERROR_CAUSE
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
    assert CLIENT_ERROR_CAUSE.search(str(exc.value)).group(1) == "checksum_mismatch"
    # taken once; an unrelated failure keeps vLLM's own error; a normal finish raises nothing
    with pytest.raises(GenerationError, match="Internal server error"):
        GenerateBaseServing._raise_if_error(None, "error", "cmpl-abc")
    GenerateBaseServing._raise_if_error(None, "stop", "cmpl-abc")


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
