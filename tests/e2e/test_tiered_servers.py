"""TieredConnector between two live `vllm serve` processes (one per core) behind the P/D proxy.

First two plain servers (no connector), pinned one per core: they agree, their threads stay on
their cores, teardown leaves no process, and their idle CPU is the baseline for the P/D pairs
below. Each P/D pair, after its workload, must idle at no more CPU than that baseline: NIXL's UCX
progress thread, as vLLM's NixlConnector runs it, busy-polls a core per engine even when idle; our
transports wait on sockets and events instead. Every thread of both servers' process trees counts
(kvconnectors.testing.cpu); a failure names the busiest threads. tests/unit/test_cpu_measure.py
shows the same measurement and assertion failing on a process tree whose grandchild spins.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import psutil
import pytest

from kvconnectors.integration.cluster import PDCluster
from kvconnectors.serving import VllmServer, complete, process_tree, stop_all, tree_affinities
from kvconnectors.testing import cpu, process_state
from kvconnectors.transport.client import store_status
from kvconnectors.transport.client_pool import MAX_IDLE_PER_PEER
from kvconnectors.testing.compare import assert_same_tokens
from kvconnectors.testing.controls import assert_control_changed, control_lengths
from kvconnectors.testing.engines import generate_ids, llm_engine
from kvconnectors.testing.prompts import block_edge_lengths, token_prompts
from kvconnectors.testing.metrics import by_label, total

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

BLOCK = 32
LENGTHS = (block_edge_lengths(BLOCK) * 4)[:20]   # under a block, exactly a block, many blocks
MAX_TOKENS = 12
CONCURRENCY = 8
CONTROL_LENGTHS = control_lengths(BLOCK)
# Per-request corruption (test hooks) beside clean requests: the proxy passes kvc_fault on.
TEST_HOOKS = {"kv_connector_extra_config": {"test_hooks": True}}
FORWARD_FAULT = ["--forward-kv-params", "kvc_fault", "--unlock-transfer-keys"]
IDLE_S = 10.0
IDLE_TOLERANCE_CORES = 0.05


def idle_usage(servers: list[VllmServer]) -> cpu.CpuUsage:
    """CPU of every thread of the servers' process trees over IDLE_S (paths already warm)."""
    time.sleep(2.0)  # let the last request's stragglers settle
    # The tree is listed again for the second snapshot: a helper process started while idle counts.
    return cpu.measure(lambda: cpu.tree_pids([s.pid for s in servers]), IDLE_S)


def _leftovers(pids: list[int], pgids: list[int]) -> list[str]:
    """Live (non-zombie) processes among `pids` or in any of the process groups `pgids`."""
    out = []
    for p in psutil.process_iter(["pid", "status", "cmdline"]):
        try:
            if p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if p.pid in pids or os.getpgid(p.pid) in pgids:
                out.append(f"{p.pid} {' '.join(p.info['cmdline'] or [])[:120]}")
        except (psutil.NoSuchProcess, ProcessLookupError):
            continue
    return out


@dataclass(frozen=True)
class PlainPair:
    """What two plain servers, pinned one per core, showed: observed once, asserted by the tests."""
    outputs: list[list[int]]
    thread_counts: list[int]
    stray_threads: dict[str, dict[int, set[int]]]   # server -> {tid: cpus} of threads off its core
    running_after_stop: list[str]
    leftovers: list[str]
    idle: cpu.CpuUsage


