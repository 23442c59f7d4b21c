"""What a server's /metrics says, in the shapes the end-to-end tests compare."""

from __future__ import annotations

from collections import Counter
from typing import Any


def failures_by_cause(server: Any) -> Counter:
    """The connector's failed transfers so far on `server` (a VllmServer), by typed cause, summed
    over the samples of each cause (one per engine)."""
    out: Counter = Counter()
    for labels, v in server.metrics().get("kvconnectors:transfer_failures_total", []):
        out[labels["cause"]] += v
    return out


Samples = dict[str, list[tuple[dict[str, str], float]]]  # VllmServer.metrics(): name -> (labels, value)


def total(metrics: Samples, name: str, **labels: str) -> float:
    """The sum of `name` over its samples whose labels match `labels` (all of them by default)."""
    return sum(v for lab, v in metrics.get(name, []) if all(lab.get(k) == x for k, x in labels.items()))


def by_label(metrics: Samples, name: str, label: str) -> dict[str, float]:
    """`name` summed per value of `label`, zero sums left out."""
    out: Counter = Counter()
    for labels, v in metrics.get(name, []):
        out[labels.get(label, "")] += v
    return {k: v for k, v in out.items() if v}
