"""`kvconnectors bench link`: its model, verdicts and report (the engine runs are the benchmark's)."""

from __future__ import annotations

import argparse

import pytest

from kvconnectors.benchmarks import link
from kvconnectors.planner import pipelined_s


def row(p: float, x: float, measured: dict[str, float], groups: int = 4) -> dict:
    return {"ratio": x / p, "rate_mbit": 100.0, "prefill_s": p, "transfer_s": x, "ttft_s": measured,
            "predicted_s": link.predictions(p, x, groups)}


def test_the_model_is_the_planners_pipeline() -> None:
    pred = link.predictions(1.0, 2.0, 4)
    assert pred["push-bulk"] == pred["pull"] == 3.0
    assert pred["push-layerwise"] == pipelined_s(1.0, 2.0, 0.25) == pytest.approx(2.25)
    assert link.layer_groups(8, 3) == 3


def test_verdicts_hold_layerwise_to_max_plus_a_group_and_bulk_to_the_sum() -> None:
    good = row(1.0, 2.0, {"push-layerwise": 2.4, "push-bulk": 3.1})
    assert all(v["met"] for v in link.verdicts([good], 4))
    slow = row(1.0, 2.0, {"push-layerwise": 3.0, "push-bulk": 4.5})  # bound 1.15*2 + 0.5 = 2.8; 4.5 > 3*1.25
    assert [v["met"] for v in link.verdicts([slow], 4)] == [False, False]
    text = link.render({"config": {"tokens": 10, "layers": 8, "groups": 4, "group": 2, "kv_bytes": 2**20,
                                   "reps": 1, "configs": ["push-bulk", "push-layerwise"]},
                        "prefill_s": 1.0, "rows": [slow], "verdicts": link.verdicts([slow], 4),
                        "errors": {"nixl": "boom"}})
    assert text.count("MISS") == 2 and "FAILED nixl: boom" in text


def test_bad_arguments_are_refused_naming_them() -> None:
    parser = argparse.ArgumentParser()
    link.add_arguments(parser)
    with pytest.raises(SystemExit, match="--configs"):
        link.run(parser.parse_args(["--configs", "pull,warp"]))
    with pytest.raises(SystemExit, match="--ratios"):
        link.run(parser.parse_args(["--ratios", "0"]))
