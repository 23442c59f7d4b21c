"""TieredConnector between two live `vllm serve` processes (one per core) behind the P/D proxy."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from kvconnectors.integration.cluster import PDCluster
from kvconnectors.serving import complete
from kvconnectors.transport.client import store_status
from kvconnectors.testing.compare import assert_same_tokens
from kvconnectors.testing.controls import assert_control_changed, control_lengths
from kvconnectors.testing.engines import generate_ids, llm_engine
from kvconnectors.testing.prompts import block_edge_lengths, token_prompts

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

BLOCK = 32
LENGTHS = (block_edge_lengths(BLOCK) * 4)[:20]   # under a block, exactly a block, many blocks
MAX_TOKENS = 12
CONCURRENCY = 8
CONTROL_LENGTHS = control_lengths(BLOCK)
# Per-request corruption (test hooks) beside clean requests: the proxy passes kvc_fault on.
TEST_HOOKS = {"kv_connector_extra_config": {"test_hooks": True}}
FORWARD_FAULT = ["--forward-kv-params", "kvc_fault"]


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


def by_label(metrics: dict, name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for labels, v in metrics.get(name, []):
        out[labels.get(label, "")] = out.get(labels.get(label, ""), 0) + v
    return {k: v for k, v in out.items() if v}


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


@pytest.mark.parametrize("transport", ["tcp", "shm", "nixl"])
def test_pd_servers_equal_colocated(tiny_model, prompts, control_prompts, colocated, transport, tmp_path) -> None:
    """Identity over `transport` with every pulled byte carried by it (the decode's path-labelled
    metrics), then on the same servers a negative control: block-boundary prompts whose KV is
    silently corrupted where this path delivers it complete normally with other tokens.
    Seen to fail: with tamper.corrupt made a no-op the control reports 'decoded identically'."""
    with PDCluster(tiny_model, transport=transport, kv_extra=TEST_HOOKS, proxy_args=FORWARD_FAULT,
                   log_dir=tmp_path) as pd:
        name = pd.prefill[0].served_model_name
        outs = run_workload(pd, name, prompts)
        assert_same_tokens(colocated[:len(prompts)], [token_ids(r) for r in outs])
        assert_instances_idle(pd)
        status = producer_store(pd)
        assert status.entries == 0 and status.dram_used_bytes == 0, f"store not empty after release: {status}"
        assert status.counters["releases"] == len(prompts), status.counters
        assert status.active_connections == 0, f"{status.active_connections} consumer connections left open"

        bad = run_workload(pd, name, control_prompts, kv_transfer_params={"kvc_fault": "corrupt"})
        assert_control_changed(colocated[len(prompts):], [token_ids(r) for r in bad],
                               [r["choices"][0]["finish_reason"] for r in bad], CONTROL_LENGTHS,
                               what=f"corrupted {transport} pulls between servers")
        run_workload(pd, name, prompts[:1])  # one more step reports the last interval's stats
        d = pd.decode[0].metrics()
        # The idle producer's state gauges are read from its store at scrape time: zeros now
        # that every entry was released (a last-interval gauge would still show entries).
        assert_instances_idle(pd)
        p = pd.prefill[0].metrics()
        state = {k: sum(v for _, v in p.get(f"kvconnectors:store_{k}", [(None, -1)]))
                 for k in ("entries", "dram_bytes", "nvme_bytes", "pinned", "up")}
        assert state == {"entries": 0, "dram_bytes": 0, "nvme_bytes": 0, "pinned": 0, "up": 1}, state
    moved = by_label(d, "kvconnectors:transfer_bytes_total", "path")
    assert set(moved) == {transport}, f"KV bytes by data path {moved}: expected every byte over {transport}"
    count = by_label(d, "kvconnectors:transfers_total", "path")
    assert count.get(transport, 0) >= len(prompts) + len(control_prompts), count
    assert not by_label(d, "kvconnectors:path_fallbacks_total", "used"), "a load fell back to another path"


def test_spills_and_transfers_show_on_the_servers_metrics(tiny_model, prompts, control_prompts, colocated,
                                                          tmp_path) -> None:
    """A DRAM tier of 16 blocks for the whole workload: the producer spills to NVMe, the outputs
    still equal colocated, and Prometheus on each server's /metrics shows what happened."""
    kv = {"kv_connector_extra_config": {"dram_bytes": "256KiB", "nvme_dirs": [str(tmp_path / "nvme")],
                                        "nvme_bytes": "64MiB", "nvme_create_dirs": True, "test_hooks": True}}
    with PDCluster(tiny_model, transport="tcp", kv_extra=kv, log_dir=tmp_path / "logs",
                   proxy_args=FORWARD_FAULT) as pd:
        outs = run_workload(pd, pd.prefill[0].served_model_name, prompts)
        assert_same_tokens(colocated[:len(prompts)], [token_ids(r) for r in outs])
        bad = run_workload(pd, pd.prefill[0].served_model_name, control_prompts,
                           kv_transfer_params={"kvc_fault": "corrupt"})
        assert_control_changed(colocated[len(prompts):], [token_ids(r) for r in bad],
                               [r["choices"][0]["finish_reason"] for r in bad], CONTROL_LENGTHS,
                               what="corrupted pulls of KV spilled to NVMe")
        run_workload(pd, pd.prefill[0].served_model_name, prompts[:1])  # a step to report the last reads
        p, d = pd.prefill[0].metrics(), pd.decode[0].metrics()
    total = lambda m, name: sum(v for _, v in m.get(name, []))  # noqa: E731
    assert total(p, "kvconnectors:store_spills_total") > 0, sorted(k for k in p if k.startswith("kvconnectors"))
    assert total(p, "kvconnectors:staged_bytes_total") > 0
    assert total(p, "kvconnectors:store_hits_nvme_total") > 0
    assert total(d, "kvconnectors:transfer_bytes_total") > 0
    assert total(d, "kvconnectors:transfers_total") >= len(prompts)
    hits = [v for labels, v in d.get("vllm:prompt_tokens_cached_by_source_total", []) if labels.get("source") == "p2p"]
    assert hits and sum(hits) > 0, "decode did not attribute the loaded prompt tokens to p2p"
