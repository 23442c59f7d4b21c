"""Leak checks for a live P/D cluster: no request, KV block, store entry, store byte (DRAM or
NVMe) or store connection left.

Which instances run a store (see integration/launcher.py plan_instances): every TieredConnector
prefill instance (its staging store, at the plan's kv_addr) and, in push mode only, every decode
instance (its landing store, at its kv_addr). Each is asked through its own status call, so NVMe
usage comes from the store's accounting (its extent files have no name to look for on disk).

Connections left open: connections are kept by design, and only so many. A decode worker keeps
the connections of pulls that went well for its next pulls (transport/client_pool.py: at most
MAX_IDLE_PER_PEER per producer store), so at rest it holds at most that many to a staging store,
and nobody else holds one. Push connections are pooled too (transport/push.py keeps one per
prefill worker and landing store; the decode's scheduler keeps one to its own landing store to
locate pushed KV), so at rest each such process holds at most one; more is a leak. And a store
must not count more connections than the cluster's processes hold (a server side nobody closed).
"""

from __future__ import annotations

import os
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import psutil

from kvconnectors.errors import KVConnectorError
from kvconnectors.serving import process_tree
from kvconnectors.transport import wire
from kvconnectors.transport.client import store_status
from kvconnectors.transport.client_pool import MAX_IDLE_PER_PEER

IDLE_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
HELD_FIELDS = ("entries", "pinned", "dram_used_bytes", "nvme_used_bytes")


@dataclass(frozen=True)
class Store:
    owner: str    # the instance running it (prefill-0, decode-1, ...)
    role: str     # prefill (staging store) | decode (landing store)
    host: str
    port: int
    protection: str = wire.HANDSHAKE  # the plan's wire_protection: a status call must speak it too


def pd_leaks(pd: Any, producer_alive: bool = True, secret: bytes | None = None,
             consumer_alive: bool = True) -> list[str]:
    """What is still held anywhere in a PDCluster (empty when clean). `pd` needs `servers` and
    `plans` (same order); with producer_alive=False the prefill instances are not asked, with
    consumer_alive=False the decode instances."""
    alive = [s for s, p in zip(pd.servers, pd.plans)
             if (producer_alive or p.role != "prefill") and (consumer_alive or p.role == "prefill")]
    # Connections and stores before /metrics: a scrape may ask its store's status (tiered/prom.py),
    # and that short-lived connection is no leak.
    held = {s.name: client_ports(s.pid) for s in alive}
    problems = []
    for store in cluster_stores(pd):
        if (store.role == "prefill" and not producer_alive) or (store.role != "prefill" and not consumer_alive):
            continue
        problems += client_problems(store, held)
        problems += store_problems(store, held_to(held, store.port), secret)
    return [msg for s in alive for msg in gauge_problems(s)] + problems


def gauge_problems(server: Any) -> list[str]:
    """A gauge missing from /metrics is a problem too: a check on nothing passes."""
    m = server.metrics()
    problems = []
    for name in IDLE_GAUGES:
        samples = m.get(name) or []
        if not samples:
            problems.append(f"{server.name}: {name} missing from /metrics")
        elif any(v for _, v in samples):
            problems.append(f"{server.name}: {name} = {sum(v for _, v in samples):g}, not 0")
    return problems


def cluster_stores(pd: Any) -> list[Store]:
    """Every store the cluster runs: staging stores of the prefill plans, landing stores of the
    decode plans in push mode (a pull-mode decode plan's kv_addr has nothing listening)."""
    stores = []
    for p in pd.plans:
        if not p.kv_addr or (p.role == "decode" and not is_push(p)):
            continue
        host, port = p.kv_addr.rsplit(":", 1)
        for rank in range(getattr(p, "tp", 1)):  # rank r of a TP instance listens on store_port + r
            stores.append(Store(p.name if rank == 0 else f"{p.name}/rank{rank}", p.role, host, int(port) + rank,
                                extra_config(p).get("wire_protection", wire.HANDSHAKE)))
    return stores


