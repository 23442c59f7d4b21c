"""Soak: 1,000 requests through a live P/D pair with random transfer faults at a stated 6%.

Zero wrong outputs (every completed request equals colocated on all 16 tokens), every failed
request has a typed cause, nothing leaks, resident memory flat after warm-up. The numbers are
printed (and kept in the README).

Then the negative control of that "zero wrong outputs": a second pair with checksums off and
silent corruption on 40% of the reads. The same `wrong_outputs` judgement must find the
corrupted requests among requests that all completed normally, or it could not have seen a
wrong output in the soak either. (To see the control fail: make `wrong_outputs` return [] or
compare nothing but `r.error`, or set SILENT_FAULTS' probability to 0 -- its lower bound fails.
Not run where this was written: it needs engines.)
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence

import pytest

from kvconnectors.integration.cluster import PDCluster
from kvconnectors.integration.workload import RequestResult, run_workload
from kvconnectors.testing.engines import generate_ids, llm_engine
from kvconnectors.testing.leaks import assert_pd_idle, tree_rss
from kvconnectors.testing.prompts import token_prompts
from kvconnectors.tiered.config import TieredConfig

pytestmark = [pytest.mark.engine, pytest.mark.timeout(1200)]

REQUESTS, WARMUP, DISTINCT, MAX_TOKENS = 1000, 200, 50, 16
CONCURRENCY = 8  # requests in flight: a busy decode batches them, and the soak runs in less wall time
FAULTS = [{"action": "corrupt", "probability": 0.02}, {"action": "truncate", "probability": 0.01},
          {"action": "disconnect", "probability": 0.01}, {"action": "delay", "probability": 0.02, "delay_s": 0.3}]
# The control: 100 distinct prompts of 70 to 299 tokens (2 to 9 full blocks of 32; no prefix
# cache, so each request pulls its KV in exactly one read), 40% of the reads corrupted (the
# seeded plan picks 25 of the first 100), no checksum to notice it.
SILENT_REQUESTS = 100
SILENT_FAULTS = [{"action": "corrupt", "probability": 0.4}]
SILENT_KV = {"kv_connector_extra_config": {"checksum": False, "fault_injection": SILENT_FAULTS}}


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


def test_soak_with_random_faults(tiny_model, prompts, colocated, tmp_path) -> None:
    requests = [prompts["soak"][i % DISTINCT] for i in range(REQUESTS)]
    expected = [colocated["soak"][i % DISTINCT] for i in range(REQUESTS)]
    kv = {"kv_connector_extra_config": {"fault_injection": FAULTS}}
    with PDCluster(tiny_model, kv_extra=kv, log_dir=tmp_path) as pd:
        name = pd.prefill[0].served_model_name
        warm = run_workload(pd.proxy_url, name, requests[:WARMUP], MAX_TOKENS, concurrency=CONCURRENCY, progress=False)
        rss_warm = [tree_rss(s.pid) for s in pd.servers]
        rest = run_workload(pd.proxy_url, name, requests[WARMUP:], MAX_TOKENS, concurrency=CONCURRENCY, progress=False)
        results = warm + [r.__class__(**{**r.__dict__, "index": r.index + WARMUP}) for r in rest]
        assert_pd_idle(pd)
        rss_end = [tree_rss(s.pid) for s in pd.servers]
        d = pd.decode[0].metrics()
    causes = {labels["cause"]: int(v) for labels, v in d.get("kvconnectors:transfer_failures_total", [])}
    failed = [r for r in results if r.error]
    wrong = wrong_outputs(results, expected)
    growth = [(e - w) / w for w, e in zip(rss_warm, rss_end)]
    report = {"requests": REQUESTS, "tokens_compared_per_request": MAX_TOKENS,
              "completed": REQUESTS - len(failed), "failed": len(failed),
              "wrong_outputs": len(wrong), "failures_by_cause": causes,
              "faults_planned_for_the_first_reads": dict(planned_faults(kv, REQUESTS)),
              "rss_mb_after_warmup": [round(x / 2**20) for x in rss_warm],
              "rss_mb_end": [round(x / 2**20) for x in rss_end], "rss_growth": [round(g, 4) for g in growth]}
    print("SOAK " + json.dumps(report))
    print(render(report))
    assert not wrong, f"wrong outputs for requests {wrong[:10]}"
    assert failed, "no fault fired: the soak did not exercise failures"
    assert sum(causes.values()) == len(failed), f"{len(failed)} failed requests, typed causes {causes}"
    assert set(causes) <= {"checksum_mismatch", "peer_unreachable", "timeout"}, causes
    assert all(g < 0.05 for g in growth), f"resident memory grew after warm-up: {report}"


def test_the_soaks_judgement_sees_silent_corruption(tiny_model, prompts, colocated, tmp_path) -> None:
    """Checksums off, 40% of the reads corrupted: every request completes normally, and
    `wrong_outputs` reports (nearly) every corrupted one. The corrupted reads are known by count
    only (the plan is seeded; which request gets which read depends on timing), so the bound is
    on the count: at least 90% of them (a corrupted block could, rarely, leave 16 tokens as they
    were)."""
    with PDCluster(tiny_model, kv_extra=SILENT_KV, log_dir=tmp_path) as pd:
        results = run_workload(pd.proxy_url, pd.prefill[0].served_model_name, prompts["silent"], MAX_TOKENS,
                               concurrency=CONCURRENCY, progress=False)
        assert_pd_idle(pd)
    corrupted = planned_faults(SILENT_KV, SILENT_REQUESTS)["corrupt"]
    abnormal = [(r.index, r.error, len(r.token_ids)) for r in results if not completed_normally(r)]
    wrong = wrong_outputs(results, colocated["silent"])
    print("SOAK_SILENT " + json.dumps({"requests": SILENT_REQUESTS, "corrupted_reads": corrupted,
                                       "wrong_outputs": len(wrong), "abnormal": len(abnormal)}))
    print(f"silent-corruption control: {SILENT_REQUESTS} requests, checksums off, {corrupted} reads corrupted, "
          f"{len(abnormal)} failed, {len(wrong)} wrong outputs seen")
    assert corrupted >= 10, f"the seeded plan corrupts only {corrupted} reads: too few for a control"
    assert not abnormal, f"with checksums off nothing may fail: {abnormal[:5]}"
    assert len(wrong) >= corrupted - corrupted // 10, (
        f"{corrupted} reads were corrupted, the harness saw {len(wrong)} wrong outputs")
