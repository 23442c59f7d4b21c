"""Leak checks for a live P/D pair: no request, KV block, store entry or store connection left."""

from __future__ import annotations

import time
from typing import Any

import psutil

from kvconnectors.serving import process_tree
from kvconnectors.transport.client import store_status


def pd_leaks(pd: Any, producer_alive: bool = True, secret: bytes | None = None) -> list[str]:
    """What is still held on either side of a PDCluster (empty when clean)."""
    problems = []
    for s in (pd.servers if producer_alive else pd.decode):
        m = s.metrics()
        for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
            if any(v for _, v in m.get(name, [])):
                problems.append(f"{s.name}: {name} != 0")
    host, port = pd.plans[0].kv_addr.rsplit(":", 1)
    if producer_alive:
        st = store_status(host, int(port), secret=secret)
        if st.entries or st.dram_used_bytes or st.nvme_used_bytes or st.active_connections:
            problems.append(f"producer store: {st.entries} entries, {st.dram_used_bytes} DRAM bytes, "
                            f"{st.active_connections} connections")
    for d in pd.decode:
        for p in process_tree(d.pid):
            try:
                conns = [c for c in p.net_connections("tcp") if c.raddr and c.raddr.port == int(port)
                         and c.status == psutil.CONN_ESTABLISHED]
            except psutil.Error:
                continue
            if conns:
                problems.append(f"decode pid {p.pid} holds {len(conns)} connections to the producer's store")
    return problems


def assert_pd_idle(pd: Any, producer_alive: bool = True, timeout: float = 20.0, secret: bytes | None = None) -> None:
    """Wait (bounded) until nothing is held, else fail naming what is."""
    deadline = time.monotonic() + timeout
    while True:
        problems = pd_leaks(pd, producer_alive, secret)
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
