"""Where a replica's TieredConnector store listens and what it advertises, and whether it has the
shared secret: decided in the replica before its engine starts (no Ray import here, so the rules
are testable alone).

Rules (each applies only to keys the user left out of kv_connector_extra_config):
* bind_host = the node's IP (Ray's node address, which other nodes reach); a wildcard bind_host
  (any unspecified address, however spelled: transport/exposure.py) gets advertise_host = the
  node's IP. An explicit bind_host is kept as it is.
* A bind_host other hosts can reach (the node's IP, a wildcard: anything but loopback) needs the
  shared secret in the replica (KVCONNECTORS_SECRET in its environment, or a mounted secret_file);
  without one the replica is refused at start (`secret_source`), unless allow_insecure: true.
* store_port: 0 (the default) lets the kernel pick, and tickets carry the real port, so prefill
  replicas never collide. A decode replica in push mode must know its landing port before its
  engine binds it (the port goes into push_target): it takes a free block of tp ports from
  kvconnectors.serving.free_port_block. A store_port the user sets is a base: the replica adds
  Ray's per-replica offset (rank x tp x pp, as Ray does for NIXL's side-channel port).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from typing import Any

from kvconnectors.errors import ConfigError
from kvconnectors.logs import get_logger
from kvconnectors.transport.exposure import check_exposure, is_wildcard

logger = get_logger(__name__)

ROLES = ("kv_producer", "kv_consumer", "kv_both")
DEFAULT_BIND = "127.0.0.1"  # TieredConfig's bind_host default


@dataclasses.dataclass(frozen=True)
class StorePlan:
    updates: dict[str, Any]    # keys to set in kv_connector_extra_config
    push_target: str | None    # decode in push mode: its landing store (rank 0), "host:port"


def roles(kv_role: Any) -> tuple[bool, bool]:
    """(producer, consumer), as vLLM's KVTransferConfig reads kv_role."""
    if kv_role not in ROLES:
        raise ConfigError("kv_transfer_config.kv_role", kv_role, f"must be one of {', '.join(ROLES)} for P/D")
    return kv_role != "kv_consumer", kv_role != "kv_producer"


def plan(extra: Mapping[str, Any], *, kv_role: Any, node_ip: str, tp_size: int,
         port_offset: Callable[[], int], free_ports: Callable[[int, str], int]) -> StorePlan:
    """The store settings of one replica (see the module's rules). `port_offset` and `free_ports`
    are called only when needed (the offset needs a Serve replica context)."""
    producer, consumer = roles(kv_role)
    updates: dict[str, Any] = {}
    bind = extra.get("bind_host")
    if bind is None:
        bind = updates["bind_host"] = node_ip
    if extra.get("advertise_host") is None and is_wildcard(bind):
        updates["advertise_host"] = node_ip
    advertise = updates.get("advertise_host", extra.get("advertise_host") or bind)
    push = consumer and extra.get("transfer_mode") == "push"
    port = extra.get("store_port") or 0
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
        raise ConfigError("kv_connector_extra_config.store_port", port, "must be an integer port in [0, 65535]")
    if port:
        port += port_offset()
        if port + tp_size - 1 > 65535:
            raise ConfigError("kv_connector_extra_config.store_port", extra.get("store_port"), (
                f"plus this replica's offset ({port - extra['store_port']}) and tp {tp_size} passes 65535"))
        updates["store_port"] = port
    elif push:
        port = updates["store_port"] = free_ports(tp_size, bind)
    if not (producer or push):
        updates.pop("store_port", None)  # a pull-mode consumer runs no store server
    target = f"{advertise}:{port}" if push else None
    return StorePlan(updates, target)


def secret_source(extra: Mapping[str, Any], env: Mapping[str, str] = os.environ) -> str | None:
    """Where this replica's shared secret comes from ("secret_file PATH" or "env KVCONNECTORS_SECRET"),
    or None. Reads and checks it here, so a secret that did not reach the replica fails the replica
    at start with the field named, not the first transfer. No secret is fine only on a loopback
    bind_host; any other is refused (ConfigError) unless allow_insecure: true (then a warning)."""
    from kvconnectors.transport.auth import SECRET_ENV, load_secret  # noqa: PLC0415 - light, but not needed before

    path = extra.get("secret_file")
    if path:
        load_secret(path)  # ConfigError("secret_file", path, ...) when absent, unreadable, short or world-readable
        return f"secret_file {path}"
    if env.get(SECRET_ENV):
        load_secret(None, SECRET_ENV)
        return f"env {SECRET_ENV}"
    bind = extra.get("bind_host")
    check_exposure("kv_connector_extra_config.bind_host", DEFAULT_BIND if bind is None else bind, has_secret=False,
                   allow_insecure=extra.get("allow_insecure") is True,
                   secret_how=(f"{SECRET_ENV} in every replica's environment: the Ray nodes' environment or "
                               f"runtime_env env_vars, a Kubernetes secretKeyRef; or mount a secret_file"),
                   insecure_how="set allow_insecure: true in kv_connector_extra_config",
                   who="this replica's KV store server")
    return None