@pytest.fixture(scope="module")
def plain_pair(tiny_model: str, tmp_path_factory) -> PlainPair:
    # The machine's cores, not this process's affinity (which something run in-process may narrow).
    cores = sorted(process_state.all_cores())
    if len(cores) < 2:
        pytest.skip("needs two cores to pin two servers apart")
    log_dir = tmp_path_factory.mktemp("plain")
    prompt = token_prompts([100], seed=3)[0]
    servers = [VllmServer(tiny_model, name=f"plain-{i}", served_model_name="tiny", core=cores[i],
                          log_path=log_dir / f"{i}.log", health_timeout=240) for i in range(2)]
    tree: list[int] = []
    try:
        for s in servers:  # launch both, then wait: the two starts overlap
            s.start(wait=False)
        for s in servers:
            s.wait_healthy()
        outputs = [s.greedy_token_ids(prompt, max_tokens=16, timeout=120) for s in servers]
        counts, stray = [], {}
        for s in servers:  # no repin() here: threads spawned by the request must be pinned already
            tree += [p.pid for p in process_tree(s.pid)]
            affinity = tree_affinities(s.pid)
            counts.append(len(affinity))
            stray[s.name] = {tid: cpus for tid, cpus in affinity.items() if cpus != {s.core}}
        for s in servers:  # warm every path before measuring idleness
            for i in range(4):
                complete(s.url, list(range(20, 20 + 40 * (i + 1))), model="tiny", max_tokens=4)
        idle = idle_usage(servers)
        print(f"idle pair without a connector: {idle.describe()}")
    finally:
        stop_all(servers, timeout=60)
    return PlainPair(outputs, counts, stray, [s.name for s in servers if s.is_running()],
                     _leftovers(tree, [s.pid for s in servers]), idle)


def test_two_pinned_plain_servers_agree_and_leave_nothing(plain_pair: PlainPair) -> None:
    assert all(n > 4 for n in plain_pair.thread_counts), plain_pair.thread_counts
    assert not any(plain_pair.stray_threads.values()), f"threads not pinned to their core: {plain_pair.stray_threads}"
    assert len(plain_pair.outputs[0]) == 16
    assert plain_pair.outputs[0] == plain_pair.outputs[1], plain_pair.outputs
    assert not plain_pair.running_after_stop, plain_pair.running_after_stop
    assert not plain_pair.leftovers, f"processes left after stop(): {plain_pair.leftovers}"


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return token_prompts(LENGTHS, seed=11)


@pytest.fixture(scope="module")
def control_prompts() -> list[list[int]]:
    return token_prompts(CONTROL_LENGTHS, seed=12)


@pytest.fixture(scope="module")
def colocated(tiny_model: str, prompts: list[list[int]], control_prompts: list[list[int]]) -> list[list[int]]:
    """Colocated outputs of `prompts`, then of `control_prompts`."""
    with llm_engine(tiny_model) as llm:
        return generate_ids(llm, prompts + control_prompts, MAX_TOKENS)


def run_workload(pd: PDCluster, model_name: str, prompts: list[list[int]], **extra) -> list[dict]:
    def one(p: list[int]) -> dict:
        return complete(pd.proxy_url, p, model=model_name, max_tokens=MAX_TOKENS, timeout=120, **extra)
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        return list(pool.map(one, prompts))




def token_ids(resp: dict) -> list[int]:
    return list(resp["choices"][0]["token_ids"])


def assert_instances_idle(pd: PDCluster) -> None:
    for server in pd.servers:
        m = server.metrics()
        for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
            values = [v for _, v in m.get(name, [])]
            assert values and all(v == 0 for v in values), f"{server.name}: {name} = {values} after the run"


def producer_store(pd: PDCluster):
    host, port = pd.plans[0].kv_addr.rsplit(":", 1)
    return store_status(host, int(port))


@pytest.mark.parametrize("transport, spill", [("tcp", True), ("shm", False), ("nixl", False)],
                         ids=["tcp-spilling", "shm", "nixl"])
