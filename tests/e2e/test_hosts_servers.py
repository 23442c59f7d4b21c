"""P/D across hosts: prefill, decode and proxy+client each in their own network namespace (an
emulated host, kvconnectors/testing/hosts.py) on a private /24, the prefill's link shaped with tc
tbf. TieredConnector binds 0.0.0.0, advertises the host's address and runs with a shared secret;
nixl goes over UCX on the veth device, not `lo`. Greedy output equals colocated, the KV crossed
the prefill host's link, and a negative control on the same servers changes tokens."""

from __future__ import annotations

import secrets
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvconnectors.integration.cluster import PDCluster
from kvconnectors.serving import complete
from kvconnectors.testing.compare import assert_same_tokens
from kvconnectors.testing.controls import assert_control_changed, control_lengths
from kvconnectors.testing.engines import generate_ids, llm_engine
from kvconnectors.testing.prompts import block_edge_lengths, token_prompts

pytestmark = [pytest.mark.engine, pytest.mark.timeout(1200)]

BLOCK = 32
LENGTHS = block_edge_lengths(BLOCK)[:8]
MAX_TOKENS = 8
CONTROL_LENGTHS = control_lengths(BLOCK)
PLACEMENT = {"prefill": "pre", "decode": "dec", "proxy": "cli"}
LINK = "400mbit"   # prefill -> anyone


@pytest.fixture(scope="module")
def secret_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("secret") / "kv.secret"
    path.write_text(secrets.token_hex(32))
    path.chmod(0o600)
    return str(path)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return token_prompts(LENGTHS + CONTROL_LENGTHS, seed=41)


@pytest.fixture(scope="module")
def colocated(tiny_model: str, prompts: list[list[int]]) -> list[list[int]]:
    with llm_engine(tiny_model) as llm:
        return generate_ids(llm, prompts, MAX_TOKENS)


def run(pd: PDCluster, prompts: list[list[int]], **extra) -> list[dict]:
    name = pd.prefill[0].served_model_name
    with pd.inside_client(), ThreadPoolExecutor(4) as pool:  # the pool's threads start on the client host
        return list(pool.map(lambda p: complete(pd.proxy_url, p, model=name, max_tokens=MAX_TOKENS,
                                                timeout=120, **extra), prompts))


def tokens(outs: list[dict]) -> list[list[int]]:
    return [list(r["choices"][0]["token_ids"]) for r in outs]


def total(metrics: dict, name: str) -> float:
    return sum(v for _, v in metrics.get(name, []))


@pytest.mark.parametrize("transport, mode", [("tcp", "pull"), ("tcp", "push"), ("nixl", "pull"), ("nixl", "push")])
def test_pd_across_hosts_equals_colocated(tiny_model, hosts, secret_file, prompts, colocated, transport, mode,
                                          tmp_path) -> None:
    kv = {"kv_connector_extra_config": {"secret_file": secret_file, "test_hooks": True}}
    clean, control = prompts[:len(LENGTHS)], prompts[len(LENGTHS):]
    hosts.shape("pre", egress=LINK)
    sent_before = hosts.tx_bytes("pre")
    with PDCluster(tiny_model, transport=transport, mode=mode, kv_extra=kv, log_dir=tmp_path,
                   proxy_args=["--forward-kv-params", "kvc_fault"], hosts=hosts, placement=PLACEMENT) as pd:
        assert pd.prefill[0].host == hosts.address("pre") and pd.decode[0].host == hosts.address("dec")
        assert_same_tokens(colocated[:len(clean)], tokens(run(pd, clean)))
        bad = run(pd, control, kv_transfer_params={"kvc_fault": "corrupt"})
        assert_control_changed(colocated[len(clean):], tokens(bad), [r["choices"][0]["finish_reason"] for r in bad],
                               CONTROL_LENGTHS, what=f"corrupted {transport} {mode} transfers across hosts")
        run(pd, clean[:1])  # one more step reports the last interval's stats
        with hosts.inside("dec"):
            d = pd.decode[0].metrics()
        with hosts.inside("pre"):
            p = pd.prefill[0].metrics()
    # pulled (decode) or pushed (prefill) bytes: the KV that had to cross the prefill host's link
    moved = max(total(d, "kvconnectors:transfer_bytes_total"), total(p, "kvconnectors:pushed_bytes_total"))
    assert moved > 0, "no KV bytes were counted"
    crossed = hosts.tx_bytes("pre") - sent_before
    assert crossed >= moved, f"{crossed} B left the prefill host, fewer than the {moved:.0f} B of KV moved"
    assert total(p, "kvconnectors:store_entries") == 0, "the producer's store still holds entries"
