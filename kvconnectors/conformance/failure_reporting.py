"""Area "failure_reporting": every load failure reaches the scheduler and
`kv_load_failure_policy` is honoured ("fail": the request finishes with an error; "recompute":
it is recomputed and finishes normally — in engines, with the colocated output).

Three levels:
- scheduler: fake worker outputs carrying failed_recving / invalid_block_ids, checking that
  the connector's scheduler side survives vLLM's failure handling without leaks;
- worker: the backend's fault hook (`fault_extra()`, e.g. TieredConnector's `fault_injection`)
  makes real loads fail; every consumer request must come back in failed_recving or with its
  blocks in get_block_ids_with_load_errors;
- engine (marker `engine`): the same fault in a real engine, outputs checked.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvconnectors.conformance.capabilities import requires
from kvconnectors.conformance.engine_e2e import ENGINE_TIMEOUT_S, require_engine_platform
from kvconnectors.conformance.harness import create_kv_connector_output, create_request, tiny_model_path
from kvconnectors.conformance.worker_transfer import engine_pair, run_transfer
from kvconnectors.testing.prompts import token_prompts

POLICIES = ["fail", "recompute"]


class FailureReportingTests:
    conformance_area = "failure_reporting"

    def _failure_sched(self, policy: str) -> Any:
        return self.scheduler(policy=policy, name=f"{self.name}-{policy}")

    def _check_policy(self, sched: Any, rid: str, prompt: list[int], policy: str) -> None:
        if policy == "fail":
            sched.run_until(lambda: rid in sched.finished, f"{rid} to finish with an error", timeout_s=self.timeout_s)
            reason = str(sched.finished[rid].finish_reason)
            assert reason == "error", (f"{self.name}: policy 'fail': {rid} finished with {reason!r}, expected 'error'")
            return
        full_prefill = []
        # A connector may set up another load instead of a recompute: let such loads succeed.
        for step in sched.run_until(lambda: rid in sched.finished, f"{rid} to be recomputed and finish",
                                    kv_output=sched.loads_to_complete, timeout_s=self.timeout_s):
            full_prefill.append(step.scheduled(rid))
        reason = str(sched.finished[rid].finish_reason)
        assert reason == "length", f"{self.name}: policy 'recompute': {rid} finished with {reason!r}, expected 'length'"
        assert max(full_prefill, default=0) >= len(prompt) - 1, (
            f"{self.name}: policy 'recompute': largest step scheduled {max(full_prefill, default=0)} tokens, "
            f"expected a recompute of the {len(prompt)}-token prompt")

    # ------------------------------------------------------------------ scheduler level
    @requires("async_load")
    @pytest.mark.parametrize("policy", POLICIES)
    def test_failed_recving_honours_policy(self, policy: str) -> None:
        """A request-level failure (failed_recving, also in finished_recving) of an async load."""
        from vllm.v1.request import RequestStatus

        sched = self._failure_sched(policy)
        try:
            (prompt,) = token_prompts([self.prompt_lengths[0]], seed=41)
            params = self.prepare_consumer(sched, prompt)
            sched.add(create_request("fr-0", prompt, max_tokens=3, kv_transfer_params=params))
            sched.step()
            assert sched.status("fr-0") == RequestStatus.WAITING_FOR_REMOTE_KVS, sched.describe()
            sched.step(create_kv_connector_output(finished_recving={"fr-0"}, failed_recving={"fr-0"}))
            self._check_policy(sched, "fr-0", prompt, policy)
            sched.drain()
            sched.assert_empty(f"failed_recving with policy {policy}")
        finally:
            sched.close()

    @pytest.mark.parametrize("policy", POLICIES)
    def test_invalid_blocks_honour_policy(self, policy: str) -> None:
        """A block-level failure (get_block_ids_with_load_errors) of the first loaded block,
        reported with the load's completion (async) or in the step that loaded (sync)."""
        from vllm.v1.request import RequestStatus

        sched = self._failure_sched(policy)
        try:
            (prompt,) = token_prompts([self.prompt_lengths[0]], seed=43)
            params = self.prepare_consumer(sched, prompt)
            sched.add(create_request("ib-0", prompt, max_tokens=3, kv_transfer_params=params))
            n, is_async = sched.connector.get_num_new_matched_tokens(sched.request("ib-0"), 0)
            assert n, f"{self.name}: prepared consumer matched {n} tokens, expected > 0"
            if is_async:
                sched.step()
                assert sched.status("ib-0") == RequestStatus.WAITING_FOR_REMOTE_KVS, sched.describe()
                first = sched.block_ids("ib-0")[0]
                sched.step(create_kv_connector_output(finished_recving={"ib-0"}, invalid_block_ids={first}))
            else:
                def fail_first_block(so: Any) -> Any:
                    new = {r.req_id: r for r in so.scheduled_new_reqs}
                    assert "ib-0" in new and new["ib-0"].num_computed_tokens == n, (
                        f"{self.name}: sync load not scheduled with its {n} matched tokens; seen {sched.describe()}")
                    return create_kv_connector_output(invalid_block_ids={new["ib-0"].block_ids[0][0]})

                sched.step(fail_first_block)
            self._check_policy(sched, "ib-0", prompt, policy)
            sched.drain()
            sched.assert_empty(f"invalid blocks with policy {policy}")
        finally:
            sched.close()

    # ------------------------------------------------------------------ worker level
    @requires("failure_reporting", "runs_on_cpu")
    @pytest.mark.parametrize("policy", POLICIES)
    def test_injected_load_failure_reaches_scheduler(self, policy: str) -> None:
        """Loads made to fail by the backend's fault hook: each consumer request is reported
        (failed_recving, or its blocks in invalid block ids) and the policy is applied."""
        fault = self.fault_extra()
        by_params = fault is None and self.fault_params({"probe": True}) is not None
        if fault is None and not by_params:
            pytest.skip(f"{self.name}: no fault-injection hook (fault_extra() and fault_params() return None)")
        prompts = token_prompts(list(self.prompt_lengths), seed=45)
        with engine_pair(self, policy=policy, producer_extra=fault) as (producer, consumer):
            scheduled: dict[str, int] = {}

            def watch(so: Any, out: Any) -> None:
                for r, n in so.num_scheduled_tokens.items():
                    scheduled[r] = max(scheduled.get(r, 0), n)

            consumer.on_step.append(watch)
            t = run_transfer(self, producer, consumer, prompts, wait_for_producer=not by_params,
                             params_hook=self.fault_params if by_params else None)
            for i, prompt in enumerate(prompts):
                rid = f"c{i}"
                blocks = set(t.consumer_blocks.get(i, ()))
                reported = rid in t.failed_recving or bool(blocks & t.invalid_block_ids)
                assert reported, (
                    f"{self.name}: injected load failure of {rid} never reached the scheduler: failed_recving="
                    f"{sorted(t.failed_recving)}, invalid_block_ids={sorted(t.invalid_block_ids)[:8]}, its blocks "
                    f"{sorted(blocks)[:8]}")
                reason = str(consumer.sched.finished[rid].finish_reason)
                if policy == "fail":
                    assert reason == "error", f"{self.name}: policy 'fail': {rid} finished {reason!r}, expected 'error'"
                else:
                    assert reason == "length", (
                        f"{self.name}: policy 'recompute': {rid} finished {reason!r}, expected 'length'")
                    # Rescheduled after the failure. Not necessarily a full prefill: a
                    # MultiConnector may serve the retry from another child's store.
                    assert scheduled.get(rid, 0) > 0, (
                        f"{self.name}: policy 'recompute': {rid} was never scheduled after its failed load")
            # A producer whose consumer failed before reading keeps its blocks until its own
            # lease/timeout (fault_params): only then is the producer exempt from the leak check.
            for h in (consumer,) if by_params else (producer, consumer):
                h.sched.assert_empty(f"injected failures with policy {policy}")

    # ------------------------------------------------------------------ engine level
    @pytest.mark.engine
    @pytest.mark.timeout(ENGINE_TIMEOUT_S)
    @requires("failure_reporting")
    @pytest.mark.parametrize("policy", POLICIES)
    def test_engine_load_failure_policy(self, policy: str) -> None:
        """Real engine, loads failed by the fault hook: 'fail' -> every decode finishes with
        'error'; 'recompute' -> every decode equals the colocated output."""
        from kvconnectors.conformance.engine_runs import colocated
        from kvconnectors.testing.compare import assert_same_tokens

        require_engine_platform(self)
        model = tiny_model_path()
        prompts = token_prompts([self.block_size + 8, 3 * self.block_size + 7, 5 * self.block_size + 3], seed=47)
        run = self.run_pd(model, prompts, 8, fault="fail", policy=policy, workdir=self.tmp_path)
        if policy == "fail":
            assert run.finish_reasons == ["error"] * len(prompts), (
                f"{self.name}: policy 'fail' with every load failing: finish reasons {run.finish_reasons}, "
                f"expected all 'error'; notes {run.notes}")
        else:
            assert "error" not in run.finish_reasons, (
                f"{self.name}: policy 'recompute': finish reasons {run.finish_reasons}, expected no 'error'")
            assert_same_tokens(colocated(model, prompts, 8), run.token_ids,
                               what=f"{self.name} decode output after recomputing failed loads")
