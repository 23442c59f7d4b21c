"""TieredConnector under Ray Serve LLM on a two-node Ray cluster: P and D on different machines.

The machines are emulated hosts (kvconnectors/testing/hosts.py: network namespaces on a bridge):
the Ray head on `pre`, a Ray worker node on `dec`, the client on `cli`. Each node offers a custom
resource naming its host, and the Serve config's bundles ask for it: the prefill replica and its
engine run on `pre`, the decode replica and its engine on `dec` (checked by the namespaces of their
processes), and the KV crosses the veth link between them (counted on `pre`'s device). Greedy output
through Ray's ingress equals colocated in pull mode (completions and chat, streamed and not), with a
corrupted control on the same app.
"""

from __future__ import annotations

import os
import secrets

import pytest

from kvconnectors.integration.workload import run_workload
from kvconnectors.testing.compare import assert_same_tokens
from kvconnectors.testing.controls import assert_control_changed, control_lengths
from kvconnectors.testing.hosts import NETNS_DIR
from kvconnectors.testing.prompts import block_edge_lengths, token_prompts
from kvconnectors.integration.ray.testapp import (MODEL, app_config, assert_backend_found, chat, colocated_outputs,
                                                 store_when_empty)
from kvconnectors.serving import complete
from kvconnectors.testing.raycluster import RayCluster, RayNode

pytestmark = [pytest.mark.engine, pytest.mark.timeout(1200)]

BLOCK = 32
LENGTHS = [*block_edge_lengths(BLOCK), 250, 600]
MAX_TOKENS = 8
CONTROL_LENGTHS = control_lengths(BLOCK)
HTTP_PORT = 8000        # Serve's default, on the head's address (each host has its own ports)
STORE_PORT = 17000      # the prefill's store, on `pre`
LEASE_TTL_S = 4


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return token_prompts(LENGTHS, seed=41)


@pytest.fixture(scope="module")
def control_prompts() -> list[list[int]]:
    return token_prompts(CONTROL_LENGTHS, seed=42)


@pytest.fixture(scope="module")
def colocated(tiny_model, prompts, control_prompts) -> dict:
    return colocated_outputs(tiny_model, prompts + control_prompts, MAX_TOKENS)


@pytest.fixture(scope="module")
def secret() -> str:
    return secrets.token_hex(32)


@pytest.fixture(scope="module")
def cluster(hosts, colocated, secret):
    c = RayCluster(env={"KVCONNECTORS_SECRET": secret})
    try:
        c.add_node(RayNode("pre", hosts.address("pre"), inside=lambda: hosts.inside("pre")), num_cpus=8,
                   resources={"host_pre": 1})
        c.add_node(RayNode("dec", hosts.address("dec"), inside=lambda: hosts.inside("dec")), num_cpus=2,
                   resources={"host_dec": 1})
        yield c
    finally:
        left = c.stop()
        assert not left, f"processes outlived `serve.shutdown()` and `ray stop`: {left}"
        assert not c.temp_dir.exists()


def netns_of(pid: int) -> int:
    return os.stat(f"/proc/{pid}/ns/net").st_ino


def test_prefill_on_one_node_decode_on_another_equal_colocated(cluster, hosts, tiny_model, prompts,
                                                               control_prompts, colocated, secret) -> None:
    pre = hosts.address("pre")
    url = f"http://{pre}:{HTTP_PORT}"
    cluster.serve_run(app_config(tiny_model, http_host="0.0.0.0", http_port=HTTP_PORT, prefill_store_port=STORE_PORT,
                                 lease_ttl_s=LEASE_TTL_S, prefill_resources={"host_pre": 0.01},
                                 decode_resources={"host_dec": 0.01}), "pd")
    cluster.wait_running("pd")
    cluster.wait_ready(url, MODEL)
    assert_backend_found(cluster)
    # where Ray put them: each replica and its engine processes in its host's namespace
    for deployment, host in (("Prefill:tiny", "pre"), ("Decode:tiny", "dec")):
        want = os.stat(NETNS_DIR / hosts.hosts[host].netns).st_ino
        replicas = cluster.replicas(deployment)
        assert len(replicas) == 1, f"{deployment}: {replicas}"
        tree = [replicas[0], *replicas[0].children(recursive=True)]
        engines = [p for p in tree if "EngineCore" in " ".join(p.cmdline())]
        assert engines, f"{deployment}: no vLLM engine process under the replica: {[p.cmdline() for p in tree]}"
        wrong = {p.pid: p.name() for p in tree if netns_of(p.pid) != want}
        assert not wrong, f"{deployment} processes outside host {host}: {wrong}"

    n = len(prompts)
    with hosts.inside("cli"):
        sent_before = hosts.tx_bytes("pre")
        staged_before = store_when_empty(pre, STORE_PORT, secret).counters
        streamed = run_workload(url, MODEL, prompts, MAX_TOKENS, concurrency=4, progress=False, timeout_s=120)
        plain = [complete(url, p, model=MODEL, max_tokens=MAX_TOKENS, timeout=120)["choices"][0]["token_ids"]
                 for p in prompts]
        answers = [chat(url, MAX_TOKENS, stream=False), chat(url, MAX_TOKENS, stream=True)]
        status = store_when_empty(pre, STORE_PORT, secret)
        sent = hosts.tx_bytes("pre") - sent_before
        bad = [complete(url, p, model=MODEL, max_tokens=MAX_TOKENS, timeout=120,
                        kv_transfer_params={"kvc_fault": "corrupt"})["choices"][0] for p in control_prompts]
        after_control = store_when_empty(pre, STORE_PORT, secret)
    assert not [r.error for r in streamed if r.error]
    assert_same_tokens(colocated["ids"][:n], [r.token_ids for r in streamed], "streamed, prefill and decode on two nodes")
    assert_same_tokens(colocated["ids"][:n], plain, "not streamed, two nodes")
    assert answers == [colocated["chat"]] * 2, answers
    assert_control_changed(colocated["ids"][n:], [c["token_ids"] for c in bad], [c["finish_reason"] for c in bad],
                           CONTROL_LENGTHS, what="corrupted pulls between two Ray nodes")
    # every staged byte was pulled by the decode (the outputs above say it loaded them): all of it
    # must have left the prefill's host over its link
    staged = sum(status.counters[k] - staged_before[k] for k in ("bytes_written_dram", "bytes_written_nvme"))
    assert staged > 0, status.counters
    assert sent >= staged, f"{sent} bytes left host pre, less than the {staged} bytes of KV staged there"
    for s in (status, after_control):
        assert s.entries == 0 and s.dram_used_bytes == 0, s