def extra_config(plan: Any) -> dict:
    return plan.kv_transfer_config.get("kv_connector_extra_config") or {}


def is_push(plan: Any) -> bool:
    return extra_config(plan).get("transfer_mode") == "push"


def client_ports(pid: int | None) -> dict[int, Counter]:
    """pid -> how many ESTABLISHED tcp connections it holds, by remote port, for `pid`'s tree."""
    out: dict[int, Counter] = {}
    if pid is None:  # never started: psutil.Process(None) would be this process
        return out
    for proc in process_tree(pid):
        try:
            out[proc.pid] = established_remote_ports(proc.pid)
        except OSError:
            continue
    return out


def established_remote_ports(pid: int) -> Counter:
    """Remote ports of `pid`'s ESTABLISHED tcp sockets, read from /proc/<pid>/net: the tables of the
    process's own network namespace. (psutil reads the caller's /proc/net, so from another
    namespace, an emulated host's, it sees none of them: the check would pass without looking.)"""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if link.startswith("socket:["):
            inodes.add(int(link[8:-1]))
    ports: Counter = Counter()
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            # sl local_address rem_address st ... inode (field 9); st 01 = ESTABLISHED
            fields = row.split()
            if len(fields) > 9 and fields[3] == "01" and int(fields[9]) in inodes:
                ports[int(fields[2].rsplit(":", 1)[1], 16)] += 1
    return ports


def held_to(held: dict[str, dict[int, Counter]], port: int) -> int:
    """Connections to `port` over the cluster's processes, each process counted once."""
    per_pid = {pid: ports[port] for procs in held.values() for pid, ports in procs.items()}
    return sum(per_pid.values())


def client_problems(store: Store, held: dict[str, dict[int, Counter]]) -> list[str]:
    """Connections to `store` beyond what an idle cluster keeps (see the module docstring)."""
    problems = []
    for name, procs in held.items():
        for pid, ports in procs.items():
            n, allowed = ports[store.port], idle_connections(store, name)
            if n > allowed:
                problems.append(f"{name} pid {pid} holds {n} connections to {store.owner}'s store "
                                f"{store.host}:{store.port} (at most {allowed} when idle)")
    return problems


def idle_connections(store: Store, holder: str) -> int:
    """How many connections one process of instance `holder` may keep to `store` at rest."""
    if store.role != "decode":
        # staging store: a decode worker's kept pull connections; renewals and releases close theirs
        return MAX_IDLE_PER_PEER if holder.startswith("decode") else 0
    if holder == store.owner.split("/")[0] or holder.startswith("prefill"):
        return 1          # the owner's locator; a prefill worker's pooled push connection
    return 0


def store_problems(store: Store, seen_clients: int, secret: bytes | None) -> list[str]:
    where = f"{store.owner}'s store {store.host}:{store.port}"
    try:
        st = store_status(store.host, store.port, secret=secret, protection=store.protection)
    except (KVConnectorError, OSError) as exc:
        return [f"{where}: status call failed: {exc}"]
    problems = [f"{where}: {field} = {getattr(st, field)}" for field in HELD_FIELDS if getattr(st, field)]
    if st.active_connections > seen_clients:
        problems.append(f"{where}: {st.active_connections} open connections, the cluster's processes hold "
                        f"{seen_clients}")
    return problems


def assert_pd_idle(pd: Any, producer_alive: bool = True, timeout: float = 20.0, secret: bytes | None = None,
                   consumer_alive: bool = True) -> None:
    """Wait (bounded) until nothing is held, else fail naming what is."""
    deadline = time.monotonic() + timeout
    while True:
        problems = pd_leaks(pd, producer_alive, secret, consumer_alive)
        if not problems:
            return
        if time.monotonic() > deadline:
            raise AssertionError("; ".join(problems))
        time.sleep(0.5)


def tree_rss(pid: int) -> int:
    total = 0
    for p in process_tree(pid):
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total
