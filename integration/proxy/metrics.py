"""The proxy's Prometheus metrics (served at /metrics), in a registry of their own."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class ProxyMetrics:
    """All proxy metrics, in their own registry (several proxies can live in one process)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        lat = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
        self.ttft = Histogram("kvproxy_ttft_seconds", "Time to first streamed decode event, from request arrival",
                              ["endpoint"], buckets=lat, registry=r)
        self.itl = Histogram("kvproxy_itl_seconds", "Time between streamed decode events",
                             ["endpoint"], buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
                             registry=r)
        self.e2e = Histogram("kvproxy_e2e_latency_seconds", "Request latency, arrival to last byte",
                             ["endpoint"], buckets=lat, registry=r)
        self.prefill_latency = Histogram("kvproxy_prefill_latency_seconds", "Prefill leg latency (successful attempt)",
                                         buckets=lat, registry=r)
        self.requests = Counter("kvproxy_requests", "Requests answered, by endpoint and HTTP status",
                                ["endpoint", "status"], registry=r)
        self.outstanding = Gauge("kvproxy_outstanding_requests", "Requests in flight per instance",
                                 ["role", "instance"], registry=r)
        self.healthy = Gauge("kvproxy_instance_healthy", "1 if the instance is in rotation, else 0",
                             ["role", "instance"], registry=r)
        self.prefill_failures = Counter("kvproxy_prefill_failures", "Failed prefill attempts by reason",
                                        ["reason"], registry=r)
        self.decode_failures = Counter("kvproxy_decode_failures", "Failed decode legs by reason",
                                       ["reason"], registry=r)
        self.body_bytes = Gauge("kvproxy_inflight_body_bytes", "Request body bytes held by requests in flight "
                                "(bounded by --max-inflight-body-bytes)", registry=r)
        self.body_refusals = Counter("kvproxy_body_refusals", "Requests refused by the body limits: body_too_large "
                                     "(413), too_many_strings (400), body_budget_exhausted (503), body_timeout (408)",
                                     ["reason"], registry=r)
        self.client_refusals = Counter("kvproxy_client_refusals", "Connections and requests refused per client: "
                                       "client_connections (closed at once), header_timeout (closed), "
                                       "client_requests (429)", ["reason"], registry=r)
        self.retries = Counter("kvproxy_prefill_retries", "Prefill attempts retried on another instance",
                               registry=r)
        # labels() takes a lock and builds its key on every call: the per-request path looks its
        # children up in these dicts instead.
        self._children: dict[tuple[Any, ...], Any] = {}

    def child(self, metric: Any, *labels: str) -> Any:
        key = (id(metric), *labels)
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = metric.labels(*labels)
        return c
