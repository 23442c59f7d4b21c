"""Per-interval transfer statistics, shipped worker -> scheduler -> API server by vLLM.

`data` stays a plain dict of numbers and lists so it crosses processes as-is; vLLM's logger
prints `reduce()` as the "KV Transfer metrics" line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

_COUNTERS = ("transfers", "bytes_received", "bytes_staged", "blocks_staged", "staging_failures", "retries",
             "pushes", "bytes_pushed", "push_fallbacks")


def _empty() -> dict[str, Any]:
    # errors: request id -> [cause, message] of failed loads, for the client's error (client_errors.py)
    return {**{k: 0 for k in _COUNTERS}, "transfer_seconds": [], "failures": {}, "errors": {}}


@dataclass
class TieredStats(KVConnectorStats):
    def __post_init__(self) -> None:
        if not self.data:
            self.data = _empty()

    def reset(self) -> None:
        self.data = _empty()

    def record_transfer(self, nbytes: int, seconds: float) -> None:
        self.data["transfers"] += 1
        self.data["bytes_received"] += nbytes
        self.data["transfer_seconds"].append(seconds)

    def record_failure(self, cause: str) -> None:
        self.data["failures"][cause] = self.data["failures"].get(cause, 0) + 1

    def record_error(self, req_id: str, cause: str, message: str) -> None:
        errors = self.data.setdefault("errors", {})
        if len(errors) < 256:  # bounded per interval; beyond it clients get vLLM's generic error
            errors[req_id] = [cause, message[:500]]

    def record_staged(self, nbytes: int, blocks: int) -> None:
        self.data["bytes_staged"] += nbytes
        self.data["blocks_staged"] += blocks

    def record_retry(self, cause: str) -> None:
        self.data["retries"] += 1

    def record_push(self, nbytes: int) -> None:
        self.data["pushes"] += 1
        self.data["bytes_pushed"] += nbytes

    def record_push_fallback(self, cause: str) -> None:
        """A pushed transfer did not land here; the consumer pulled it from the producer instead."""
        self.data["push_fallbacks"] += 1

    def record_staging_failure(self, cause: str) -> None:
        self.data["staging_failures"] += 1
        self.record_failure(f"staging_{cause}")

    def aggregate(self, other: KVConnectorStats) -> "TieredStats":
        for k in _COUNTERS:
            self.data[k] += other.data.get(k, 0)
        self.data["transfer_seconds"].extend(other.data.get("transfer_seconds", []))
        for cause, n in other.data.get("failures", {}).items():
            self.data["failures"][cause] = self.data["failures"].get(cause, 0) + n
        self.data.setdefault("errors", {}).update(other.data.get("errors", {}))
        theirs = other.data.get("store")
        if theirs:  # tensor-parallel ranks each hold a shard: store numbers add up
            mine = self.data.setdefault("store", {"gauges": {}, "deltas": {}})
            for part in ("gauges", "deltas"):
                for k, v in theirs.get(part, {}).items():
                    mine[part][k] = mine[part].get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        secs = self.data["transfer_seconds"]
        total_s = sum(secs)
        out: dict[str, int | float] = {
            "Num transfers": self.data["transfers"],
            "MB received": round(self.data["bytes_received"] / 1e6, 3),
            "MB staged": round(self.data["bytes_staged"] / 1e6, 3),
            "Avg transfer (ms)": round(1e3 * total_s / len(secs), 3) if secs else 0.0,
            "Throughput (GB/s)": round(self.data["bytes_received"] / total_s / 1e9, 3) if total_s else 0.0,
            "Failed transfers": sum(self.data["failures"].values()),
            "Retries": self.data["retries"],
        }
        if self.data["pushes"] or self.data["push_fallbacks"]:
            out["Layer groups pushed"] = self.data["pushes"]
            out["MB pushed"] = round(self.data["bytes_pushed"] / 1e6, 3)
            out["Push fallbacks to pull"] = self.data["push_fallbacks"]
        for cause, n in sorted(self.data["failures"].items()):
            out[f"Failed: {cause}"] = n
        gauges = (self.data.get("store") or {}).get("gauges")
        if gauges:
            out["Store entries"] = gauges["entries"]
            out["Store DRAM MB"] = round(gauges["dram_bytes"] / 1e6, 3)
            out["Store NVMe MB"] = round(gauges["nvme_bytes"] / 1e6, 3)
        return out

    def is_empty(self) -> bool:
        return not (self.data["transfers"] or self.data["bytes_staged"] or self.data["failures"]
                    or self.data["pushes"] or self.data["push_fallbacks"]
                    or self.data.get("store"))

    def clone_and_reset(self) -> "TieredStats":
        out = TieredStats(data=self.data)
        self.data = _empty()
        return out
