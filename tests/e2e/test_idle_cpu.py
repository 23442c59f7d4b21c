"""An idle P/D pair with TieredConnector costs no more CPU than the same pair without one.

NIXL's UCX progress thread, as vLLM's NixlConnector runs it, busy-polls a core per engine even
when idle; our transports wait on sockets and events instead. Measured over 10 s of idleness,
after a few requests have gone through (so every lazy thread, agent and connection exists).
Every thread of both servers' process trees counts (kvconnectors.testing.cpu); a failure names the
busiest threads. tests/unit/test_cpu_measure.py shows the same measurement and assertion failing
on a process tree whose grandchild spins.
"""

from __future__ import annotations

import time

import pytest

from kvconnectors.integration.cluster import PDCluster
from kvconnectors.serving import VllmServer, complete, stop_all
from kvconnectors.testing import cpu

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]

IDLE_S = 10.0
TOLERANCE_CORES = 0.05


def idle_usage(servers: list[VllmServer], urls: list[str], model: str) -> cpu.CpuUsage:
    """CPU of every thread of the servers' process trees over IDLE_S, after warming every path."""
    for url in urls:
        for i in range(4):  # warm every path first
            complete(url, list(range(20, 20 + 40 * (i + 1))), model=model, max_tokens=4)
    time.sleep(2.0)  # let the last request's stragglers settle
    # The tree is listed again for the second snapshot: a helper process started while idle counts.
    return cpu.measure(lambda: cpu.tree_pids([s.pid for s in servers]), IDLE_S)


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
        usage = idle_usage(servers, [s.url for s in servers], servers[0].served_model_name)
        print(f"idle pair without a connector: {usage.describe()}")
        return usage.cores
    finally:
        stop_all(servers)


@pytest.mark.parametrize("transport", ["tcp", "nixl"])
def test_idle_pair_costs_no_extra_cpu(tiny_model, baseline_cores, transport, tmp_path) -> None:
    with PDCluster(tiny_model, transport=transport, log_dir=tmp_path) as pd:
        usage = idle_usage(pd.servers, [pd.proxy_url], pd.prefill[0].served_model_name)
    print(f"idle pair with TieredConnector ({transport}): {usage.describe()}")
    cpu.assert_cpu_at_most(usage, baseline_cores + TOLERANCE_CORES,
                           f"idle P/D pair with TieredConnector ({transport}), against {baseline_cores:.3f} "
                           f"cores for the same pair without a connector (allowed +{TOLERANCE_CORES}),")
