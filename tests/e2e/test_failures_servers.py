"""Failure scenarios between two live `vllm serve` instances (issue: explicit failure policy).

For each scenario: with `fail` the affected request ends with an error while concurrent
requests complete correctly; with `recompute` every output equals colocated; with `retry` (asked
per request, on the recompute pair) a transient fault heals. After each, nothing is left behind
on either side: no request, no KV block, no store entry (lease), no open store connection.
"""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvconnectors.integration.cluster import PDCluster
from kvconnectors.serving import post_json, read_metrics
from kvconnectors.testing.compare import assert_same_tokens
from kvconnectors.testing.engines import generate_ids, llm_engine
from kvconnectors.testing.prompts import token_prompts
from kvconnectors.errors import FailureCause, TransferError
from kvconnectors.testing.leaks import assert_pd_idle
from kvconnectors.testing.metrics import failures_by_cause, total
from kvconnectors.transport.client import store_status

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

MAX_TOKENS = 8
NIXL_STYLE = {"do_remote_decode": True, "do_remote_prefill": False}
RETRY_LENGTHS = [330, 350, 370, 390, 410, 340, 360, 420]
RETRY_MIN_BLOCKS = 10  # more than any of prompts[:8] has, fewer than any of RETRY_LENGTHS'


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    # prompts[8] is the only one over 14 blocks: the "producer killed" scenario slows its read.
    # prompts[9:] (10 to 13 blocks) are the retry phase's: only they reach its fault rules.
    return token_prompts([70, 100, 130, 200, 90, 160, 60, 250, 600] + RETRY_LENGTHS, seed=21)


@pytest.fixture(scope="module")
def colocated(tiny_model, prompts) -> list[list[int]]:
    with llm_engine(tiny_model) as llm:
        return generate_ids(llm, prompts, MAX_TOKENS)


def body(pd: PDCluster, prompt: list[int], **extra) -> dict:
    return {"model": pd.prefill[0].served_model_name, "prompt": prompt, "max_tokens": MAX_TOKENS,
            "temperature": 0.0, "ignore_eos": True, "return_token_ids": True, **extra}


def prefill_ticket(pd: PDCluster, prompt: list[int]) -> dict:
    r = post_json(f"{pd.prefill[0].url}/v1/completions", body(pd, prompt, max_tokens=1, kv_transfer_params=NIXL_STYLE))
    return r["kv_transfer_params"]


def decode(pd: PDCluster, prompt: list[int], ticket: dict) -> list[int] | str:
    """The decode leg by hand: token ids, or the error text."""
    try:
        r = post_json(f"{pd.decode[0].url}/v1/completions", body(pd, prompt, kv_transfer_params=ticket), timeout=60)
    except Exception as exc:  # urllib HTTPError for vLLM's 500
        return f"error: {exc}"
    return r["choices"][0]["token_ids"]


def through_proxy(pd: PDCluster, prompts: list[list[int]]) -> list[list[int] | str]:
    def one(p: list[int]) -> list[int] | str:
        try:
            return post_json(f"{pd.proxy_url}/v1/completions", body(pd, p), timeout=90)["choices"][0]["token_ids"]
        except Exception as exc:
            return f"error: {exc}"
    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(one, prompts))


def failures(server) -> dict[str, float]:
    return dict(failures_by_cause(server))


def assert_nothing_left(pd: PDCluster, producer_alive: bool = True) -> None:
    assert_pd_idle(pd, producer_alive)


