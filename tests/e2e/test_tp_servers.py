"""Prefill and decode pools of different tensor parallelism (issue 20), on live `vllm serve`
instances: the tiny model has 2 KV heads, so a TP-2 instance holds one head per rank. Both pairs,
P TP 2 -> D TP 1 (pulls over shm) and P TP 1 -> D TP 2 (pulls over tcp), run in push mode, and
each is served both ways on the same servers:
- push (through the proxy): P2 -> D1, each producer rank pushes its head as a fragment the one
  consumer rank assembles; P1 -> D2, the producer rank packs each consumer rank's head into that
  rank's rows and pushes them to its landing store;
- pull (a pull ticket asked for by hand, no push_target): each consumer rank pulls the heads it
  owns from the producer ranks that hold them and assembles its blocks.

Three engine processes on two cores (a TP-2 instance is two workers) is the exception the issue
allows.

Each way: greedy identity with colocated over block-boundary prompts, then the negative control
(KV silently corrupted where the data path delivered it changes the tokens of requests that
complete normally), then nothing held on any rank; last, a producer rank killed while a sliced
read of it is held fails that request typed, naming the rank, the decode ranks hold nothing
and keep serving, and no producer rank holds the request (its store is gone with the instance,
or empty).
"""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvconnectors.errors import FailureCause, TransferError
from kvconnectors.integration.cluster import PDCluster
from kvconnectors.serving import complete, post_json, process_tree
from kvconnectors.store.arena import arena_names
from kvconnectors.transport.client import store_status
from kvconnectors.testing.compare import assert_same_tokens
from kvconnectors.testing.controls import assert_control_changed, control_lengths
from kvconnectors.testing.engines import generate_ids, llm_engine
from kvconnectors.testing.leaks import HELD_FIELDS, assert_pd_idle, cluster_stores
from kvconnectors.testing.metrics import by_label, failures_by_cause, total
from kvconnectors.testing.prompts import block_edge_lengths, token_prompts

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

BLOCK = 32
LENGTHS = block_edge_lengths(BLOCK) + [300]
MAX_TOKENS = 10
CONTROL_LENGTHS = control_lengths(BLOCK)
KILL_LENGTH = 600   # 19 blocks: the only prompt whose reads are held (HELD_MIN_BLOCKS), so a rank can be killed mid-read
HELD_MIN_BLOCKS = 15
KV = {"kv_connector_extra_config": {"test_hooks": True, "fault_injection": [
    {"action": "delay", "delay_s": 8, "min_blocks": HELD_MIN_BLOCKS}]}}
FORWARD_FAULT = ["--forward-kv-params", "kvc_fault", "--unlock-transfer-keys"]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return token_prompts(LENGTHS, seed=31)


@pytest.fixture(scope="module")
def control_prompts() -> list[list[int]]:
    return token_prompts(CONTROL_LENGTHS, seed=32)


@pytest.fixture(scope="module")
def colocated(tiny_model, prompts, control_prompts) -> list[list[int]]:
    with llm_engine(tiny_model) as llm:
        return generate_ids(llm, prompts + control_prompts, MAX_TOKENS)


def run(pd: PDCluster, prompts: list[list[int]], **extra) -> list[dict]:
    name = pd.prefill[0].served_model_name

    def one(p: list[int]) -> dict:
        return complete(pd.proxy_url, p, model=name, max_tokens=MAX_TOKENS, timeout=180, **extra)
    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(one, prompts))


def kill_rank(server, rank: int, tp: int) -> None:
    """SIGKILL the worker process of one TP rank of `server` (vLLM titles it VLLM::Worker_TP<rank>)."""
    title = f"Worker_TP{rank}" if tp > 1 else "Worker"
    workers = [p for p in process_tree(server.pid) if any(a.endswith(f"::{title}") for a in p.cmdline()[:1])]
    assert len(workers) == 1, [p.cmdline()[:1] for p in process_tree(server.pid)]
    os.kill(workers[0].pid, signal.SIGKILL)


def held_by_surviving(store, timeout: float) -> str:
    """What a prefill rank's store still holds after a rank of its instance was killed ("" when
    nothing: the store went down with the instance, or its entries were released), bounded wait.
    Only a refused connection counts as gone; any other failure to ask is retried, then reported."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            status = store_status(store.host, store.port, timeout_s=2, protection=store.protection)
        except TransferError as exc:
            if exc.cause is FailureCause.PEER_UNREACHABLE and "refused" in exc.detail.lower():
                return ""  # nothing listens: the instance went down with its killed rank
            held = {"status": str(exc)}
        else:
            held = {f: getattr(status, f) for f in HELD_FIELDS if getattr(status, f)}
            if not held:
                return ""
        if time.monotonic() > deadline:
            return f"{store.owner}'s store {store.host}:{store.port} still holds {held}"
        time.sleep(0.5)


def shm_arenas() -> list[str]:
    return arena_names()


def ids(resp: dict) -> list[int]:
    return list(resp["choices"][0]["token_ids"])


def pulled_by_hand(pd: PDCluster, prompt: list[int], fault: str = "") -> dict:
    """The prefill leg asked for a pull ticket (no push_target), then the decode leg with it;
    `fault`: the test hook's corruption for this transfer (kvc_fault)."""
    name = pd.prefill[0].served_model_name
    ticket = complete(pd.prefill[0].url, prompt, model=name, max_tokens=1, timeout=180, kv_transfer_params={
        "do_remote_decode": True, "do_remote_prefill": False, **({"kvc_fault": fault} if fault else {})}
    )["kv_transfer_params"]
    return post_json(f"{pd.decode[0].url}/v1/completions", {
        "model": name, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True,
        "return_token_ids": True, "kv_transfer_params": ticket}, timeout=180)


