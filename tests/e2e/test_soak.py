"""Soak: 1,000 requests through a live P/D pair with random transfer faults at a stated 6%.

Zero wrong outputs (every completed request equals colocated on all 16 tokens), every failed
request has a typed cause, nothing leaks, resident memory flat after warm-up. The numbers are
printed (and kept in the README).

Then the negative control of that "zero wrong outputs", on the same pair and data path: 100 more
requests, 40 of which ask for their KV to be silently corrupted where the pull delivers it (test
hooks, checksum skipped for those transfers). The same `wrong_outputs` judgement must name those
among the requests that completed normally, and only those, or it could not have seen a wrong
output in the soak either. (Seen to fail: with `wrong_outputs` returning [] its lower bound fails.)
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from collections.abc import Sequence

import pytest

from kvconnectors.integration.cluster import PDCluster
from kvconnectors.integration.workload import RequestResult, run_workload
from kvconnectors.testing.engines import generate_ids, llm_engine
from kvconnectors.testing.leaks import assert_pd_idle, tree_rss
from kvconnectors.testing.metrics import failures_by_cause
from kvconnectors.testing.prompts import token_prompts
from kvconnectors.tiered.config import TieredConfig

pytestmark = [pytest.mark.engine, pytest.mark.timeout(1200)]

REQUESTS, WARMUP, DISTINCT, MAX_TOKENS = 1000, 200, 50, 16
CONCURRENCY = 8  # requests in flight: a busy decode batches them, and the soak runs in less wall time
FAULTS = [{"action": "corrupt", "probability": 0.02}, {"action": "truncate", "probability": 0.01},
          {"action": "disconnect", "probability": 0.01}, {"action": "delay", "probability": 0.02, "delay_s": 0.3}]
# The soak's pair: the random faults, and the test hooks its control asks for per request.
KV = {"kv_connector_extra_config": {"fault_injection": FAULTS, "test_hooks": True}}
# The control: 100 distinct prompts of 70 to 299 tokens (2 to 9 full blocks of 32; no prefix
# cache, so each request pulls its KV in exactly one read); those with index % 5 in (0, 2) ask for
# their KV corrupted (kv_transfer_params kvc_fault, forwarded by the proxy).
SILENT_REQUESTS = 100
CORRUPTED = frozenset(i for i in range(SILENT_REQUESTS) if i % 5 in (0, 2))


@pytest.fixture(scope="module")
def prompts() -> dict[str, list[list[int]]]:
    return {"soak": token_prompts([40 + (i * 37) % 260 for i in range(DISTINCT)], seed=99),
            "silent": token_prompts([70 + (i * 29) % 230 for i in range(SILENT_REQUESTS)], seed=7)}


@pytest.fixture(scope="module")
def colocated(tiny_model, prompts) -> dict[str, list[list[int]]]:
    """Both phases' references from one engine."""
    with llm_engine(tiny_model) as llm:
        out = {phase: generate_ids(llm, ps, MAX_TOKENS) for phase, ps in prompts.items()}
    assert all(len(ids) == MAX_TOKENS for ids in out["soak"] + out["silent"]), "fewer tokens to compare"
    return out


@pytest.fixture(scope="module")
def pd(tiny_model, tmp_path_factory):
    """One pair for the soak and its control."""
    with PDCluster(tiny_model, kv_extra=KV, proxy_args=["--forward-kv-params", "kvc_fault", "--unlock-transfer-keys"],
                   log_dir=tmp_path_factory.mktemp("soak")) as cluster:
        yield cluster


def wrong_outputs(results: Sequence[RequestResult], expected: Sequence[list[int]]) -> list[int]:
    """Indices of the requests that ended without an error yet whose tokens differ from
    colocated's `expected[index]` (all MAX_TOKENS of them): the one judgement both phases use."""
    return [r.index for r in results if not r.error and r.token_ids != expected[r.index]]


def completed_normally(r: RequestResult) -> bool:
    """No error and every token asked for: with ignore_eos that is finish_reason "length"
    (run_workload's streamed results carry no finish_reason)."""
    return r.error is None and len(r.token_ids) == MAX_TOKENS


def planned_faults(kv_extra: dict, reads: int) -> Counter:
    """The faults the producer's plan picks for its first `reads` reads. Built as the connector
    builds it (TieredConfig, same seed); the plan draws only on events a rule is due on, so the
    renewals and releases in between do not change which reads it picks."""
    plan = TieredConfig.from_extra(kv_extra["kv_connector_extra_config"]).fault_plan
    assert plan is not None
    return Counter(r.action for r in (plan.decide("read") for _ in range(reads)) if r is not None)


def render(report: dict) -> str:
    """The soak's numbers as the README shows them (pasted from a saved run)."""
    causes = ", ".join(f"{c} {n}" for c, n in sorted(report["failures_by_cause"].items()))
    rss = [f"{name} {w} -> {e} MiB ({g:+.2%})" for name, w, e, g in
           zip(("prefill", "decode"), report["rss_mb_after_warmup"], report["rss_mb_end"], report["rss_growth"])]
    return "\n".join([
        f"requests {report['requests']}   completed {report['completed']}   failed {report['failed']} ({causes})   "
        f"wrong outputs {report['wrong_outputs']} ({report['tokens_compared_per_request']} tokens compared each)",
        "resident memory after warm-up -> end: " + ", ".join(rss),
        "no request, KV block, store entry, lease or store connection left on either side"])


