"""Prometheus metrics of TieredConnector, registered by vLLM in the API-server process.

Two sources, one per kind of metric:

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

import logging
import os
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics

from kvconnectors.errors import TransferError
from kvconnectors.tiered import client_errors
from kvconnectors.tiered.config import TieredConfig
from kvconnectors.tiered.stats import DATA_PATHS
from kvconnectors.transport import wire
from kvconnectors.transport.auth import load_secret
from kvconnectors.transport.client import store_status
from kvconnectors.transport.push import parse_target

logger = logging.getLogger(__name__)

_SECONDS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]
_STORE_COUNTERS = {
    "spills": "entries spilled from DRAM to NVMe",
    "spill_bytes": "bytes spilled from DRAM to NVMe",
    "restores": "entries restored from NVMe to DRAM",
    "restore_bytes": "bytes restored from NVMe to DRAM",
    "hits_dram": "reads served from DRAM",
    "hits_nvme": "reads served from NVMe",
    "renewals": "lease renewals",
    "releases": "explicit lease releases",
    "expiries": "leases that expired (consumer never came or died)",
}
# scrape-time gauge -> (its value in one rank's StatusReply, help)
_STORE_GAUGES: dict[str, tuple[str, str]] = {
    "entries": ("entries", "transfers held in the store"),
    "dram_bytes": ("dram_used_bytes", "bytes held in the DRAM tier"),
    "nvme_bytes": ("nvme_used_bytes", "bytes held in the NVMe tier"),
    "pinned": ("pinned", "entries pinned by a read in progress"),
    "connections": ("active_connections", "open connections to the store server (pulls, pushes, renewals)"),
}
STATUS_TIMEOUT_S = 1.0   # per rank and step (connect, then status): a scrape must stay short
LOG_EVERY_S = 60.0       # an unreachable rank is logged at most this often
_PATHS_HELP = ", ".join(DATA_PATHS)


class StoreCollector:
    """Scrape-time state of the store servers of each engine, summed over its TP ranks."""

    def __init__(self, labelnames: list[str], secret: bytes | None, timeout_s: float = STATUS_TIMEOUT_S):
        self._labelnames = list(labelnames)
        self._secret, self._timeout_s = secret, timeout_s
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

    def describe(self) -> list[GaugeMetricFamily]:
        return list(self._families().values())  # names only: registering must not touch the network

    def collect(self) -> Iterator[GaugeMetricFamily]:
        with self._lock:
            engines = dict(self._engines)
        replies = self._query({a for _, addrs in engines.values() for a in addrs})
        families = self._families()
        for labelvalues, addrs in engines.values():
            answered = [replies[a] for a in addrs if replies.get(a) is not None]
            families["up"].add_metric(labelvalues, 1.0 if len(answered) == len(addrs) else 0.0)
            if not answered:
                continue  # no rank answered: no value, rather than zeros that read as an empty store
            for key, (field_name, _) in _STORE_GAUGES.items():
                families[key].add_metric(labelvalues, float(sum(getattr(r, field_name) for r in answered)))
        yield from families.values()

    def _families(self) -> dict[str, GaugeMetricFamily]:
        out = {key: GaugeMetricFamily(f"kvconnectors:store_{key}", f"Store: {doc} (read at scrape time, "
                                      "summed over tensor-parallel ranks).", labels=self._labelnames)
               for key, (_, doc) in _STORE_GAUGES.items()}
        out["up"] = GaugeMetricFamily("kvconnectors:store_up", "1 if every tensor-parallel rank's store server "
                                      "answered this scrape's status call, else 0.", labels=self._labelnames)
        return out

    def _query(self, addrs: set[str]) -> dict[str, wire.StatusReply | None]:
        ordered = sorted(addrs)
        if len(ordered) <= 1:  # the usual case (one rank): no thread
            return {a: self._status(a) for a in ordered}
        with ThreadPoolExecutor(max_workers=min(len(ordered), 16), thread_name_prefix="kvc-scrape") as pool:
            return dict(zip(ordered, pool.map(self._status, ordered)))  # ranks in parallel: one timeout in all

    def _status(self, addr: str) -> wire.StatusReply | None:
        try:
            host, port = parse_target(addr)
            return store_status(host, port, secret=self._secret, timeout_s=self._timeout_s)
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
                       "kvconnectors:store_up 0): %s", addr, exc)


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
        client_errors.install()  # this is the API-server process: let failed requests say why

        def per_engine(metric: Any) -> dict[int, Any]:
            return {idx: metric.labels(*values) for idx, values in per_engine_labelvalues.items()}

        c = self._counter_cls
        self.transfers = c(name="kvconnectors:transfers", labelnames=[*labelnames, "path"],
                           documentation=f"KV transfers completed into this (decode) instance, by the data "
                                         f"path that carried most of their bytes ({_PATHS_HELP}; none: "
                                         "nothing to move).")
        self.transfer_bytes = c(name="kvconnectors:transfer_bytes", labelnames=[*labelnames, "path"],
                                documentation=f"KV bytes received by this (decode) instance, by data path "
                                              f"({_PATHS_HELP}).")
        self.path_fallbacks = c(name="kvconnectors:path_fallbacks", labelnames=[*labelnames, "configured", "used"],
                                documentation="KV loads that could not use the configured data path and used "
                                              "another (e.g. shm -> tcp for a producer without shared memory).")
        self.staged_bytes = per_engine(c(name="kvconnectors:staged_bytes", labelnames=labelnames,
                                         documentation="KV bytes staged into the host store (prefill side)."))
        self.transfer_time = per_engine(self._histogram_cls(
            name="kvconnectors:transfer_seconds", buckets=_SECONDS, labelnames=labelnames,
            documentation="Duration of one request's KV pull, connect to last byte."))
        self.retries = per_engine(c(name="kvconnectors:transfer_retries", labelnames=labelnames,
                                    documentation="KV pulls retried after a transient fault (failure_policy retry)."))
        self.pushes = per_engine(c(name="kvconnectors:pushes", labelnames=labelnames,
                                   documentation="Transfers pushed to a decode instance's landing store (prefill side)."))
        self.pushed_bytes = per_engine(c(name="kvconnectors:pushed_bytes", labelnames=labelnames,
                                         documentation="KV bytes pushed to decode instances (prefill side)."))
        self.push_fallbacks = per_engine(c(name="kvconnectors:push_fallbacks", labelnames=labelnames,
                                           documentation="Pushed transfers that did not land, pulled instead "
                                                         "(decode side)."))
        self.failures = c(name="kvconnectors:transfer_failures", labelnames=[*labelnames, "cause"],
                          documentation="KV transfer and staging failures by cause.")
        self.store_counters = {
            k: per_engine(c(name=f"kvconnectors:store_{k}", labelnames=labelnames, documentation=f"Store: {doc}."))
            for k, doc in _STORE_COUNTERS.items()}
        self.store_state = StoreCollector(labelnames, connector_secret(vllm_config))
        install_collector(self.store_state, REGISTRY if registry is None else registry)
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            logger.warning("PROMETHEUS_MULTIPROC_DIR is set (api_server_count > 1): vLLM's /metrics serves "
                           "only file-backed metrics, so the kvconnectors:store_* state gauges are not exported")

    def observe(self, data: dict[str, Any], engine_idx: int = 0) -> None:
        client_errors.remember(data.get("errors"))
        labels = self.per_engine_labelvalues[engine_idx]
        for path, n in data.get("transfers_by_path", {}).items():
            if n:
                self.transfers.labels(*labels, path).inc(n)
        for path, n in data.get("bytes_by_path", {}).items():
            if n:
                self.transfer_bytes.labels(*labels, path).inc(n)
        for fallback, n in data.get("path_fallbacks", {}).items():
            configured, _, used = fallback.partition("->")
            self.path_fallbacks.labels(*labels, configured, used).inc(n)
        if data.get("bytes_staged"):
            self.staged_bytes[engine_idx].inc(data["bytes_staged"])
        if data.get("retries"):
            self.retries[engine_idx].inc(data["retries"])
        if data.get("pushes"):
            self.pushes[engine_idx].inc(data["pushes"])
        if data.get("bytes_pushed"):
            self.pushed_bytes[engine_idx].inc(data["bytes_pushed"])
        if data.get("push_fallbacks"):
            self.push_fallbacks[engine_idx].inc(data["push_fallbacks"])
        for seconds in data.get("transfer_seconds", []):
            self.transfer_time[engine_idx].observe(seconds)
        for cause, n in data.get("failures", {}).items():
            self.failures.labels(*labels, cause).inc(n)
        store = data.get("store") or {}
        for k, n in store.get("deltas", {}).items():
            if k in self.store_counters and n:
                self.store_counters[k][engine_idx].inc(n)
        if store.get("addrs"):
            self.store_state.learn(engine_idx, labels, store["addrs"])