def test_pd_servers_equal_colocated(tiny_model, prompts, control_prompts, colocated, plain_pair, transport, spill,
                                   tmp_path) -> None:
    """Identity over `transport` with every pulled byte carried by it (the decode's path-labelled
    metrics), then on the same servers a negative control: block-boundary prompts whose KV is
    silently corrupted where this path delivers it complete normally with other tokens; then the
    idle pair costs no more CPU than the plain pair.
    `spill`: a DRAM tier of 16 blocks for the whole workload, so the producer spills to NVMe and
    serves pulls from there, and Prometheus on each server's /metrics shows it (shm and nixl pull
    from DRAM, as tests/e2e/test_tiered_inprocess.py does for tcp).
    Seen to fail: with tamper.corrupt made a no-op the control reports 'decoded identically'."""
    extra: dict = {"test_hooks": True}
    if spill:
        extra.update(dram_bytes="256KiB", nvme_dirs=[str(tmp_path / "nvme")], nvme_bytes="64MiB",
                     nvme_create_dirs=True)
    with PDCluster(tiny_model, transport=transport, kv_extra={"kv_connector_extra_config": extra},
                   proxy_args=FORWARD_FAULT, log_dir=tmp_path / "logs") as pd:
        name = pd.prefill[0].served_model_name
        outs = run_workload(pd, name, prompts)
        assert_same_tokens(colocated[:len(prompts)], [token_ids(r) for r in outs])
        assert_instances_idle(pd)
        status = producer_store(pd)
        assert status.entries == 0 and status.dram_used_bytes == 0 and status.nvme_used_bytes == 0, \
            f"store not empty after release: {status}"
        assert status.counters["releases"] == len(prompts), status.counters
        # the decode's one worker keeps at most MAX_IDLE_PER_PEER for its next pulls (client_pool.py)
        assert status.active_connections <= MAX_IDLE_PER_PEER, \
            f"{status.active_connections} consumer connections left open"

        bad = run_workload(pd, name, control_prompts, kv_transfer_params={"kvc_fault": "corrupt"})
        assert_control_changed(colocated[len(prompts):], [token_ids(r) for r in bad],
                               [r["choices"][0]["finish_reason"] for r in bad], CONTROL_LENGTHS,
                               what=f"corrupted {transport} pulls between servers" + (" (KV spilled to NVMe)" if spill else ""))
        run_workload(pd, name, prompts[:1])  # one more step reports the last interval's stats
        d = pd.decode[0].metrics()
        # The idle producer's state gauges are read from its store at scrape time: zeros now
        # that every entry was released (a last-interval gauge would still show entries).
        assert_instances_idle(pd)
        p = pd.prefill[0].metrics()
        state = {k: sum(v for _, v in p.get(f"kvconnectors:store_{k}", [(None, -1)]))
                 for k in ("entries", "dram_bytes", "nvme_bytes", "pinned", "up")}
        assert state == {"entries": 0, "dram_bytes": 0, "nvme_bytes": 0, "pinned": 0, "up": 1}, state
        usage = idle_usage(pd.servers)
    print(f"idle pair with TieredConnector ({transport}): {usage.describe()}")
    cpu.assert_cpu_at_most(usage, plain_pair.idle.cores + IDLE_TOLERANCE_CORES,
                           f"idle P/D pair with TieredConnector ({transport}), against {plain_pair.idle.cores:.3f} "
                           f"cores for the same pair without a connector (allowed +{IDLE_TOLERANCE_CORES}),")
    moved = by_label(d, "kvconnectors:transfer_bytes_total", "path")
    assert set(moved) == {transport}, f"KV bytes by data path {moved}: expected every byte over {transport}"
    count = by_label(d, "kvconnectors:transfers_total", "path")
    assert count.get(transport, 0) >= len(prompts) + len(control_prompts), count
    assert not by_label(d, "kvconnectors:path_fallbacks_total", "used"), "a load fell back to another path"
    hits = [v for labels, v in d.get("vllm:prompt_tokens_cached_by_source_total", []) if labels.get("source") == "p2p"]
    assert hits and sum(hits) > 0, "decode did not attribute the loaded prompt tokens to p2p"
    assert total(p, "kvconnectors:staged_bytes_total") > 0
    spilled = total(p, "kvconnectors:store_spills_total"), total(p, "kvconnectors:store_hits_nvme_total")
    if spill:
        assert all(n > 0 for n in spilled), f"(spills, NVMe hits) = {spilled} with a 16-block DRAM tier"
    else:
        assert spilled == (0, 0), f"(spills, NVMe hits) = {spilled} with the default DRAM tier"
