"""P/D across hosts: prefill, decode and proxy+client each in their own network namespace (an
emulated host, kvconnectors/testing/hosts.py) on a private /24, the prefill's link shaped with tc
tbf. TieredConnector binds 0.0.0.0, advertises the host's address and runs with a shared secret;
tcp with wire_protection "aead" (every frame and KV byte sealed), nixl over UCX on the veth device,
not `lo`. Greedy output equals colocated, the KV crossed the prefill host's link, nothing is held
afterwards, and a negative control on the same servers changes tokens."""

from __future__ import annotations

import copy
import secrets
from pathlib import Path
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvconnectors.integration import launcher
from kvconnectors.integration.cluster import PDCluster, ProxyThread
from kvconnectors.serving import complete
from kvconnectors.testing.compare import assert_same_tokens
from kvconnectors.testing.controls import assert_control_changed, control_lengths
from kvconnectors.testing.engines import generate_ids, llm_engine
from kvconnectors.testing.leaks import assert_pd_idle
from kvconnectors.testing.prompts import block_edge_lengths, token_prompts
from kvconnectors.testing.metrics import total

pytestmark = [pytest.mark.engine, pytest.mark.timeout(1200)]

BLOCK = 32
LENGTHS = block_edge_lengths(BLOCK)[:8]
MAX_TOKENS = 8
CONTROL_LENGTHS = control_lengths(BLOCK)
PLACEMENT = {"prefill": "pre", "decode": "dec", "proxy": "cli"}
LINK = "400mbit"   # prefill -> anyone
FORWARD_FAULT = ["--forward-kv-params", "kvc_fault", "--unlock-transfer-keys"]


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


def run(pd: PDCluster, prompts: list[list[int]], url: str, **extra) -> list[dict]:
    name = pd.prefill[0].served_model_name
    with pd.inside_client(), ThreadPoolExecutor(4) as pool:  # the pool's threads start on the client host
        return list(pool.map(lambda p: complete(url, p, model=name, max_tokens=MAX_TOKENS, timeout=120, **extra),
                             prompts))


def tokens(outs: list[dict]) -> list[list[int]]:
    return [list(r["choices"][0]["token_ids"]) for r in outs]




def pull_proxy(pd: PDCluster) -> ProxyThread:
    """A second proxy, in pull mode, on the same servers: a push-mode instance serves a request that
    names no push target by pull (scheduler._push_target), so one pair proves both modes."""
    args = copy.copy(pd.args)
    args.mode, args.proxy_port = "pull", 0
    with pd.inside_client():
        return ProxyThread(launcher.proxy_config(pd.plans, args, FORWARD_FAULT)).start()


@pytest.mark.parametrize("transport", ["tcp", "nixl"])
def test_pd_across_hosts_equals_colocated(tiny_model, hosts, secret_file, prompts, colocated, transport,
                                          tmp_path) -> None:
    """Pull (through a pull-mode proxy) and push (the cluster's push-mode proxy) on one pair."""
    # aead is the mode across hosts; NIXL moves bytes outside our socket, so it cannot be sealed
    protection = {"tcp": {"wire_protection": "aead"}, "nixl": {}}[transport]
    kv = {"kv_connector_extra_config": {"secret_file": secret_file, "test_hooks": True, **protection}}
    clean, control = prompts[:len(LENGTHS)], prompts[len(LENGTHS):]
    hosts.shape("pre", egress=LINK)
    sent_before = hosts.tx_bytes("pre")
    with PDCluster(tiny_model, transport=transport, mode="push", kv_extra=kv, log_dir=tmp_path,
                   proxy_args=FORWARD_FAULT, hosts=hosts, placement=PLACEMENT) as pd:
        assert pd.prefill[0].host == hosts.address("pre") and pd.decode[0].host == hosts.address("dec")
        puller = pull_proxy(pd)
        try:
            for mode, url in (("pull", puller.url), ("push", pd.proxy_url)):
                assert_same_tokens(colocated[:len(clean)], tokens(run(pd, clean, url)), f"{transport} {mode}")
                bad = run(pd, control, url, kv_transfer_params={"kvc_fault": "corrupt"})
                assert_control_changed(colocated[len(clean):], tokens(bad),
                                       [r["choices"][0]["finish_reason"] for r in bad], CONTROL_LENGTHS,
                                       what=f"corrupted {transport} {mode} transfers across hosts")
        finally:
            with pd.inside_client():
                puller.stop()
        run(pd, clean[:1], pd.proxy_url)  # one more step reports the last interval's stats
        with hosts.inside("dec"):
            d = pd.decode[0].metrics()
        with hosts.inside("pre"):
            p = pd.prefill[0].metrics()
        with pd.inside_client():  # status calls speak the plan's wire protection: aead for tcp (a store
            # without it would refuse them), and the connection counts come from each host's own tables
            assert_pd_idle(pd, secret=Path(secret_file).read_text().strip().encode(), timeout=30)
    pulled = total(d, "kvconnectors:transfer_bytes_total")
    pushed = total(p, "kvconnectors:pushed_bytes_total")
    assert pulled > 0 and pushed > 0, f"pulled {pulled} B, pushed {pushed} B: both modes must have moved KV"
    crossed = hosts.tx_bytes("pre") - sent_before
    # pushed bytes land in the decode's store and count as its loads too: the larger is a lower bound
    moved = max(pulled, pushed)
    assert crossed >= moved, f"{crossed} B left the prefill host, fewer than the {moved:.0f} B of KV moved"
    assert total(p, "kvconnectors:store_entries") == 0, "the producer's store still holds entries"