def test_fail_policy_scenarios(tiny_model, prompts, colocated, tmp_path) -> None:
    kv = {"kv_load_failure_policy": "fail",
          "kv_connector_extra_config": {"lease_ttl_s": 4, "connect_timeout_s": 2, "load_timeout_s": 10,
                                        "fault_injection": [{"action": "corrupt", "nth": 3},
                                                            {"action": "truncate", "nth": 6},
                                                            {"action": "delay", "delay_s": 8, "min_blocks": 15}]}}
    with PDCluster(tiny_model, kv_extra=kv, log_dir=tmp_path) as pd:
        # corrupted bytes + truncated stream, under concurrent load: exactly those two fail
        outs = through_proxy(pd, prompts[:8])
        errors = [i for i, o in enumerate(outs) if isinstance(o, str)]
        assert len(errors) == 2, outs
        # the client's error says what failed, through the proxy too
        said = sorted(c for i in errors for c in ("checksum_mismatch", "peer_unreachable") if f"[{c}]" in outs[i])
        assert said == ["checksum_mismatch", "peer_unreachable"], [outs[i] for i in errors]
        # ... and as data: the proxy read each cause from the decode's error body field (kv_transfer_cause)
        reasons = {lab.get("reason"): v for lab, v in read_metrics(pd.proxy_url).get("kvproxy_decode_failures_total", [])}
        assert reasons.get("kv_checksum_mismatch") == 1 and reasons.get("kv_peer_unreachable") == 1, reasons
        ok = [i for i in range(8) if i not in errors]
        assert_same_tokens([colocated[i] for i in ok], [outs[i] for i in ok])
        assert failures(pd.decode[0]) == {"checksum_mismatch": 1.0, "peer_unreachable": 1.0}, failures(pd.decode[0])
        assert_nothing_left(pd)  # the consumer released the failed transfers' entries itself

        # malformed tickets, wrong layout and block size, lease expired: each fails alone
        tickets = [prefill_ticket(pd, p) for p in prompts[:6]]
        bad = [
            dict(tickets[0], kvc={k: v for k, v in tickets[0]["kvc"].items() if k != "addrs"}),  # missing field
            dict(tickets[1], kvc=dict(tickets[1]["kvc"], num_tokens="lots")),                    # wrong type
            dict(tickets[2], kvc=dict(tickets[2]["kvc"], num_tokens=2**40)),                     # huge number
            dict(tickets[3], kvc=dict(tickets[3]["kvc"], fingerprint="0123456789abcdef")),       # wrong layout
            dict(tickets[4], kvc=dict(tickets[4]["kvc"], block_size=16, num_blocks=-(-len(prompts[4]) // 16))),
        ]
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda a: decode(pd, *a), list(zip(prompts[:5], bad)) + [(prompts[5], tickets[5])]))
        assert all(isinstance(r, str) for r in results[:5]), results
        expected = ["bad_params"] * 3 + ["layout_mismatch"] * 2
        assert all(f"KV transfer failed [{c}]" in r for c, r in zip(expected, results)), results[:5]
        assert results[5] == colocated[5], "a good request next to bad ones must still be correct"
        f = failures(pd.decode[0])
        assert f.get("bad_params") == 3 and f.get("layout_mismatch") == 2, f
        ticket = prefill_ticket(pd, prompts[6])
        time.sleep(6)  # lease_ttl_s=4 and nobody renews it: expired
        expired = decode(pd, prompts[6], ticket)
        assert isinstance(expired, str) and "[lease_expired]" in expired, expired
        assert failures(pd.decode[0]).get("lease_expired") == 1
        time.sleep(5)  # the never-pulled entries of the bad tickets expire too
        assert_nothing_left(pd)

        # producer killed mid-transfer (its read is held for 8 s): the decode fails cleanly and
        # nothing is left on the decode side
        slow = prefill_ticket(pd, prompts[8])
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(decode, pd, prompts[8], slow)
            time.sleep(2.0)
            os.killpg(os.getpgid(pd.prefill[0].pid), signal.SIGKILL)
            killed = fut.result(timeout=60)
            assert isinstance(killed, str) and "[peer_unreachable]" in killed, killed
        assert failures(pd.decode[0]).get("peer_unreachable") == 2
        assert_nothing_left(pd, producer_alive=False)


def test_recompute_policy_equals_colocated_and_retry_heals_transient_faults(tiny_model, prompts, colocated,
                                                                            tmp_path) -> None:
    """One pair for two policies: recompute (the engine's, for every failed load) and retry (asked
    per request with kv_transfer_params failure_policy). Each phase has its own faults: the retry
    phase's rules fire only on its long prompts' reads (min_blocks), which none of the first phase has."""
    long = {"min_blocks": RETRY_MIN_BLOCKS}
    kv = {"kv_load_failure_policy": "recompute",
          "kv_connector_extra_config": {"retries": 2, "load_timeout_s": 12, "fault_injection": [
              {"action": "corrupt", "nth": 2}, {"action": "truncate", "nth": 4}, {"action": "disconnect", "nth": 6},
              {"action": "corrupt", "nth": 2, **long}, {"action": "disconnect", "nth": 4, **long},
              {"action": "drop", "nth": 6, **long}]}}
    with PDCluster(tiny_model, kv_extra=kv, log_dir=tmp_path) as pd:
        # recompute: failed loads are computed again, every output equals colocated
        outs = through_proxy(pd, prompts[:8])
        assert_same_tokens(colocated[:8], outs, "recompute after a failed transfer")
        assert sum(failures(pd.decode[0]).values()) == 3
        bad = prefill_ticket(pd, prompts[0])
        bad = dict(bad, kvc=dict(bad["kvc"], fingerprint="0123456789abcdef"))
        assert decode(pd, prompts[0], bad) == colocated[0]
        assert failures(pd.decode[0]).get("layout_mismatch") == 1
        assert_nothing_left(pd)  # failed transfers were released by the consumer, not left to expire

        # retry, per request: a corrupted, a cut and an unanswered read are each pulled again.
        # Three retries each: which request's read the nth rules hit depends on timing, and one
        # request may draw all three faults (with two it would fail, and recompute, after two).
        before = failures(pd.decode[0])
        retry = {"failure_policy": "retry", "retries": 3}
        with ThreadPoolExecutor(4) as pool:
            outs = list(pool.map(lambda p: decode(pd, p, {**prefill_ticket(pd, p), **retry}), prompts[9:]))
        assert_same_tokens(colocated[9:], outs, "a retried transfer")
        d = pd.decode[0].metrics()
        assert total(d, "kvconnectors:transfer_retries_total") == 3
        assert failures(pd.decode[0]) == before, "a retried transfer was counted as failed"
        assert_nothing_left(pd)


def test_wrong_secret_is_refused_typed_and_counted(tiny_model, prompts, tmp_path) -> None:
    """Prefill and decode hold different shared secrets (from the environment, never the command
    line): every pull is refused at the handshake, the client's error says `auth`, the producer
    counts the refusals, and the never-pulled entries end with their lease."""
    kv = {"kv_connector_extra_config": {"lease_ttl_s": 3, "connect_timeout_s": 2}}
    producer_secret = b"prefill-secret-0123456789"
    pd = PDCluster(tiny_model, kv_extra=kv, log_dir=tmp_path)
    pd.prefill[0].env_overrides["KVCONNECTORS_SECRET"] = producer_secret.decode()
    pd.decode[0].env_overrides["KVCONNECTORS_SECRET"] = "decode-secret-9876543210"
    with pd:
        outs = through_proxy(pd, prompts[:4])
        assert all(isinstance(o, str) and "[auth]" in o for o in outs), outs
        assert failures(pd.decode[0]) == {"auth": 4.0}, failures(pd.decode[0])
        host, port = pd.plans[0].kv_addr.rsplit(":", 1)
        status = store_status(host, int(port), secret=producer_secret)
        assert status.rejected.get("auth", 0) >= 4, status.rejected
        with pytest.raises(TransferError) as exc:  # and a peer without any secret is refused too
            store_status(host, int(port), secret=b"")
        assert exc.value.cause is FailureCause.AUTH
        time.sleep(4)  # lease_ttl_s=3: the refused consumers could not release, expiry does
        assert_pd_idle(pd, secret=producer_secret)
