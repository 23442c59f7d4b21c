"""Area "engine": real vLLM engines on CPU with the tiny model (every test is marked
`engine`: slow, serial, never in the default quick run).

Greedy output identity against a colocated run (no connector) is the correctness check; the
negative control corrupts the transferred KV and requires the output to change, proving the
identity check can fail at all. How engines are run is the backend's `run_pd` (one kv_both
engine by default; two sequential engines for ExampleConnector; two live servers for NIXL).
"""

from __future__ import annotations

from typing import Any

import pytest

from kvconnectors.conformance.engine_runs import colocated
from kvconnectors.conformance.harness import tiny_model_path
from kvconnectors.testing.compare import assert_same_tokens
from kvconnectors.testing.controls import control_failures
from kvconnectors.testing.prompts import token_prompts

ENGINE_TIMEOUT_S = 900


def require_engine_platform(backend: Any) -> None:
    """On the CPU platform an engine test needs `runs_on_cpu`."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu() and not backend.capabilities.runs_on_cpu:
        from kvconnectors.conformance.capabilities import skip_reason

        pytest.skip(skip_reason(backend.name, "runs_on_cpu"))


class EngineEndToEndTests:
    conformance_area = "engine"
    engine_max_tokens = 10

    def engine_prompts(self) -> list[list[int]]:
        bs = self.block_size
        # Under a block, exactly one, many: lengths of k*bs+1 are left to the worker-transfer
        # area (test_block_edge_prompt_is_found), so an xfail there does not mask this one.
        return token_prompts([bs // 2, bs, bs + 8, 3 * bs + 7, 5 * bs + 3, 8 * bs + 5], seed=31)

    @pytest.mark.engine
    @pytest.mark.timeout(ENGINE_TIMEOUT_S)
    def test_engine_greedy_identity(self) -> None:
        """P/D decode output equals the colocated run, token for token."""
        require_engine_platform(self)
        model, prompts = tiny_model_path(), self.engine_prompts()
        expected = colocated(model, prompts, self.engine_max_tokens)
        run = self.run_pd(model, prompts, self.engine_max_tokens, workdir=self.tmp_path)
        assert run.finish_reasons == ["length"] * len(prompts), (
            f"{self.name}: finish reasons {run.finish_reasons}, expected all 'length'; notes {run.notes}")
        assert_same_tokens(expected, run.token_ids, what=f"{self.name} P/D decode output")

    @pytest.mark.engine
    @pytest.mark.timeout(ENGINE_TIMEOUT_S)
    def test_engine_corrupted_transfer_changes_output(self) -> None:
        """Negative control: with the transferred KV corrupted (undetected), every request must
        complete normally (finish_reason 'length': a failed request is not 'output changed') and
        every prompt with at least one whole block before its last token (what any connector that
        moves whole blocks moves) must decode differently, or identity proves nothing.
        Seen to fail: with the backend's corruption hook disabled it reports the identical prompts."""
        require_engine_platform(self)
        model, prompts = tiny_model_path(), self.engine_prompts()
        expected = colocated(model, prompts, self.engine_max_tokens)
        run = self.run_pd(model, prompts, self.engine_max_tokens, fault="corrupt", workdir=self.tmp_path)
        moved = [i for i, p in enumerate(prompts) if len(p) - 1 >= self.block_size]
        problems = control_failures([expected[i] for i in moved], [run.token_ids[i] for i in moved],
                                    [run.finish_reasons[i] for i in moved], [len(prompts[i]) for i in moved])
        problems += [f"request {i} ({len(p)} prompt tokens) finished {r!r}, not 'length'"
                     for i, (p, r) in enumerate(zip(prompts, run.finish_reasons)) if i not in moved and r != "length"]
        assert not problems, f"{self.name}: corrupted KV: " + "; ".join(problems)
