"""Each metric is declared once (tiered/metrics.py) and that one table drives both the stats object
and the Prometheus side."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvconnectors.store.stats import FIELDS
from kvconnectors.tiered import metrics
from kvconnectors.tiered.metrics import Metric
from kvconnectors.tiered.prom import TieredPromMetrics
from kvconnectors.tiered.stats import TieredStats
from kvconnectors.transport import wire

README = Path(metrics.__file__).with_name("README.md")
LABELS = {"model_name": "m", "engine": "0"}


@pytest.fixture
def registry():
    """TieredPromMetrics as vLLM builds it, every metric and the store collector in one registry."""
    registry = CollectorRegistry()
    types = {cls: partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}
    vllm_config = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config={}))
    m = TieredPromMetrics(vllm_config, types, ["model_name", "engine"], {0: ["m", "0"]}, registry=registry)
    return m, registry


def test_every_declared_metric_is_registered_as_declared(registry) -> None:
    """Name, type and help on /metrics are the table's, and nothing else is registered.

    Seen to fail: with the store counters left out of TieredPromMetrics.fed,
    "kvconnectors:store_spills is declared but not registered"."""
    _, reg = registry
    families = {f.name: f for f in reg.collect()}
    for m in metrics.ALL:
        family = families.pop(m.name, None)
        assert family is not None, f"{m.name} is declared but not registered"
        assert (family.type, family.documentation) == (m.kind, m.help), m.name
    assert not families, f"registered but not declared: {sorted(families)}"


def test_interval_data_has_every_key_the_metrics_are_fed_from() -> None:
    """stats.py builds its data from the table: an int, a dict or a list per declared key.

    Seen to fail: with `_PER_KEY` back to a hand-written tuple without "failures",
    data["failures"] was missing."""
    data = TieredStats().data
    for m in metrics.INTERVAL:
        want = list if m.kind == "histogram" else dict if m.labels else int
        assert isinstance(data.get(m.key), want), (m.name, m.key, data.get(m.key))


def test_what_the_stats_record_reaches_each_declared_interval_metric(registry) -> None:
    """One of each recording, through observe(), gives every interval and store counter a sample.

    Seen to fail: with observe() not reading the store deltas, kvconnectors:store_spills had no
    sample; with the table's key for pushed_bytes misspelled, record_push raised KeyError (stats.py
    builds its data from the table's keys)."""
    m, reg = registry
    stats = TieredStats()
    stats.record_transfer({"shm": 10, "tcp": 1}, 0.01)
    stats.record_path_fallback("shm", "tcp")
    stats.record_nixl_vram_fallback("registration")
    stats.record_staged(4096, 2)
    stats.record_retry("timeout")
    stats.record_push(4096)
    stats.record_push_fallback("peer_unreachable")
    stats.record_failure("checksum_mismatch")
    stats.data["store"] = {"addrs": [], "gauges": {}, "deltas": {m.key: 3 for m in metrics.STORE_COUNTERS}}
    m.observe(stats.data)
    for declared in (*metrics.INTERVAL, *metrics.STORE_COUNTERS):
        suffix = "_count" if declared.kind == "histogram" else "_total"
        samples = [s for f in reg.collect() if f.name == declared.name for s in f.samples
                   if s.name == declared.name + suffix]
        assert samples and all(s.value > 0 for s in samples), (declared.name, samples)
        assert all(set(s.labels) == {*LABELS, *declared.labels} for s in samples), (declared.name, samples)
    assert reg.get_sample_value("kvconnectors:path_fallbacks_total",
                                {**LABELS, "configured": "shm", "used": "tcp"}) == 1.0


def test_sources_name_real_fields() -> None:
    """Store counters are fields of the store's counters, status gauges fields of StatusReply.

    Seen to fail: with the `connections` gauge declared on a field "connections", it was not in
    StatusReply's fields."""
    assert {m.key for m in metrics.STORE_COUNTERS} <= set(FIELDS)
    status_fields = {f.name for f in msgspec.structs.fields(wire.StatusReply)}
    assert {m.key for m in metrics.STATUS} <= status_fields
    assert len({m.name for m in metrics.ALL}) == len(metrics.ALL), "a name declared twice"


def test_label_keys_round_trip_and_a_bad_key_is_named() -> None:
    """Seen to fail: with label_values splitting on "-" instead of LABEL_SEP, ("shm", ">tcp")."""
    fallbacks = next(m for m in metrics.INTERVAL if m.key == "path_fallbacks")
    assert metrics.label_values(fallbacks, metrics.label_key("shm", "tcp")) == ("shm", "tcp")
    failures = next(m for m in metrics.INTERVAL if m.key == "failures")
    assert metrics.label_values(failures, "staging_store_full") == ("staging_store_full",)
    with pytest.raises(ValueError, match=r"key 'shm' of data\['path_fallbacks'\]"):
        metrics.label_values(fallbacks, "shm")


def test_a_malformed_declaration_is_refused_with_its_field() -> None:
    """Seen to fail: without the buckets check in Metric.__post_init__, no error."""
    with pytest.raises(ValueError, match="'vllm:x' does not start with 'kvconnectors:'"):
        Metric("vllm:x", "counter", "h", "interval", "x")
    with pytest.raises(ValueError, match="buckets"):
        Metric("kvconnectors:x", "histogram", "h", "interval", "x")
    with pytest.raises(ValueError, match="source 'status'"):
        Metric("kvconnectors:x", "histogram", "h", "status", "x", buckets=(1.0,))
    with pytest.raises(ValueError, match="only for interval counters"):
        Metric("kvconnectors:x", "gauge", "h", "status", "x", labels=("a",))


def test_the_readme_lists_every_declared_name() -> None:
    """Seen to fail: with `kvconnectors:store_pinned` taken out of the README's gauge table."""
    text = README.read_text()
    missing = [m.name for m in metrics.ALL if f"`{m.name}`" not in text]
    assert not missing, f"tiered/README.md (Metrics) does not list {missing}"


def test_a_malformed_label_key_is_logged_and_the_rest_still_counted(registry, caplog) -> None:
    """observe() runs in vLLM's stats loop of the API server: a bad key must not stop it.

    Seen to fail: without the try/except in `_count_labelled`, observe() raised ValueError."""
    m, reg = registry
    with caplog.at_level("WARNING", logger="kvconnectors.tiered.prom"):
        m.observe({"path_fallbacks": {"shm": 1}, "pushes": 2})
    assert any("kvconnectors:path_fallbacks not counted" in r.getMessage() and "'shm'" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    assert reg.get_sample_value("kvconnectors:pushes_total", LABELS) == 2.0
