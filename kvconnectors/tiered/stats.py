"""Per-interval transfer statistics, shipped worker -> scheduler -> API server by vLLM.

`data` stays a plain dict of numbers, lists and dicts so it crosses processes as-is; vLLM's
logger prints `reduce()` as the "KV Transfer metrics" line and `TieredPromMetrics.observe`
(prom.py) turns it into the Prometheus metrics declared, with the key each is fed from, in
metrics.py. Shape (one interval, summed over TP ranks):

    transfers, bytes_received, ...          totals (_COUNTERS)
    bytes_by_path      {"shm": 1048576}     bytes each data path carried (DATA_PATHS)
    transfers_by_path  {"shm": 3}           loads, each under the path that carried most of its bytes
                                            ("none": a load with nothing to move)
    path_fallbacks     {"shm->tcp": 1}      loads that could not use the configured path
    nixl_vram_fallbacks {"checksum": 1}     CUDA + nixl consumer ranks not READing into VRAM, by reason
    transfer_seconds   [0.012, ...]
    failures           {cause: n};  errors {request id: [cause, message]}
    store              {"addrs": ["host:port", ...], "gauges": {...}, "deltas": {...}}   (optional)

`store.addrs` are the store servers this engine's workers run (one per TP rank): the API server
asks them for their state at scrape time. `store.gauges` feed only the log line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvconnectors.tiered import metrics
from kvconnectors.tiered.metrics import DATA_PATHS, NO_PATH  # noqa: F401  (the path labels; imported from here too)

# What `data` holds: the keys the exported metrics are fed from (metrics.INTERVAL), and totals only
# the log line and `is_empty` read.
_LOG_ONLY = ("transfers", "bytes_received", "blocks_staged", "staging_failures")
_COUNTERS = (*_LOG_ONLY, *(m.key for m in metrics.INTERVAL if m.kind == "counter" and not m.labels))
_PER_KEY = tuple(m.key for m in metrics.INTERVAL if m.kind == "counter" and m.labels)  # dicts of counts
_LISTS = tuple(m.key for m in metrics.INTERVAL if m.kind == "histogram")  # observations


def _empty() -> dict[str, Any]:
    # errors: request id -> [cause, message] of failed loads, for the client's error (client_errors.py)
    return {**{k: 0 for k in _COUNTERS}, **{k: {} for k in _PER_KEY}, **{k: [] for k in _LISTS}, "errors": {}}


def _add_counts(mine: dict[str, int], theirs: dict[str, int]) -> None:
    for key, n in theirs.items():
        mine[key] = mine.get(key, 0) + n


def main_path(bytes_by_path: dict[str, int]) -> str:
    """The path a load is counted under: the one that carried most of its bytes."""
    if not bytes_by_path:
        return NO_PATH
    return max(bytes_by_path, key=lambda path: bytes_by_path[path])


def merge_store(mine: dict[str, Any] | None, theirs: dict[str, Any]) -> dict[str, Any]:
    """Two ranks' store reports as one: addresses listed once each (order kept), numbers added
    (tensor-parallel ranks each hold a shard)."""
    out = {"addrs": list((mine or {}).get("addrs", [])), "gauges": dict((mine or {}).get("gauges", {})),
           "deltas": dict((mine or {}).get("deltas", {}))}
    out["addrs"] += [a for a in theirs.get("addrs", []) if a not in out["addrs"]]
    for part in ("gauges", "deltas"):
        _add_counts(out[part], theirs.get(part, {}))
    return out


@dataclass
class TieredStats(KVConnectorStats):
    def __post_init__(self) -> None:
        for key, value in _empty().items():  # a shipped dict has every key; a partial one gets the rest
            self.data.setdefault(key, value)

    def reset(self) -> None:
        self.data = _empty()

    def record_transfer(self, bytes_by_path: dict[str, int], seconds: float) -> None:
        """One completed load and the bytes each data path carried (`DATA_PATHS`); {} for a load
        that had nothing to move (counted under `NO_PATH`)."""
        self.data["transfers"] += 1
        self.data["bytes_received"] += sum(bytes_by_path.values())
        _add_counts(self.data["bytes_by_path"], {p: n for p, n in bytes_by_path.items() if n})
        _add_counts(self.data["transfers_by_path"], {main_path(bytes_by_path): 1})
        self.data["transfer_seconds"].append(seconds)

    def record_path_fallback(self, configured: str, used: str) -> None:
        """A load that could not use the configured path (e.g. shm without an shm_path) used `used`."""
        _add_counts(self.data["path_fallbacks"], {metrics.label_key(configured, used): 1})

    def record_nixl_vram_fallback(self, reason: str) -> None:
        """A CUDA + nixl consumer rank that keeps the host path (nixl_device.REASONS), once at start-up."""
        _add_counts(self.data["nixl_vram_fallbacks"], {reason: 1})

    def record_failure(self, cause: str) -> None:
        _add_counts(self.data["failures"], {cause: 1})

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
        for k in _PER_KEY:
            _add_counts(self.data[k], other.data.get(k, {}))
        for k in _LISTS:
            self.data[k].extend(other.data.get(k, []))
        self.data.setdefault("errors", {}).update(other.data.get("errors", {}))
        theirs = other.data.get("store")
        if theirs:
            self.data["store"] = merge_store(self.data.get("store"), theirs)
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
        for path, n in sorted(self.data["bytes_by_path"].items()):
            out[f"MB via {path}"] = round(n / 1e6, 3)
        for fallback, n in sorted(self.data["path_fallbacks"].items()):
            out[f"Path fallbacks {fallback}"] = n
        for reason, n in sorted(self.data["nixl_vram_fallbacks"].items()):
            out[f"NIXL VRAM fallbacks ({reason})"] = n
        if self.data["pushes"] or self.data["push_fallbacks"]:
            out["Layer groups pushed"] = self.data["pushes"]
            out["MB pushed"] = round(self.data["bytes_pushed"] / 1e6, 3)
            out["Push fallbacks to pull"] = self.data["push_fallbacks"]
        for cause, n in sorted(self.data["failures"].items()):
            out[f"Failed: {cause}"] = n
        gauges = (self.data.get("store") or {}).get("gauges")
        if gauges:
            out["Store entries"] = gauges.get("entries", 0)
            out["Store DRAM MB"] = round(gauges.get("dram_bytes", 0) / 1e6, 3)
            out["Store NVMe MB"] = round(gauges.get("nvme_bytes", 0) / 1e6, 3)
        return out

    def is_empty(self) -> bool:
        return not (self.data["transfers"] or self.data["bytes_staged"] or self.data["failures"]
                    or self.data["pushes"] or self.data["push_fallbacks"] or self.data["path_fallbacks"]
                    or self.data["nixl_vram_fallbacks"]
                    or self.data.get("store"))

    def clone_and_reset(self) -> "TieredStats":
        out = TieredStats(data=self.data)
        self.data = _empty()
        return out
