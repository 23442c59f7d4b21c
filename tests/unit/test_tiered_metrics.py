"""TieredConnector's metrics: per-path transfer counters, and store gauges read at scrape time.

Built on vLLM's metrics base classes (no engine) with prometheus_client's own Counter/Gauge/
Histogram in a fresh registry, against real in-process store servers (as test_transport.py).
"""

from __future__ import annotations

import logging
from functools import partial
from types import SimpleNamespace

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvconnectors.store import StoreConfig, TieredStore
from kvconnectors.tiered import prom
from kvconnectors.tiered.prom import TieredPromMetrics
from kvconnectors.tiered.stats import TieredStats
from kvconnectors.transport import wire
from kvconnectors.transport.client import store_status
from kvconnectors.transport.server import StoreServer

SLOT, LAYERS, BLOCKS = 4096, 2, 3
SECRET = b"metrics-s3cret-s3cret"
LABELS = {"model_name": "m", "engine": "0"}


class Rank:
    """One tensor-parallel rank's store and store server."""

    def __init__(self) -> None:
        self.store = TieredStore(StoreConfig(slot_bytes=SLOT, dram_bytes=64 * SLOT, lease_ttl_s=30))
        self.server = StoreServer(self.store, "127.0.0.1", 0, fingerprint="fp", num_layers=LAYERS,
                                  compat=wire.compat_hash("tiered"), secret=SECRET)
        self.addr = f"127.0.0.1:{self.server.port}"
        self.open = True

    def stage(self, tid: str) -> None:
        self.store.create(tid, LAYERS, BLOCKS)
        for layer in range(LAYERS):
            self.store.write(tid, layer, 0, np.full((BLOCKS, SLOT), layer, np.uint8))
        self.store.seal(tid)

    def stop(self) -> None:
        if self.open:
            self.open = False
            self.server.close()
            self.store.close()


@pytest.fixture
def ranks():
    made: list[Rank] = []

    def start() -> Rank:
        made.append(Rank())
        return made[-1]

    yield start
    for rank in made:
        rank.stop()


@pytest.fixture
def metrics(tmp_path):
    """TieredPromMetrics as vLLM builds it, its metrics and collector in one fresh registry;
    the secret comes from kv_connector_extra_config.secret_file, as the workers read it."""
    secret_file = tmp_path / "secret"
    secret_file.write_bytes(SECRET)
    secret_file.chmod(0o600)  # a world-readable secret file is refused
    registry = CollectorRegistry()
    types = {cls: partial(cls, registry=registry) for cls in (Counter, Gauge, Histogram)}
    vllm_config = SimpleNamespace(kv_transfer_config=SimpleNamespace(
        kv_connector_extra_config={"secret_file": str(secret_file)}))
    m = TieredPromMetrics(vllm_config, types, ["model_name", "engine"], {0: ["m", "0"]}, registry=registry)
    return m, registry


def interval(addrs: list[str], **gauges: int) -> dict:
    """One interval's stats as a worker ships them (nothing moved, only the store report)."""
    data = TieredStats().data
    data["store"] = {"addrs": addrs, "gauges": gauges, "deltas": {}}
    return data


def gauge(registry: CollectorRegistry, name: str) -> float | None:
    return registry.get_sample_value(f"kvconnectors:store_{name}", LABELS)


def test_store_gauges_are_read_at_scrape_time(metrics, ranks) -> None:
    """An idle instance's /metrics reports the store as it is now, not as the last interval saw it.

    Negative control, run once: with `StoreCollector.collect` replaced by the old last-interval
    gauge (the values of `store.gauges` from the last `observe()`), the after-release assertion
    failed: `entries` stayed 1.0 after the release, as the issue's idle producer showed 8."""
    m, registry = metrics
    rank = ranks()
    rank.stage("t1")
    m.observe(interval([rank.addr], entries=1, dram_bytes=LAYERS * BLOCKS * SLOT, nvme_bytes=0))
    assert gauge(registry, "up") == 1.0
    assert gauge(registry, "entries") == 1.0
    assert gauge(registry, "dram_bytes") == LAYERS * BLOCKS * SLOT
    assert gauge(registry, "nvme_bytes") == 0.0 and gauge(registry, "pinned") == 0.0
    # how full: "store nearly full" is store_dram_bytes / store_dram_capacity_bytes (issue 41)
    assert gauge(registry, "dram_capacity_bytes") == 64 * SLOT and gauge(registry, "nvme_capacity_bytes") == 0.0
    assert gauge(registry, "connections") == 0.0  # the status call's own connection is not counted

    rank.store.release("t1")  # no observe() after this: the engine is idle
    assert gauge(registry, "entries") == 0.0
    assert gauge(registry, "dram_bytes") == 0.0

    rank.stop()
    assert gauge(registry, "up") == 0.0
    assert gauge(registry, "entries") is None, "a store that did not answer must not read as empty"


def test_gauges_sum_over_ranks_and_a_silent_rank_drops_out(metrics, ranks, caplog) -> None:
    """Two TP ranks (their addresses arrive in different intervals): sums over both; one stopped
    -> store_up 0, the other's numbers still shown, the silent rank logged once per minute.

    Seen to fail: with `learn()` replacing the known addresses instead of adding to them, entries
    read 1.0, not 2.0; with the rate limit removed, two warnings were logged."""
    m, registry = metrics
    a, b = ranks(), ranks()
    a.stage("t1")
    b.stage("t1")
    m.observe(interval([a.addr]))
    m.observe(interval([b.addr]))
    assert gauge(registry, "entries") == 2.0 and gauge(registry, "up") == 1.0
    assert gauge(registry, "dram_bytes") == 2 * LAYERS * BLOCKS * SLOT
    assert gauge(registry, "dram_capacity_bytes") == 2 * 64 * SLOT  # the pool's DRAM over both ranks

    b.stop()
    with caplog.at_level(logging.WARNING, logger=prom.__name__):
        assert gauge(registry, "up") == 0.0
        assert gauge(registry, "entries") == 1.0
    warned = [r for r in caplog.records if b.addr in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in caplog.records]


