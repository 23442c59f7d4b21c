"""TieredConnector under Ray Serve LLM on a local Ray cluster (issue: beyond one machine on Ray).

The cluster is started as a user starts one (`ray start --head --num-cpus 8`) and the app deployed by
`serve run` from integration/ray/serve_pd_cpu.yaml with only the model's path, the HTTP port, the
replica count, push mode, lease TTL and the test hooks changed. This process never imports Ray, so
nothing but the config's `import_path` registers our backend. Push mode with one prefill and two
decode replicas: greedy output through Ray's OpenAI ingress equals a colocated run (completions and
chat, streamed and not), with a corrupted control on the same app; both decode replicas land pushes;
a decode replica killed mid-run fails only requests on it. Pull mode, completions and chat, runs
across two Ray nodes in tests/e2e/test_ray_hosts.py.
"""

from __future__ import annotations

import secrets
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest

from kvconnectors.integration.workload import run_workload
from kvconnectors.serving import complete, free_port, free_port_block
from kvconnectors.testing.compare import assert_same_tokens
from kvconnectors.testing.controls import assert_control_changed, control_lengths
from kvconnectors.testing.prompts import block_edge_lengths, token_prompts
from kvconnectors.integration.ray.testapp import (MODEL, app_config, assert_backend_found, chat, colocated_outputs,
                                                 store_when_empty, token_ids)
from kvconnectors.testing.raycluster import RayCluster, RayNode

pytestmark = [pytest.mark.engine, pytest.mark.timeout(1500)]

BLOCK = 32
LENGTHS = [*block_edge_lengths(BLOCK), 100, 250, 400]
MAX_TOKENS = 8
CONTROL_LENGTHS = control_lengths(BLOCK)
LEASE_TTL_S = 4


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return token_prompts(LENGTHS, seed=31)


@pytest.fixture(scope="module")
def control_prompts() -> list[list[int]]:
    return token_prompts(CONTROL_LENGTHS, seed=32)


@pytest.fixture(scope="module")
def colocated(tiny_model, prompts, control_prompts) -> dict:
    return colocated_outputs(tiny_model, prompts + control_prompts, MAX_TOKENS)


@pytest.fixture(scope="module")
def secret() -> str:
    return secrets.token_hex(32)


@pytest.fixture(scope="module")
def http_port() -> int:
    """Serve's HTTP port for the module: Serve starts its proxies once, with the first app's
    http_options, and keeps them for every later deploy."""
    return free_port()


@pytest.fixture(scope="module")
def cluster(colocated, secret):
    c = RayCluster(env={"KVCONNECTORS_SECRET": secret}, gcs_port=free_port())
    try:
        c.add_node(RayNode("head"), num_cpus=8)  # Ray picks the address, as for most users
        yield c
    finally:
        left = c.stop()
        assert not left, f"processes outlived `serve.shutdown()` and `ray stop`: {left}"
        assert not c.temp_dir.exists()


def corrupted(url: str, prompts: list[list[int]], fault: str) -> list[dict]:
    """Completions whose KV the test hooks corrupt (`fault`), passed on by the decode's backend."""
    return [complete(url, p, model=MODEL, max_tokens=MAX_TOKENS, timeout=120,
                     kv_transfer_params={"kvc_fault": fault})["choices"][0] for p in prompts]