def pull_by_hand(pd: PDCluster, prompts: list[list[int]], fault: str = "") -> list[dict]:
    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(lambda p: pulled_by_hand(pd, p, fault), prompts))


def push_through_proxy(pd: PDCluster, prompts: list[list[int]], fault: str = "") -> list[dict]:
    return run(pd, prompts, **({"kv_transfer_params": {"kvc_fault": fault}} if fault else {}))


def served_equal_colocated(pd: PDCluster, leg, what: str, prompts, control_prompts, colocated) -> None:
    """Greedy identity over the prompts, then the corrupted control changes tokens, then nothing held."""
    assert_same_tokens(colocated[:len(prompts)], [ids(r) for r in leg(pd, prompts)], what)
    bad = leg(pd, control_prompts, "corrupt")
    assert_control_changed(colocated[len(prompts):], [ids(r) for r in bad],
                           [r["choices"][0]["finish_reason"] for r in bad], CONTROL_LENGTHS,
                           what=f"corrupted sliced transfers ({what})")
    assert_pd_idle(pd, timeout=30)


@pytest.mark.parametrize("prefill_tp, decode_tp, transport", [(2, 1, "shm"), (1, 2, "tcp")],
                         ids=["P2-D1-shm", "P1-D2-tcp"])
def test_pools_of_different_tp_equal_colocated_pushed_and_pulled(tiny_model, prompts, control_prompts, colocated,
                                                                 prefill_tp, decode_tp, transport, tmp_path) -> None:
    arenas = set(shm_arenas())
    n = len(prompts) + len(control_prompts)
    with PDCluster(tiny_model, transport=transport, kv_extra=KV, proxy_args=FORWARD_FAULT, log_dir=tmp_path,
                   prefill_tp=prefill_tp, decode_tp=decode_tp, mode="push") as pd:
        assert [p.tp for p in pd.plans] == [prefill_tp, decode_tp]
        pair = f"P TP {prefill_tp} -> D TP {decode_tp}"
        served_equal_colocated(pd, push_through_proxy, f"{pair}, push", prompts, control_prompts, colocated)
        d = pd.decode[0].metrics()
        assert set(by_label(d, "kvconnectors:transfer_bytes_total", "path")) == {"push_tcp"}, "another data path"
        # each consumer rank's landing store sealed every request's push of its heads: one push per
        # request, or one head fragment from each producer rank (P2 -> D1)
        landing = [st for st in cluster_stores(pd) if st.role == "decode"]
        assert len(landing) == decode_tp
        sealed = [store_status(st.host, st.port).counters["seals"] for st in landing]
        assert sealed == [n * max(1, prefill_tp // decode_tp)] * decode_tp, sealed

        served_equal_colocated(pd, pull_by_hand, f"{pair}, pull", prompts, control_prompts, colocated)
        d = pd.decode[0].metrics()
        assert total(d, "kvconnectors:transfer_failures_total") == 0
        assert total(d, "kvconnectors:transfers_total") >= 2 * n
        assert set(by_label(d, "kvconnectors:transfer_bytes_total", "path")) == {"push_tcp", transport}

        # the last producer rank killed while its read is held: typed, the rank named, nothing held
        # (the delay fault holds reads, not pushes: a pull ticket)
        rank = prefill_tp - 1
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(pull_by_hand, pd, token_prompts([KILL_LENGTH], seed=33))
            time.sleep(3.0)
            kill_rank(pd.prefill[0], rank, prefill_tp)
            with pytest.raises(Exception) as failed:
                fut.result(timeout=120)
        text = str(getattr(failed.value, "body", "")) + str(failed.value)
        assert "[peer_unreachable]" in text and f"producer rank {rank} of {prefill_tp}" in text, text
        assert_pd_idle(pd, producer_alive=False, timeout=30)
        # every other producer rank holds nothing either: gone with its instance, or released
        held = [h for st in cluster_stores(pd) if st.role == "prefill" for h in [held_by_surviving(st, 30)] if h]
        assert not held, held
        causes = failures_by_cause(pd.decode[0])  # each consumer rank counts its own failed load
        assert set(causes) == {"peer_unreachable"} and 1 <= causes["peer_unreachable"] <= decode_tp, causes
        served = complete(pd.decode[0].url, prompts[1], model=pd.decode[0].served_model_name, max_tokens=MAX_TOKENS)
        assert ids(served) == colocated[1], "the decode instance must keep serving"
    # the killed rank could not remove its shm arena (1 GiB of RAM): the cluster's stop reaps it
    assert set(shm_arenas()) <= arenas, set(shm_arenas()) - arenas
