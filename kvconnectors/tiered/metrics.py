"""TieredConnector's Prometheus metrics, each declared once: name, type, labels, help, and what feeds it.

stats.py builds each interval's `data` from the `key`s declared here; prom.py registers every metric
from this table and fills it from that `data` (or, for the state gauges, from the store servers at
scrape time). Three sources:

    interval   TieredStats.data[key]: an int (counter), a dict {label key: count} (labelled
               counter, see `label_key`), or a list of observations (histogram)
    store      TieredStats.data["store"]["deltas"][key]: the store's own counters, since the
               worker's last report (store/stats.py FIELDS)
    status     one rank's StatusReply field `key` (transport/wire.py), read at scrape time and
               summed over tensor-parallel ranks

Names keep the `kvconnectors:` prefix (tiered/README.md, Metrics): the package owns them, and
vLLM's `vllm:` namespace is vLLM's (an in-tree connector registering the same `vllm:` name would
fail the API server's start-up). Every metric also carries vLLM's `model_name` and `engine` labels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

PREFIX = "kvconnectors:"
Kind = Literal["counter", "histogram", "gauge"]
Source = Literal["interval", "store", "status"]
_SOURCES: dict[str, tuple[str, ...]] = {"interval": ("counter", "histogram"), "store": ("counter",),
                                        "status": ("gauge", "counter")}

# Data-path names, the `path` label of the transfer metrics: pulls over a socket, from the
# producer's shared-memory arena, by a NIXL READ into host KV blocks, by a NIXL READ straight into
# device (VRAM) KV blocks; and pushes that landed over a socket or by a NIXL WRITE in this decode's
# landing store (then loaded from there).
DATA_PATHS = ("tcp", "shm", "nixl", "nixl_vram", "push_tcp", "push_nixl")
NO_PATH = "none"  # transfers only: a load with nothing to move (every block already local)
LABEL_SEP = "->"  # between the label values of one dict key, for a counter with several labels

_PATHS_HELP = ", ".join(DATA_PATHS)
_SECONDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass(frozen=True)
class Metric:
    name: str                        # as registered (counters are exported with `_total`)
    kind: Kind
    help: str
    source: Source
    key: str                         # what feeds it, in `source` (module docstring); "" for STORE_UP
    labels: tuple[str, ...] = ()     # beyond vLLM's model_name and engine
    buckets: tuple[float, ...] = ()  # histograms only

    def __post_init__(self) -> None:
        if not self.name.startswith(PREFIX):
            raise ValueError(f"metric name {self.name!r} does not start with {PREFIX!r}")
        if self.kind not in _SOURCES.get(self.source, ()):
            raise ValueError(f"metric {self.name}: kind {self.kind!r} cannot come from source {self.source!r} "
                             f"(allowed: {_SOURCES.get(self.source)})")
        if (self.kind == "histogram") != bool(self.buckets):
            raise ValueError(f"metric {self.name}: buckets {self.buckets!r} given for kind {self.kind!r} "
                             "(histograms need them, other kinds take none)")
        if self.labels and (self.source, self.kind) != ("interval", "counter"):
            raise ValueError(f"metric {self.name}: labels {self.labels!r} are only for interval counters")


def _counter(name: str, key: str, help: str, labels: tuple[str, ...] = ()) -> Metric:
    return Metric(PREFIX + name, "counter", help, "interval", key, labels)


INTERVAL: tuple[Metric, ...] = (
    _counter("transfers", "transfers_by_path", "KV transfers completed into this (decode) instance, by the data "
             f"path that carried most of their bytes ({_PATHS_HELP}; none: nothing to move).", ("path",)),
    _counter("transfer_bytes", "bytes_by_path",
             f"KV bytes received by this (decode) instance, by data path ({_PATHS_HELP}).", ("path",)),
    _counter("path_fallbacks", "path_fallbacks", "KV loads that could not use the configured data path and used "
             "another (e.g. shm -> tcp for a producer without shared memory).", ("configured", "used")),
    _counter("nixl_vram_fallbacks", "nixl_vram_fallbacks", "Consumer ranks with a CUDA KV cache and transport nixl "
             "that do not READ into device memory (GPU-direct), counted once per rank at start-up, by reason "
             "(layout, checksum, agent, no_vram, registration); their loads take the host path.", ("reason",)),
    _counter("staged_bytes", "bytes_staged", "KV bytes staged into the host store (prefill side)."),
    Metric(PREFIX + "transfer_seconds", "histogram", "Duration of one request's KV pull, connect to last byte.",
           "interval", "transfer_seconds", buckets=_SECONDS),
    _counter("transfer_retries", "retries", "KV pulls retried after a transient fault (failure_policy retry)."),
    _counter("pushes", "pushes", "Transfers pushed to a decode instance's landing store (prefill side)."),
    _counter("pushed_bytes", "bytes_pushed", "KV bytes pushed to decode instances (prefill side)."),
    _counter("push_fallbacks", "push_fallbacks", "Pushed transfers that did not land, pulled instead (decode side)."),
    _counter("transfer_failures", "failures", "KV transfer and staging failures by cause.", ("cause",)),
)

STORE_COUNTERS: tuple[Metric, ...] = tuple(
    Metric(f"{PREFIX}store_{key}", "counter", f"Store: {doc}.", "store", key) for key, doc in (
        ("spills", "entries spilled from DRAM to NVMe"),
        ("spill_bytes", "bytes spilled from DRAM to NVMe"),
        ("restores", "entries restored from NVMe to DRAM"),
        ("restore_bytes", "bytes restored from NVMe to DRAM"),
        ("hits_dram", "reads served from DRAM"),
        ("hits_nvme", "reads served from NVMe"),
        ("renewals", "lease renewals"),
        ("releases", "explicit lease releases"),
        ("expiries", "leases that expired (consumer never came or died)"),
    ))

STATUS_GAUGES: tuple[Metric, ...] = tuple(
    Metric(f"{PREFIX}store_{name}", "gauge", f"Store: {doc} (read at scrape time, summed over tensor-parallel "
           "ranks).", "status", field) for name, field, doc in (
        ("entries", "entries", "transfers held in the store"),
        ("dram_bytes", "dram_used_bytes", "bytes held in the DRAM tier"),
        ("nvme_bytes", "nvme_used_bytes", "bytes held in the NVMe tier"),
        ("dram_capacity_bytes", "dram_capacity_bytes", "bytes the DRAM tier can hold (dram_bytes, whole slots): "
         "store_dram_bytes / this is how full it is"),
        ("nvme_capacity_bytes", "nvme_capacity_bytes", "bytes the NVMe tier can hold (nvme_bytes, whole slots; 0: "
         "no NVMe tier)"),
        ("pinned", "pinned", "entries pinned by a read in progress"),
        ("connections", "active_connections", "open connections to the store server (pulls, pushes, renewals)"),
        # deprecated (README, Naming): counts exported as gauges; the counters below replace them
        ("auth_failures", "auth_failures", "deprecated, use store_failed_handshakes_total: handshakes that failed "
         "the shared-secret proof since the server started"),
        ("integrity_failures", "integrity_failures", "deprecated, use store_failed_seals_total: sealed records that "
         "failed their integrity tag since the server started"),
    ))

# Counts the store servers keep since they started, read at scrape time like the gauges above and
# exported as counters (`_total`), so rate() and increase() apply and alerts read them as counts.
STATUS_COUNTERS: tuple[Metric, ...] = tuple(
    Metric(f"{PREFIX}store_{name}", "counter", f"Store: {doc} (read at scrape time, summed over tensor-parallel "
           "ranks).", "status", field) for name, field, doc in (
        ("failed_handshakes", "auth_failures", "handshakes that failed the shared-secret proof since the server "
         "started (logged at most once per 10 s)"),
        ("failed_seals", "integrity_failures", "sealed records (wire_protection aead) that failed their integrity "
         "tag since the server started; each closed its connection"),
    ))

# Not a field: whether every rank answered this scrape's status call.
STORE_UP = Metric(PREFIX + "store_up", "gauge", "1 if every tensor-parallel rank's store server answered this "
                  "scrape's status call, else 0.", "status", "")

STATUS: tuple[Metric, ...] = (*STATUS_GAUGES, *STATUS_COUNTERS)  # what the scrape-time collector exports
ALL: tuple[Metric, ...] = (*INTERVAL, *STORE_COUNTERS, *STATUS, STORE_UP)


def label_key(*values: str) -> str:
    """The dict key under which a labelled interval counter counts `values` (one per label)."""
    return LABEL_SEP.join(values)


def label_values(metric: Metric, key: str) -> tuple[str, ...]:
    """`label_key`'s inverse for `metric`: one value per label of it."""
    values = tuple(key.split(LABEL_SEP, len(metric.labels) - 1)) if len(metric.labels) > 1 else (key,)
    if len(values) != len(metric.labels):
        raise ValueError(f"metric {metric.name}: key {key!r} of data[{metric.key!r}] does not hold one value per "
                         f"label {metric.labels!r} (joined by {LABEL_SEP!r})")
    return values