def test_push_one_prefill_two_decodes_and_a_decode_killed(cluster, http_port, tiny_model, prompts, control_prompts,
                                                          colocated, secret) -> None:
    """Push mode, one prefill and two decode replicas (three engines on two cores: tiny model, small
    KV): each decode replica names its own landing store (store_port base + its rank) in the prefill
    requests it sends, and both land pushes. Then one decode replica dies (its process tree, engine
    included) with requests in flight: only requests on it fail, the other keeps serving, and the
    prefill holds nothing once the leases end."""
    http, store, landing = http_port, free_port(), free_port_block(2)
    cluster.serve_run(app_config(tiny_model, http_host="127.0.0.1", http_port=http, prefill_store_port=store,
                                 lease_ttl_s=LEASE_TTL_S, push=True, decode_store_port=landing,
                                 decode_replicas=2), "push")
    url = f"http://127.0.0.1:{http}"
    cluster.wait_running("pd")
    cluster.wait_ready(url, MODEL)
    assert_backend_found(cluster)
    n = len(prompts)
    with ThreadPoolExecutor(4) as pool:
        plain = list(pool.map(lambda p: token_ids(url, p, MAX_TOKENS), prompts))
    assert_same_tokens(colocated["ids"][:n], plain, "non-streaming completions through Ray's ingress, push")
    streamed = run_workload(url, MODEL, prompts, MAX_TOKENS, concurrency=4, progress=False, timeout_s=120)
    assert not [r.error for r in streamed if r.error]
    assert_same_tokens(colocated["ids"][:n], [r.token_ids for r in streamed], "streamed completions, push")
    assert chat(url, MAX_TOKENS, stream=False) == colocated["chat"]
    assert chat(url, MAX_TOKENS, stream=True) == colocated["chat"]
    bad = corrupted(url, control_prompts, "corrupt_landed")
    assert_control_changed(colocated["ids"][n:], [c["token_ids"] for c in bad], [c["finish_reason"] for c in bad],
                           CONTROL_LENGTHS, what="landed pushes corrupted through Ray Serve LLM")
    for port in (landing, landing + 1):  # replica ranks 0 and 1
        landed = store_when_empty(cluster.nodes[0].ip, port, secret)
        assert landed.counters["seals"] > 0, f"the decode replica landing on {port} sealed no push: {landed.counters}"
        assert landed.entries == 0 and landed.dram_used_bytes == 0, landed
    staged = store_when_empty(cluster.nodes[0].ip, store, secret)
    assert staged.entries == 0 and staged.dram_used_bytes == 0, staged
    assert staged.counters["releases"] >= 2 * n + len(control_prompts) + 2, staged.counters

    deadline = time.monotonic() + 60  # the pull app's replicas may still be stopping
    while len(cluster.replicas("Decode:tiny")) != 2 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert len(cluster.replicas("Decode:tiny")) == 2, [p.cmdline() for p in cluster.replicas("Decode:tiny")]
    victim = cluster.replicas("Decode:tiny")[0]
    tree = [victim, *victim.children(recursive=True)]
    long_run = [list(range(40 + i, 140 + i)) for i in range(6)]
    t0 = time.monotonic()
    token_ids(url, long_run[0], 100)
    per_token = (time.monotonic() - t0) / 100  # one request alone, its P/D legs included
    # Each request runs ~8 s at that speed (six at once run slower), so all are still in flight at the
    # kill 3 s in on any host (400 fixed tokens once all finished before it on a fast one), and no
    # longer than that on a slow one: prompts of 100 + at most 1,900 tokens < the 2,048 context.
    long_tokens = max(200, min(1900, int(8.0 / per_token)))

    def one(p: list[int]) -> str:
        try:
            complete(url, p, model=MODEL, max_tokens=long_tokens, timeout=120)
            return "completed"
        except Exception as exc:  # the ingress's HTTP 500
            return f"error: {exc} {getattr(exc, 'read', lambda: b'')().decode(errors='replace')[:300]}"
    with ThreadPoolExecutor(len(long_run)) as pool:
        futures = [pool.submit(one, p) for p in long_run]
        time.sleep(3.0)
        for p in tree:
            try:
                p.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass
        outcomes = [f.result(timeout=150) for f in futures]
    print(f"outcomes with a decode replica killed ({long_tokens} tokens each):", outcomes)
    failed = [o for o in outcomes if o != "completed"]
    assert failed, f"no request was on the killed replica: {outcomes}"
    # the client's error names what died (Ray's words), not a hang or a bare 500
    assert all("actor died unexpectedly" in o and "ServeReplica:pd:Decode:tiny" in o for o in failed), failed
    assert len(failed) < len(long_run), f"every request failed, not only the killed replica's: {outcomes}"
    assert token_ids(url, prompts[0], MAX_TOKENS) == colocated["ids"][0], "the surviving decode stopped serving"
    time.sleep(LEASE_TTL_S + 1)  # what the dead replica never loaded ends with its lease
    staged = store_when_empty(cluster.nodes[0].ip, store, secret)
    assert staged.entries == 0 and staged.dram_used_bytes == 0, f"prefill holds KV after a decode died: {staged}"
    assert not [p.pid for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
