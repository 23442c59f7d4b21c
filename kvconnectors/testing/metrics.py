"""What a server's /metrics says, in the shapes the end-to-end tests compare."""

from __future__ import annotations

from collections import Counter
from typing import Any


def failures_by_cause(server: Any) -> Counter:
    """The connector's failed transfers so far on `server` (a VllmServer), by typed cause."""
    return Counter({labels["cause"]: v for labels, v in
                    server.metrics().get("kvconnectors:transfer_failures_total", [])})
