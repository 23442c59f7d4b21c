"""Prometheus metrics of TieredConnector, registered by vLLM in the API-server process.

Every metric (name, type, labels, help, what feeds it) is declared once in metrics.py; this module
registers them and fills them. Two sources, one per kind of metric:

- Counters (transfers, bytes, failures, store spills, ...) come from each interval's
  `TieredStats.data` (stats.py), which vLLM hands to `observe()`; metric objects are vLLM's own
  classes (`metric_types`), one child per engine label set.
- Gauges of state (store entries, DRAM and NVMe bytes, pinned entries, connections) are read at
  scrape time by `StoreCollector`, which asks each store server (one per tensor-parallel rank,
  addresses learned from `data["store"]["addrs"]`) for its status. Interval stats only arrive
  when the engine steps, so gauges taken from them stayed at their last value on an idle engine.

The collector is registered in prometheus_client's default REGISTRY, which vLLM's `/metrics`
serves with one API server. With `--api-server-count` > 1 vLLM serves a multiprocess registry
that holds only file-backed metrics, so the state gauges are not exported there (logged).
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics

from kvconnectors.errors import TransferError
from kvconnectors.logs import get_logger
from kvconnectors.tiered import client_errors, metrics
from kvconnectors.tiered.config import TieredConfig
from kvconnectors.tiered.metrics import Metric
from kvconnectors.transport import wire
from kvconnectors.transport.auth import load_secret
from kvconnectors.transport.client import store_status
from kvconnectors.transport.protocol import parse_target

logger = get_logger(__name__)

STATUS_TIMEOUT_S = 1.0   # per rank and step (connect, then status): a scrape must stay short
LOG_EVERY_S = 60.0       # an unreachable rank is logged at most this often


class StoreCollector:
    """Scrape-time state of the store servers of each engine, summed over its TP ranks."""

    def __init__(self, labelnames: list[str], secret: bytes | None, timeout_s: float = STATUS_TIMEOUT_S,
                 protection: str = "handshake"):
        self._labelnames = list(labelnames)
        self._secret, self._timeout_s = secret, timeout_s
        self._protection = protection  # the servers' wire_protection: they refuse a status call without it
        self._lock = threading.Lock()
        self._engines: dict[int, tuple[list[str], list[str]]] = {}  # engine -> (label values, addrs)
        self._last_logged: dict[str, float] = {}

    def learn(self, engine_idx: int, labelvalues: list[object], addrs: list[str]) -> None:
        """Remember `addrs` for this engine (added to those known: a rank whose stats did not
        change this interval sends none, and a store lives as long as its engine)."""
        with self._lock:
            _, known = self._engines.get(engine_idx, ([], []))
            known = known + [a for a in addrs if a not in known]
            self._engines[engine_idx] = ([str(v) for v in labelvalues], known)

    def describe(self) -> list[GaugeMetricFamily | CounterMetricFamily]:
        return list(self._families().values())  # names only: registering must not touch the network

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        with self._lock:
            engines = dict(self._engines)
        replies = self._query({a for _, addrs in engines.values() for a in addrs})
        families = self._families()
        for labelvalues, addrs in engines.values():
            answered = [replies[a] for a in addrs if replies.get(a) is not None]
            families[metrics.STORE_UP].add_metric(labelvalues, 1.0 if len(answered) == len(addrs) else 0.0)
            if not answered:
                continue  # no rank answered: no value, rather than zeros that read as an empty store
            for m in metrics.STATUS:
                families[m].add_metric(labelvalues, float(sum(getattr(r, m.key) for r in answered)))
        yield from families.values()

    def _families(self) -> dict[Metric, GaugeMetricFamily | CounterMetricFamily]:
        return {m: (CounterMetricFamily if m.kind == "counter" else GaugeMetricFamily)(m.name, m.help,
                                                                                      labels=self._labelnames)
                for m in (*metrics.STATUS, metrics.STORE_UP)}

    def _query(self, addrs: set[str]) -> dict[str, wire.StatusReply | None]:
        ordered = sorted(addrs)
        if len(ordered) <= 1:  # the usual case (one rank): no thread
            return {a: self._status(a) for a in ordered}
        with ThreadPoolExecutor(max_workers=min(len(ordered), 16), thread_name_prefix="kvc-scrape") as pool:
            return dict(zip(ordered, pool.map(self._status, ordered)))  # ranks in parallel: one timeout in all

    def _status(self, addr: str) -> wire.StatusReply | None:
        try:
            host, port = parse_target(addr)
            return store_status(host, port, secret=self._secret, timeout_s=self._timeout_s,
                                protection=self._protection)
        except (TransferError, OSError, ValueError) as exc:
            self._log_unreachable(addr, exc)
            return None

    def _log_unreachable(self, addr: str, exc: Exception) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last_logged.get(addr, -LOG_EVERY_S) < LOG_EVERY_S:
                return
            self._last_logged[addr] = now
        logger.warning("store server %s did not answer its status call (store gauges leave it out, "
                       "%s 0): %s", addr, metrics.STORE_UP.name, exc)


# the StoreCollector registered in each registry: a second TieredPromMetrics replaces the first
_installed: "weakref.WeakKeyDictionary[CollectorRegistry, StoreCollector]" = weakref.WeakKeyDictionary()
_install_lock = threading.Lock()


def install_collector(collector: StoreCollector, registry: CollectorRegistry) -> None:
    with _install_lock:
        previous = _installed.pop(registry, None)
        if previous is not None:
            try:
                registry.unregister(previous)
            except KeyError:  # someone unregistered it already
                pass
        registry.register(collector)
        _installed[registry] = collector


def connector_secret(vllm_config: Any) -> bytes | None:
    """The shared secret the workers' store servers require (same settings as the connector)."""
    extra = getattr(getattr(vllm_config, "kv_transfer_config", None), "kv_connector_extra_config", None)
    return load_secret(TieredConfig.from_extra(extra).secret_file)


class TieredPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]], registry: CollectorRegistry | None = None):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._labels = labelnames
        # declared metric -> registered one: the parent for labelled counters (their label values come
        # with the data), one child per engine for the others
        self.fed: dict[Metric, Any] = {m: self._register(m, per_engine_labelvalues)
                                       for m in (*metrics.INTERVAL, *metrics.STORE_COUNTERS)}
        extra = getattr(getattr(vllm_config, "kv_transfer_config", None), "kv_connector_extra_config", None)
        self.store_state = StoreCollector(labelnames, connector_secret(vllm_config),
                                          protection=TieredConfig.from_extra(extra).wire_protection)
        install_collector(self.store_state, REGISTRY if registry is None else registry)
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            logger.warning("PROMETHEUS_MULTIPROC_DIR is set (api_server_count > 1): vLLM's /metrics serves "
                           "only file-backed metrics, so the kvconnectors:store_* state gauges are not exported")

    def _register(self, m: Metric, per_engine_labelvalues: dict[int, list[object]]) -> Any:
        labelnames = [*self._labels, *m.labels]
        if m.kind == "histogram":
            metric = self._histogram_cls(name=m.name, documentation=m.help, labelnames=labelnames,
                                         buckets=list(m.buckets))
        else:
            metric = self._counter_cls(name=m.name, documentation=m.help, labelnames=labelnames)
        if m.labels:
            return metric
        return {idx: metric.labels(*values) for idx, values in per_engine_labelvalues.items()}

    def observe(self, data: dict[str, Any], engine_idx: int = 0) -> None:
        client_errors.remember(data.get("errors"))
        labels = self.per_engine_labelvalues[engine_idx]
        store = data.get("store") or {}
        for m, metric in self.fed.items():
            value = ((store.get("deltas") or {}) if m.source == "store" else data).get(m.key)
            if not value:
                continue
            if m.kind == "histogram":
                for seconds in value:
                    metric[engine_idx].observe(seconds)
            elif m.labels:
                for key, n in value.items():
                    if n:
                        self._count_labelled(m, metric, labels, key, n)
            else:
                metric[engine_idx].inc(value)
        if store.get("addrs"):
            self.store_state.learn(engine_idx, labels, store["addrs"])

    @staticmethod
    def _count_labelled(m: Metric, metric: Any, labels: list[object], key: str, n: int) -> None:
        try:
            values = metrics.label_values(m, key)
        except ValueError as exc:  # a bug in what fed it; the API server's stats loop must go on
            logger.warning("%s not counted: %s", m.name, exc)
            return
        metric.labels(*labels, *values).inc(n)
