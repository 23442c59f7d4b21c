"""An idle P/D pair with TieredConnector costs no more CPU than the same pair without one.

NIXL's UCX progress thread, as vLLM's NixlConnector runs it, busy-polls a core per engine even
when idle; our transports wait on sockets and events instead. Measured over 10 s of idleness,
after a few requests have gone through (so every lazy thread, agent and connection exists).
"""

from __future__ import annotations

import time

import pytest

from integration.cluster import PDCluster
from kvconnectors.serving import VllmServer, complete, process_tree, stop_all

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]

IDLE_S = 10.0
TOLERANCE_CORES = 0.05


def tree_cpu_seconds(servers: list[VllmServer]) -> float:
    total = 0.0
    for s in servers:
        for p in process_tree(s.pid):
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except Exception:  # a helper process that just exited
                pass
    return total


def idle_cores(servers: list[VllmServer], urls: list[str], model: str) -> float:
    for url in urls:
        for i in range(4):  # warm every path first
            complete(url, list(range(20, 20 + 40 * (i + 1))), model=model, max_tokens=4)
    time.sleep(2.0)  # let the last request's stragglers settle
    before, t0 = tree_cpu_seconds(servers), time.monotonic()
    time.sleep(IDLE_S)
    return (tree_cpu_seconds(servers) - before) / (time.monotonic() - t0)


@pytest.fixture(scope="module")
def baseline_cores(tiny_model: str, tmp_path_factory) -> float:
    log_dir = tmp_path_factory.mktemp("plain")
    servers = [VllmServer(tiny_model, name=f"plain-{i}", core=i % 2, log_path=log_dir / f"{i}.log")
               for i in range(2)]
    try:
        for s in servers:
            s.start(wait=False)
        for s in servers:
            s.wait_healthy()
        cores = idle_cores(servers, [s.url for s in servers], servers[0].served_model_name)
        print(f"idle pair without a connector: {cores:.3f} cores")
        return cores
    finally:
        stop_all(servers)


@pytest.mark.parametrize("transport", ["tcp", "nixl"])
def test_idle_pair_costs_no_extra_cpu(tiny_model, baseline_cores, transport, tmp_path) -> None:
    with PDCluster(tiny_model, transport=transport, log_dir=tmp_path) as pd:
        cores = idle_cores(pd.servers, [pd.proxy_url], pd.prefill[0].served_model_name)
    print(f"idle pair with TieredConnector ({transport}): {cores:.3f} cores")
    assert cores <= baseline_cores + TOLERANCE_CORES, (
        f"idle P/D pair with TieredConnector ({transport}) used {cores:.3f} cores, the same pair "
        f"without a connector {baseline_cores:.3f} (allowed +{TOLERANCE_CORES})")
