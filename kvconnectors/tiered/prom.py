"""Prometheus metrics of TieredConnector, registered by vLLM in the API-server process.

vLLM calls `observe()` with each interval's `TieredStats.data` (see stats.py); metric objects
are vLLM's own wrappers (`metric_types`), one child per engine label set.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import Counter, Gauge, Histogram
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics

from kvconnectors.tiered import client_errors

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
_STORE_GAUGES = {
    "entries": "transfers held in the store",
    "dram_bytes": "bytes held in the DRAM tier",
    "nvme_bytes": "bytes held in the NVMe tier",
}


class TieredPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._labels = labelnames
        client_errors.install()  # this is the API-server process: let failed requests say why

        def per_engine(metric: Any) -> dict[int, Any]:
            return {idx: metric.labels(*values) for idx, values in per_engine_labelvalues.items()}

        c = self._counter_cls
        self.transfers = per_engine(c(name="kvconnectors:transfers", labelnames=labelnames,
                                      documentation="KV transfers completed into this (decode) instance."))
        self.transfer_bytes = per_engine(c(name="kvconnectors:transfer_bytes", labelnames=labelnames,
                                           documentation="KV bytes received by this (decode) instance."))
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
        self.store_gauges = {
            k: per_engine(self._gauge_cls(name=f"kvconnectors:store_{k}", labelnames=labelnames,
                                          documentation=f"Store: {doc}.", multiprocess_mode="mostrecent"))
            for k, doc in _STORE_GAUGES.items()}

    def observe(self, data: dict[str, Any], engine_idx: int = 0) -> None:
        client_errors.remember(data.get("errors"))
        if data.get("transfers"):
            self.transfers[engine_idx].inc(data["transfers"])
        if data.get("bytes_received"):
            self.transfer_bytes[engine_idx].inc(data["bytes_received"])
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
        labels = self.per_engine_labelvalues[engine_idx]
        for cause, n in data.get("failures", {}).items():
            self.failures.labels(*labels, cause).inc(n)
        store = data.get("store") or {}
        for k, n in store.get("deltas", {}).items():
            if k in self.store_counters and n:
                self.store_counters[k][engine_idx].inc(n)
        for k, v in store.get("gauges", {}).items():
            if k in self.store_gauges:
                self.store_gauges[k][engine_idx].set(v)
