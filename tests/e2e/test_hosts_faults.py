"""Network faults between emulated hosts (kvconnectors/testing/hosts.py), for each failure policy.

Prefill on host `pre`, decode on `dec`, requests from `cli`; the faults are real: the prefill's
link is unplugged (`ip link set down`) or throttled (tc tbf) while a pull is under way.
- the cable is pulled for a moment mid-transfer and plugged back: TCP carries on, the output is right;
- the rate collapses mid-transfer: the load deadline fires, typed `timeout`;
- the producer's host is unreachable for longer than the deadline: typed, and the pair serves again
  once the link is back;
- the decode host's processes are killed mid-transfer: the producer lets go by itself (lease; once,
  with recompute: the producer's side does not depend on the consumer's policy).
`fail` reports the cause to the client, `retry` tries again inside the deadline, `recompute`
answers correctly anyway. After each: nothing held on either side.
"""

from __future__ import annotations

import os
import secrets
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvconnectors.integration.cluster import PDCluster
from kvconnectors.serving import post_json
from kvconnectors.testing.engines import generate_ids, llm_engine
from kvconnectors.testing.hosts import Hosts
from kvconnectors.testing.leaks import assert_pd_idle
from kvconnectors.testing.metrics import failures_by_cause, total
from kvconnectors.testing.prompts import token_prompts

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

MAX_TOKENS = 4
PLACEMENT = {"prefill": "pre", "decode": "dec", "proxy": "cli"}
NIXL_STYLE = {"do_remote_decode": True, "do_remote_prefill": False}
LONG = 1800          # tokens: ~1.8 MB of the tiny model's KV, ~1.5 s over LINK
LINK = "10mbit"
COLLAPSED = "16kbit"
LOAD_TIMEOUT_S = 6


@pytest.fixture(scope="module")
def secret() -> bytes:
    return secrets.token_hex(32).encode()


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return token_prompts([LONG, 300, 120], seed=51)


@pytest.fixture(scope="module")
def colocated(tiny_model, prompts) -> list[list[int]]:
    with llm_engine(tiny_model) as llm:
        return generate_ids(llm, prompts, MAX_TOKENS)


def cluster(tiny_model, hosts, secret, policy: str, tmp_path) -> PDCluster:
    kv = {"kv_load_failure_policy": policy,
          "kv_connector_extra_config": {"lease_ttl_s": 6, "connect_timeout_s": 2, "load_timeout_s": LOAD_TIMEOUT_S,
                                        "retries": 1, "retry_backoff_s": 0.2}}
    pd = PDCluster(tiny_model, kv_extra=kv, log_dir=tmp_path, hosts=hosts, placement=PLACEMENT,
                   vllm_args="--max-model-len 2048")
    for s in pd.servers:
        s.env_overrides["KVCONNECTORS_SECRET"] = secret.decode()
    return pd


def body(pd: PDCluster, prompt: list[int], **extra) -> dict:
    return {"model": pd.prefill[0].served_model_name, "prompt": prompt, "max_tokens": MAX_TOKENS,
            "temperature": 0.0, "ignore_eos": True, "return_token_ids": True, **extra}


def ticket(pd: PDCluster, prompt: list[int]) -> dict:
    with pd.inside_client():
        r = post_json(f"{pd.prefill[0].url}/v1/completions", body(pd, prompt, max_tokens=1,
                                                                    kv_transfer_params=NIXL_STYLE))
    return r["kv_transfer_params"]


def decode(pd: PDCluster, prompt: list[int], t: dict, **params) -> list[int] | str:
    """The decode leg, from the client host: token ids, or the error text."""
    with pd.inside_client():
        try:
            r = post_json(f"{pd.decode[0].url}/v1/completions", body(pd, prompt, kv_transfer_params={**t, **params}),
                          timeout=60)
        except Exception as exc:  # vLLM's 500, read as an HTTPError
            return f"error: {exc} {getattr(exc, 'read', lambda: b'')().decode(errors='replace')}"
    return r["choices"][0]["token_ids"]


def during(fault, start_after_s: float, pd: PDCluster, prompt: list[int], t: dict, **params) -> list[int] | str:
    """Run the decode leg and apply `fault()` `start_after_s` into it (while the KV is moving)."""
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(decode, pd, prompt, t, **params)
        time.sleep(start_after_s)
        fault()
        return fut.result(timeout=120)


def failures(pd: PDCluster) -> dict[str, float]:
    with pd.inside_client():
        return dict(failures_by_cause(pd.decode[0]))


def idle(pd: PDCluster, secret: bytes, producer_alive: bool = True) -> None:
    with pd.inside_client():
        assert_pd_idle(pd, producer_alive=producer_alive, secret=secret, timeout=30)


