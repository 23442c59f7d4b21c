"""TieredConnector settings, read from `kv_connector_extra_config` and validated at start-up.

Every key, its default and what it does is listed in tiered/README.md. A
bad value fails engine start-up with an error naming the key and the value; unknown keys are
rejected too, because a typo silently ignored is a setting silently lost.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
from dataclasses import dataclass, field
from typing import Any

from kvconnectors.errors import ConfigError
from kvconnectors.store.sizes import parse_size

TRANSPORTS = ("tcp", "shm", "nixl")
TRANSFER_MODES = ("pull", "push")
FAILURE_POLICIES = ("fail", "recompute", "retry")


@dataclass
class TieredConfig:
    transport: str = "tcp"
    transfer_mode: str = "pull"         # pull | push; a request may choose with kv_transfer_params
    layer_group_size: int = 4           # push: layers per message, sent while later layers compute
    layerwise_min_tokens: int = 256     # push: shorter prompts go in one message after the last layer
    bind_host: str = "127.0.0.1"
    advertise_host: str | None = None
    store_port: int = 0
    lease_ttl_s: float = 30.0
    heartbeat_interval_s: float | None = None
    dram_bytes: int | str = "1g"
    nvme_dirs: list[str] = field(default_factory=list)
    nvme_bytes: int | str = 0
    load_timeout_s: float = 30.0
    connect_timeout_s: float = 5.0
    checksum: bool = True
    secret_file: str | None = None
    max_concurrent_loads: int = 4
    instance_name: str = "kvc"
    failure_policy: str | None = None   # fail | recompute | retry; None = vLLM's kv_load_failure_policy
    retries: int = 3                    # attempts after the first, for failure_policy "retry"
    retry_backoff_s: float = 0.1        # first back-off, doubled each attempt, bounded by load_timeout_s
    fault_injection: list[dict] | None = None  # tests and chaos runs only; see transport/faults.py
    test_hooks: bool = False            # tests only: honour per-request kvc_fault (transport/tamper.py)

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ConfigError("transport", self.transport, f"must be one of {', '.join(TRANSPORTS)}")
        if self.transfer_mode not in TRANSFER_MODES:
            raise ConfigError("transfer_mode", self.transfer_mode, f"must be one of {', '.join(TRANSFER_MODES)}")
        for key in ("layer_group_size", "layerwise_min_tokens"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < (1 if key == "layer_group_size" else 0):
                raise ConfigError(key, v, "must be an integer >= " + ("1" if key == "layer_group_size" else "0"))
        _host("bind_host", self.bind_host)
        if self.advertise_host is None:
            if self.bind_host in ("0.0.0.0", "::"):
                raise ConfigError("advertise_host", None, (
                    f"must be set when bind_host is the wildcard {self.bind_host!r}: consumers need an address "
                    "they can reach"))
            self.advertise_host = self.bind_host
        else:
            _host("advertise_host", self.advertise_host)
        if isinstance(self.store_port, bool) or not isinstance(self.store_port, int) \
                or not 0 <= self.store_port <= 65535:
            raise ConfigError("store_port", self.store_port, "must be an integer port in [0, 65535] (0 = any free)")
        for key in ("lease_ttl_s", "load_timeout_s", "connect_timeout_s"):
            setattr(self, key, _seconds(key, getattr(self, key)))
        if self.heartbeat_interval_s is None:
            self.heartbeat_interval_s = self.lease_ttl_s / 3
        self.heartbeat_interval_s = _seconds("heartbeat_interval_s", self.heartbeat_interval_s)
        if self.heartbeat_interval_s >= self.lease_ttl_s:
            raise ConfigError("heartbeat_interval_s", self.heartbeat_interval_s,
                              f"must be shorter than lease_ttl_s ({self.lease_ttl_s}), or leases lapse between beats")
        self.dram_bytes = _size("dram_bytes", self.dram_bytes)
        raw_nvme = self.nvme_bytes
        self.nvme_bytes = _size("nvme_bytes", self.nvme_bytes, allow_zero=True)
        if not isinstance(self.nvme_dirs, list) or not all(isinstance(d, str) and d for d in self.nvme_dirs):
            raise ConfigError("nvme_dirs", self.nvme_dirs, "must be a list of directory paths")
        if self.nvme_bytes and not self.nvme_dirs:
            raise ConfigError("nvme_bytes", raw_nvme, "is set but nvme_dirs is empty")
        for key in ("checksum", "test_hooks"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(key, getattr(self, key), "must be true or false")
        if isinstance(self.max_concurrent_loads, bool) or not isinstance(self.max_concurrent_loads, int) \
                or self.max_concurrent_loads < 1:
            raise ConfigError("max_concurrent_loads", self.max_concurrent_loads, "must be an integer >= 1")

        if self.failure_policy is not None and self.failure_policy not in FAILURE_POLICIES:
            raise ConfigError("failure_policy", self.failure_policy, f"must be one of {', '.join(FAILURE_POLICIES)}")
        if isinstance(self.retries, bool) or not isinstance(self.retries, int) or not 0 <= self.retries <= 10:
            raise ConfigError("retries", self.retries, "must be an integer in [0, 10]")
        self.retry_backoff_s = _seconds("retry_backoff_s", self.retry_backoff_s)
        from kvconnectors.transport.faults import FaultPlan

        self.fault_plan = FaultPlan.from_config(self.fault_injection)

    def check_engine_policy(self, engine_policy: str) -> None:
        """vLLM applies fail/recompute engine-wide (`kv_load_failure_policy`); ours must agree."""
        if self.failure_policy in ("fail", "recompute") and self.failure_policy != engine_policy:
            raise ConfigError("failure_policy", self.failure_policy, (
                f"differs from vLLM's kv_load_failure_policy={engine_policy!r}, which decides what a failed "
                f"load does; set kv_load_failure_policy to {self.failure_policy!r} (top level of "
                "--kv-transfer-config), or use failure_policy 'retry' to retry before it applies"))

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> "TieredConfig":
        extra = dict(extra or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ConfigError(unknown[0], extra[unknown[0]],
                              f"unknown TieredConnector setting; known settings: {', '.join(sorted(known))}")
        return cls(**extra)


def _host(key: str, value: Any) -> None:
    if not isinstance(value, str) or not value:
        raise ConfigError(key, value, "must be a host name or IP address")
    try:
        ipaddress.ip_address(value)
    except ValueError:
        if not all(part and part.replace("-", "").isalnum() for part in value.split(".")):
            raise ConfigError(key, value, "is neither an IP address nor a valid host name") from None


def _seconds(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(key, value, "must be a positive number of seconds")
    return float(value)


def _size(key: str, value: Any, allow_zero: bool = False) -> int:
    try:
        n = parse_size(value)
    except (ValueError, TypeError) as exc:
        raise ConfigError(key, value, f"is not a size ({exc}); use e.g. 1073741824, '8g' or '512MiB'") from None
    if n < 0 or (n == 0 and not allow_zero):
        raise ConfigError(key, value, "must be a positive size")
    return n
