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
from kvconnectors.testing.compare import assert_same_tokens, first_mismatch
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
        """Negative control: with the transferred KV corrupted (undetected), every prompt of
        more than two blocks must decode differently, or identity proves nothing."""
        require_engine_platform(self)
        model, prompts = tiny_model_path(), self.engine_prompts()
        expected = colocated(model, prompts, self.engine_max_tokens)
        run = self.run_pd(model, prompts, self.engine_max_tokens, fault="corrupt", workdir=self.tmp_path)
        long = [i for i, p in enumerate(prompts) if len(p) > 2 * self.block_size]
        unchanged = [i for i in long if first_mismatch([expected[i]], [run.token_ids[i]]) is None]
        assert not unchanged, (
            f"{self.name}: prompts {unchanged} ({[len(prompts[i]) for i in unchanged]} tokens) decoded identically "
            "from corrupted KV, expected them to differ: the transferred KV is not what the decode used")