def kill_decode_mid_transfer(pd: PDCluster, prompt: list[int], secret: bytes) -> None:
    """SIGKILL the decode's processes while it pulls `prompt`: the producer lets go by itself (lease)."""
    t = ticket(pd, prompt)
    out = during(lambda: os.killpg(os.getpgid(pd.decode[0].pid), signal.SIGKILL), 0.4, pd, prompt, t)
    assert isinstance(out, str), "the killed decode answered"
    time.sleep(7)  # lease_ttl_s=6 and nobody renews it
    with pd.inside_client():
        assert_pd_idle(pd, secret=secret, timeout=30, producer_alive=True, consumer_alive=False)


def flap(hosts: Hosts, seconds: float) -> None:
    hosts.link("pre", up=False)
    threading.Timer(seconds, hosts.link, args=("pre",), kwargs={"up": True}).start()


def test_fail_and_retry_policies_on_a_real_link(tiny_model, hosts, secret, prompts, colocated, tmp_path) -> None:
    long_prompt, short = prompts[0], prompts[2]
    with cluster(tiny_model, hosts, secret, "fail", tmp_path) as pd:
        hosts.shape("pre", egress=LINK)
        try:
            # 1. the cable is out for 1 s mid-transfer and back: TCP retransmits, the load completes
            for policy in ("fail", "retry"):
                out = during(lambda: flap(hosts, 1.0), 0.4, pd, long_prompt, ticket(pd, long_prompt),
                             failure_policy=policy)
                assert out == colocated[0], f"{policy}, after a 1 s link outage mid-transfer: {out}"
                time.sleep(1.0)  # the link is back
            # 2. the rate collapses mid-transfer: the deadline fires, typed; retry runs out of time too
            for policy in ("fail", "retry"):
                out = during(lambda: hosts.shape("pre", egress=COLLAPSED), 0.4, pd, long_prompt,
                             ticket(pd, long_prompt), failure_policy=policy)
                hosts.shape("pre", egress=LINK)
                # fail: the deadline; retry: its last attempt's cause (its connect may time out
                # behind the first attempt's queued bytes)
                causes = ("[timeout]",) if policy == "fail" else ("[timeout]", "[peer_unreachable]")
                assert isinstance(out, str) and any(c in out for c in causes), f"{policy}, rate collapsed: {out}"
            f = failures(pd)
            assert f.get("timeout", 0) >= 1 and sum(f.values()) == 2, f
            with pd.inside_client():
                retried = total(pd.decode[0].metrics(), "kvconnectors:transfer_retries_total")
            assert retried >= 1, "the retry policy did not retry"
            idle(pd, secret)
            # 3. the producer's host is unreachable for longer than the load deadline
            for policy in ("fail", "retry"):
                t = ticket(pd, short)
                hosts.link("pre", up=False)
                try:
                    out = decode(pd, short, t, failure_policy=policy)
                finally:
                    hosts.link("pre", up=True)
                assert isinstance(out, str) and ("[peer_unreachable]" in out or "[timeout]" in out), \
                    f"{policy}, producer unreachable: {out}"
            time.sleep(7)  # the two unreachable entries were never pulled: their leases end them
            idle(pd, secret)
            # ... and once the link is back the pair serves correctly again
            assert decode(pd, short, ticket(pd, short)) == colocated[2]
            idle(pd, secret)
            # (the decode host's processes dying mid-transfer: the recompute test below; what the
            # producer does then does not depend on the consumer's policy)
        finally:
            hosts.unshape("pre")


def test_recompute_answers_through_faults_and_a_killed_decode_leaks_nothing(tiny_model, hosts, secret, prompts,
                                                                         colocated, tmp_path) -> None:
    long_prompt, short = prompts[0], prompts[2]
    with cluster(tiny_model, hosts, secret, "recompute", tmp_path) as pd:
        hosts.shape("pre", egress=LINK)
        try:
            out = during(lambda: flap(hosts, 1.0), 0.4, pd, long_prompt, ticket(pd, long_prompt))
            assert out == colocated[0], f"recompute, after a 1 s link outage mid-transfer: {out}"
            time.sleep(1.0)  # the link is back
            out = during(lambda: hosts.shape("pre", egress=COLLAPSED), 0.4, pd, long_prompt, ticket(pd, long_prompt))
            hosts.shape("pre", egress=LINK)
            assert out == colocated[0], f"recompute after the rate collapsed: {out}"
            t = ticket(pd, short)
            hosts.link("pre", up=False)
            try:
                out = decode(pd, short, t)
            finally:
                hosts.link("pre", up=True)
            assert out == colocated[2], f"recompute with the producer unreachable: {out}"
            assert set(failures(pd)) <= {"timeout", "peer_unreachable"} and sum(failures(pd).values()) == 2
            time.sleep(7)  # the unreachable entry's lease ends it
            idle(pd, secret)
            kill_decode_mid_transfer(pd, long_prompt, secret)
        finally:
            hosts.unshape("pre")