def test_soak_with_random_faults(pd, prompts, colocated) -> None:
    requests = [prompts["soak"][i % DISTINCT] for i in range(REQUESTS)]
    expected = [colocated["soak"][i % DISTINCT] for i in range(REQUESTS)]
    name = pd.prefill[0].served_model_name
    warm = run_workload(pd.proxy_url, name, requests[:WARMUP], MAX_TOKENS, concurrency=CONCURRENCY, progress=False)
    rss_warm = [tree_rss(s.pid) for s in pd.servers]
    rest = run_workload(pd.proxy_url, name, requests[WARMUP:], MAX_TOKENS, concurrency=CONCURRENCY, progress=False)
    results = warm + [dataclasses.replace(r, index=r.index + WARMUP) for r in rest]
    assert_pd_idle(pd)
    rss_end = [tree_rss(s.pid) for s in pd.servers]
    causes = {c: int(n) for c, n in failures_by_cause(pd.decode[0]).items()}
    failed = [r for r in results if r.error]
    wrong = wrong_outputs(results, expected)
    growth = [(e - w) / w for w, e in zip(rss_warm, rss_end)]
    report = {"requests": REQUESTS, "tokens_compared_per_request": MAX_TOKENS,
              "completed": REQUESTS - len(failed), "failed": len(failed),
              "wrong_outputs": len(wrong), "failures_by_cause": causes,
              "faults_planned_for_the_first_reads": dict(planned_faults(KV, REQUESTS)),
              "rss_mb_after_warmup": [round(x / 2**20) for x in rss_warm],
              "rss_mb_end": [round(x / 2**20) for x in rss_end], "rss_growth": [round(g, 4) for g in growth]}
    print("SOAK " + json.dumps(report))
    print(render(report))
    assert not wrong, f"wrong outputs for requests {wrong[:10]}"
    assert failed, "no fault fired: the soak did not exercise failures"
    assert sum(causes.values()) == len(failed), f"{len(failed)} failed requests, typed causes {causes}"
    assert set(causes) <= {"checksum_mismatch", "peer_unreachable", "timeout"}, causes
    assert all(g < 0.05 for g in growth), f"resident memory grew after warm-up: {report}"


def test_the_soaks_judgement_sees_silent_corruption(pd, prompts, colocated) -> None:
    """On the soak's pair, after the soak: 40 of 100 requests have their KV silently corrupted on
    arrival (test hook; the checksum is skipped for exactly those transfers). `wrong_outputs` must
    report every corrupted request that completed normally, and no other. Tolerated: a corrupted
    request the plan's random faults failed (typed, like in the soak), and, seldom, one whose bytes
    the plan's own 2% corruption flipped back (same XOR; the skipped checksum cannot notice)."""
    name = pd.prefill[0].served_model_name
    marked = [i for i in range(SILENT_REQUESTS) if i in CORRUPTED]
    clean = [i for i in range(SILENT_REQUESTS) if i not in CORRUPTED]
    failures_before = failures_by_cause(pd.decode[0])
    results = []
    for ids, extra in ((marked, {"kv_transfer_params": {"kvc_fault": "corrupt"}}), (clean, None)):
        done = run_workload(pd.proxy_url, name, [prompts["silent"][i] for i in ids], MAX_TOKENS,
                            concurrency=CONCURRENCY, progress=False, extra_body=extra)
        results += [dataclasses.replace(r, index=ids[r.index]) for r in done]
    assert_pd_idle(pd)
    completed = {r.index for r in results if completed_normally(r)}
    failed = [(r.index, r.error) for r in results if r.error]
    wrong = set(wrong_outputs(results, colocated["silent"]))
    corrupted = CORRUPTED & completed
    print("\nSOAK_SILENT " + json.dumps({"requests": SILENT_REQUESTS, "corrupted_asked": len(CORRUPTED),
                                       "corrupted_completed": len(corrupted), "wrong_outputs": len(wrong),
                                       "failed": len(failed)}))
    print(f"silent-corruption control: {SILENT_REQUESTS} requests on the soak's pair, {len(CORRUPTED)} with their "
          f"KV corrupted unchecked, {len(failed)} failed (random faults), {len(wrong)} wrong outputs seen, "
          f"all of them corrupted requests")
    typed = failures_by_cause(pd.decode[0]) - failures_before
    assert typed.total() == len(failed), f"{len(failed)} failed requests, typed causes {dict(typed)}: {failed[:3]}"
    assert len(corrupted) >= 30, f"only {len(corrupted)} corrupted requests completed: too few for a control"
    assert wrong <= CORRUPTED, f"requests {sorted(wrong - CORRUPTED)} were not corrupted yet decoded wrongly"
    assert len(wrong) >= len(corrupted) - len(corrupted) // 10, (
        f"{len(corrupted)} corrupted requests completed normally, the judgement saw {len(wrong)} wrong outputs")