def test_the_connector_secret_reaches_the_status_call(metrics, ranks) -> None:
    """The store servers require the shared secret; without it every scrape reads store_up 0.

    Seen to fail: with `connector_secret` returning None, `up` read 0.0."""
    m, registry = metrics
    rank = ranks()
    m.observe(interval([rank.addr]))
    assert gauge(registry, "up") == 1.0
    assert rank.server.counters.auth_failures == 0


def test_failure_counts_are_exported_as_counters(metrics, ranks) -> None:
    """A count since the server started is a counter (`_total`, TYPE counter), so rate()/increase()
    apply; it was only a gauge (issue 41). Seen to fail: with the two counters declared as gauges,
    the _total sample read None."""
    m, registry = metrics
    rank = ranks()
    with pytest.raises(Exception):  # a peer without the secret fails the proof and is counted
        store_status("127.0.0.1", rank.server.port, secret=b"wrong-s3cret-wrong-s3cret", timeout_s=2)
    m.observe(interval([rank.addr]))
    assert registry.get_sample_value("kvconnectors:store_failed_handshakes_total", LABELS) == 1.0
    assert registry.get_sample_value("kvconnectors:store_failed_seals_total", LABELS) == 0.0
    kinds = {f.name: f.type for f in registry.collect()}
    assert kinds["kvconnectors:store_failed_handshakes"] == "counter", kinds
    # the deprecated gauge of the same count stays one release (tiered/README.md, Naming)
    assert gauge(registry, "auth_failures") == 1.0 and kinds["kvconnectors:store_auth_failures"] == "gauge"


def test_transfer_bytes_carry_the_data_path(metrics) -> None:
    """Bytes and loads are labelled with the path that carried them, and no other path.

    Seen to fail: with observe() labelling every byte "tcp", the samples read {'tcp': 10.0}."""
    m, registry = metrics
    stats = TieredStats()
    stats.record_transfer({"shm": 10}, 0.01)
    m.observe(stats.data)
    samples = {s.labels["path"]: s.value for fam in registry.collect() if fam.name == "kvconnectors:transfer_bytes"
               for s in fam.samples if s.name.endswith("_total")}
    assert samples == {"shm": 10.0}, samples
    assert registry.get_sample_value("kvconnectors:transfers_total", {**LABELS, "path": "shm"}) == 1.0
    assert registry.get_sample_value("kvconnectors:transfers_total", {**LABELS, "path": "tcp"}) is None


def test_path_fallbacks_are_counted_by_configured_and_used_path(metrics) -> None:
    """Seen to fail: with observe() skipping data["path_fallbacks"], the sample read None."""
    m, registry = metrics
    stats = TieredStats()
    stats.record_path_fallback("shm", "tcp")
    stats.record_path_fallback("shm", "tcp")
    assert not stats.is_empty()
    m.observe(stats.data)
    got = registry.get_sample_value("kvconnectors:path_fallbacks_total", {**LABELS, "configured": "shm", "used": "tcp"})
    assert got == 2.0


def test_stats_merge_paths_and_store_addresses_across_ranks() -> None:
    """Seen to fail: with aggregate() leaving out bytes_by_path, bytes_by_path read {'shm': 1000, ...}
    (rank 0's only)."""
    r0, r1 = TieredStats(), TieredStats()
    r0.record_transfer({"shm": 1000, "tcp": 10}, 0.1)
    r1.record_transfer({"shm": 1000}, 0.1)
    r1.record_transfer({}, 0.1)  # nothing to move (every block already local)
    r0.data["store"] = {"addrs": ["h:1"], "gauges": {"entries": 2}, "deltas": {"releases": 1}}
    r1.data["store"] = {"addrs": ["h:2", "h:1"], "gauges": {"entries": 3}, "deltas": {"releases": 2}}
    merged = TieredStats(data=r0.data).aggregate(TieredStats(data=r1.data))
    assert merged.data["bytes_by_path"] == {"shm": 2000, "tcp": 10}
    assert merged.data["transfers_by_path"] == {"shm": 2, "none": 1}
    assert merged.data["transfers"] == 3 and merged.data["bytes_received"] == 2010
    assert merged.data["store"] == {"addrs": ["h:1", "h:2"], "gauges": {"entries": 5}, "deltas": {"releases": 3}}
    line = merged.reduce()
    assert line["MB via shm"] == 0.002 and line["MB via tcp"] == 0.0 and line["Store entries"] == 5


def test_a_second_construction_replaces_the_collector() -> None:
    """Built twice in one process (tests, a restarted logger): one collector, no duplicate error.

    Seen to fail: without the unregister in `install_collector`, the second construction raised
    "Duplicated timeseries in CollectorRegistry"."""
    registry = CollectorRegistry()
    vllm_config = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config={}))
    for _ in range(2):
        counters = CollectorRegistry()  # the counters are vLLM's to register; only the collector is shared
        types = {cls: partial(cls, registry=counters) for cls in (Counter, Gauge, Histogram)}
        m = TieredPromMetrics(vllm_config, types, ["model_name", "engine"], {0: ["m", "0"]}, registry=registry)
    m.observe(interval(["127.0.0.1:1"]))  # port 1: nothing listens
    families = [f.name for f in registry.collect()]
    assert families.count("kvconnectors:store_up") == 1
    assert registry.get_sample_value("kvconnectors:store_up", LABELS) == 0.0
