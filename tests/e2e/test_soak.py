"""Soak: 1,000 requests through a live P/D pair with random transfer faults at a few percent.

Zero wrong outputs (every completed request equals colocated), every failed request has a
typed cause, nothing leaks, resident memory flat after warm-up. The numbers are printed (and
kept in the README).
"""

from __future__ import annotations

import json

import pytest

from integration.cluster import PDCluster
from integration.workload import run_workload
from kvconnectors.testing.engines import generate_ids, llm_engine
from kvconnectors.testing.leaks import assert_pd_idle, tree_rss
from kvconnectors.testing.prompts import token_prompts

pytestmark = [pytest.mark.engine, pytest.mark.timeout(1200)]

REQUESTS, WARMUP, DISTINCT, MAX_TOKENS = 1000, 200, 50, 4
FAULTS = [{"action": "corrupt", "probability": 0.02}, {"action": "truncate", "probability": 0.01},
          {"action": "disconnect", "probability": 0.01}, {"action": "delay", "probability": 0.02, "delay_s": 0.3}]


def test_soak_with_random_faults(tiny_model, tmp_path) -> None:
    distinct = token_prompts([40 + (i * 37) % 260 for i in range(DISTINCT)], seed=99)
    with llm_engine(tiny_model) as llm:
        colocated = generate_ids(llm, distinct, MAX_TOKENS)
    prompts = [distinct[i % DISTINCT] for i in range(REQUESTS)]
    kv = {"kv_connector_extra_config": {"fault_injection": FAULTS}}
    with PDCluster(tiny_model, kv_extra=kv, log_dir=tmp_path) as pd:
        name = pd.prefill[0].served_model_name
        warm = run_workload(pd.proxy_url, name, prompts[:WARMUP], MAX_TOKENS, concurrency=4, progress=False)
        rss_warm = [tree_rss(s.pid) for s in pd.servers]
        rest = run_workload(pd.proxy_url, name, prompts[WARMUP:], MAX_TOKENS, concurrency=4, progress=False)
        results = warm + [r.__class__(**{**r.__dict__, "index": r.index + WARMUP}) for r in rest]
        assert_pd_idle(pd)
        rss_end = [tree_rss(s.pid) for s in pd.servers]
        d = pd.decode[0].metrics()
    causes = {labels["cause"]: int(v) for labels, v in d.get("kvconnectors:transfer_failures_total", [])}
    failed = [r for r in results if r.error]
    wrong = [r.index for r in results if not r.error and r.token_ids != colocated[r.index % DISTINCT]]
    growth = [(e - w) / w for w, e in zip(rss_warm, rss_end)]
    report = {"requests": REQUESTS, "completed": REQUESTS - len(failed), "failed": len(failed),
              "wrong_outputs": len(wrong), "failures_by_cause": causes,
              "rss_mb_after_warmup": [round(x / 2**20) for x in rss_warm],
              "rss_mb_end": [round(x / 2**20) for x in rss_end], "rss_growth": [round(g, 4) for g in growth]}
    print("SOAK " + json.dumps(report))
    assert not wrong, f"wrong outputs for requests {wrong[:10]}"
    assert failed, "no fault fired: the soak did not exercise failures"
    assert sum(causes.values()) == len(failed), f"{len(failed)} failed requests, typed causes {causes}"
    assert set(causes) <= {"checksum_mismatch", "peer_unreachable", "timeout"}, causes
    assert all(g < 0.05 for g in growth), f"resident memory grew after warm-up: {report}"
