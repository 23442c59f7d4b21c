"""Area "scheduler_contract": the connector's SCHEDULER side inside vLLM's real Scheduler.

Worker results are faked (`KVConnectorOutput` with finished_sending / finished_recving), so
these tests pin down what the scheduler side must do on its own: match, allocate, build
metadata every step, finish (returning kv_transfer_params), survive aborts in every state, and
leave nothing behind. Every test ends with the leak check (no request, every block free, ref
counts 0).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from kvconnectors.conformance.capabilities import requires
from kvconnectors.conformance.harness import create_kv_connector_output, create_request
from kvconnectors.testing.prompts import token_prompts


def _prompts(backend: Any, n: int = 1, seed: int = 0) -> list[list[int]]:
    lengths = [backend.prompt_lengths[i % len(backend.prompt_lengths)] for i in range(n)]
    return token_prompts(lengths, seed=seed)


def _meta_type_ok(meta: Any) -> bool:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

    return isinstance(meta, KVConnectorMetadata)


class SchedulerContractTests:
    conformance_area = "scheduler_contract"

    @pytest.fixture
    def sched(self) -> Any:
        h = self.scheduler(name=f"{self.name}-scheduler")
        yield h
        h.close()

    # ------------------------------------------------------------------ declarations
    def test_declared_capabilities_hold(self) -> None:
        """What can be checked without running anything: HMA support matches the class, and
        every xfail / skip entry names a test that exists (a stale entry would hide nothing)."""
        from vllm.config import KVTransferConfig
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        cls = self.connector_class()
        # vLLM's own test (MultiConnector: every child must support HMA).
        is_hma = KVConnectorFactory.supports_hma_config(KVTransferConfig(**self.kv_transfer_config("kv_both")))
        assert is_hma == self.capabilities.hma, (
            f"{self.name}: vLLM says {cls.__name__} {'supports' if is_hma else 'does not support'} HMA "
            f"(SupportsHMA), but capabilities.hma={self.capabilities.hma}")
        from kvconnectors.conformance.capabilities import AREAS

        tests = {n for n in dir(type(self)) if n.startswith("test_")}
        stale = [k for k in self.xfail if k.split("[")[0] not in tests]
        stale += [k for k in self.skips if k.split("[")[0] not in tests and k not in AREAS]
        assert not stale, f"{self.name}: xfail/skips entries {stale} name no test of {type(self).__name__}"

    # ------------------------------------------------------------------ producer
    def test_producer_lifecycle(self, sched: Any) -> None:
        """match (nothing to load) -> alloc -> metadata -> finish -> kv_transfer_params."""
        (prompt,) = _prompts(self)
        req = sched.add(create_request("prod-0", prompt, max_tokens=1, kv_transfer_params=self.producer_params()))
        matched = sched.connector.get_num_new_matched_tokens(req, 0)
        assert not matched[0], (
            f"{self.name}: a fresh producer prompt matched {matched}, expected (0, False): nothing to load")
        step = sched.step()
        assert _meta_type_ok(step.meta), (
            f"{self.name}: build_connector_meta returned {type(step.meta).__name__}, expected a KVConnectorMetadata")
        assert step.scheduled("prod-0") == len(prompt), (
            f"{self.name}: producer scheduled {step.scheduled('prod-0')} tokens, expected the whole prompt "
            f"({len(prompt)}): the connector must not claim tokens for it")
        out = sched.finished.get("prod-0")
        assert out is not None and str(out.finish_reason) == "length", (
            f"{self.name}: producer (max_tokens=1) not finished by length after its prefill step; seen "
            f"{sched.describe()}")
        params = out.kv_transfer_params
        if self.capabilities.pd_pull:
            assert isinstance(params, dict) and params, (
                f"{self.name}: declares pd_pull but request_finished returned kv_transfer_params={params!r}, "
                "expected the params a consumer pulls with")
        sched.drain()
        sched.assert_empty("producer lifecycle")

    def test_build_connector_meta_every_step(self, sched: Any) -> None:
        """build_connector_meta runs on every schedule(), empty steps included, and returns
        metadata each time (the worker asserts it is bound)."""
        for i in range(3):
            step = sched.step()
            assert _meta_type_ok(step.meta), (
                f"{self.name}: empty step {i}: kv_connector_metadata={step.meta!r}, expected a KVConnectorMetadata")
        sched.assert_empty("empty steps")

    # ------------------------------------------------------------------ consumer
    def test_consumer_lifecycle(self, sched: Any) -> None:
        """ticket -> match -> alloc -> (async: wait, finished_recving) -> runs -> finishes."""
        from vllm.v1.request import RequestStatus

        (prompt,) = _prompts(self)
        params = self.prepare_consumer(sched, prompt)
        req = sched.add(create_request("cons-0", prompt, max_tokens=3, kv_transfer_params=params))
        n, is_async = sched.connector.get_num_new_matched_tokens(req, 0)
        assert n is not None and n > 0, (
            f"{self.name}: consumer of a prepared {len(prompt)}-token prompt matched {n} tokens, expected > 0")
        expected = self.expected_load_tokens(len(prompt))
        if expected is not None:
            assert n == expected, f"{self.name}: matched {n} tokens of {len(prompt)}, expected {expected}"
        assert bool(is_async) == self.capabilities.async_load, (
            f"{self.name}: get_num_new_matched_tokens returned load_async={is_async}, but "
            f"capabilities.async_load={self.capabilities.async_load}")
        step = sched.step()
        assert _meta_type_ok(step.meta)
        if is_async:
            assert sched.status("cons-0") == RequestStatus.WAITING_FOR_REMOTE_KVS, (
                f"{self.name}: async load: status {sched.status('cons-0')}, expected WAITING_FOR_REMOTE_KVS")
            assert step.scheduled("cons-0") == 0
            held = sched.block_ids("cons-0")
            assert len(held) * sched.block_size >= n, (
                f"{self.name}: {len(held)} blocks allocated for an async load of {n} tokens")
            sched.step()  # the worker has not finished yet: still waiting
            assert sched.status("cons-0") == RequestStatus.WAITING_FOR_REMOTE_KVS
            sched.step(create_kv_connector_output(finished_recving={"cons-0"}))
            step = sched.step()
            new = {r.req_id: r for r in step.scheduler_output.scheduled_new_reqs}
            assert "cons-0" in new, (
                f"{self.name}: after finished_recving the request was not scheduled; seen {sched.describe()}")
            assert new["cons-0"].num_computed_tokens >= min(n, len(prompt) - 1), (
                f"{self.name}: resumed with {new['cons-0'].num_computed_tokens} computed tokens, expected the "
                f"{n} loaded ones (less the last prompt token vLLM recomputes)")
        else:
            new = {r.req_id: r for r in step.scheduler_output.scheduled_new_reqs}
            assert "cons-0" in new, f"{self.name}: sync load: request not scheduled; seen {sched.describe()}"
            assert new["cons-0"].num_computed_tokens == n, (
                f"{self.name}: sync load: scheduled with {new['cons-0'].num_computed_tokens} computed tokens, "
                f"expected the {n} matched")
            assert step.scheduler_output.has_sync_kv_loads, (
                f"{self.name}: sync load but SchedulerOutput.has_sync_kv_loads is False")
        sched.run_until(lambda: "cons-0" in sched.finished, "consumer to finish", timeout_s=self.timeout_s)
        out = sched.finished["cons-0"]
        tokens = sum(len(o.new_token_ids) for o in sched.outputs["cons-0"])
        assert str(out.finish_reason) == "length" and tokens == 3, (
            f"{self.name}: consumer finished with {out.finish_reason} after {tokens} tokens, expected length after 3")
        sched.drain()
        sched.assert_empty("consumer lifecycle")

    def test_get_num_new_matched_tokens_is_idempotent(self, sched: Any) -> None:
        """Called twice it gives the same answer and changes nothing (vLLM may call it every
        step while a request waits)."""
        from vllm.v1.request import RequestStatus

        prompt, other = _prompts(self, 2, seed=3)
        params = self.prepare_consumer(sched, prompt)
        consumer = sched.add(create_request("idem-c", prompt, max_tokens=2, kv_transfer_params=params))
        plain = sched.add(create_request("idem-p", other, max_tokens=2))
        for req in (consumer, plain):
            before = (copy.deepcopy(req.kv_transfer_params), req.status, req.num_computed_tokens)
            answers = [tuple(sched.connector.get_num_new_matched_tokens(req, 0)) for _ in range(3)]
            after = (copy.deepcopy(req.kv_transfer_params), req.status, req.num_computed_tokens)
            assert len(set(answers)) == 1, f"{self.name}: {req.request_id}: answers differ across calls: {answers}"
            assert before == after, (f"{self.name}: {req.request_id}: calling get_num_new_matched_tokens changed "
                                     f"(params, status, computed) from {before} to {after}")
        n_consumer = sched.connector.get_num_new_matched_tokens(consumer, 0)[0]
        assert sched.connector.get_num_new_matched_tokens(plain, 0) == (0, False), (
            f"{self.name}: a request with no params and nothing stored matched "
            f"{sched.connector.get_num_new_matched_tokens(plain, 0)}, expected (0, False)")
        # The scheduler's own call must see the same answer: the load it sets up covers it.
        step = sched.step()
        if sched.status("idem-c") == RequestStatus.WAITING_FOR_REMOTE_KVS:
            sched.step(create_kv_connector_output(finished_recving={"idem-c"}))
        else:
            new = {r.req_id: r for r in step.scheduler_output.scheduled_new_reqs}
            assert new["idem-c"].num_computed_tokens == n_consumer
        sched.run_until(lambda: {"idem-c", "idem-p"} <= set(sched.finished), "both requests to finish",
                        timeout_s=self.timeout_s)
        sched.drain()
        sched.assert_empty("idempotence probe")

    # ------------------------------------------------------------------ aborts
    def test_abort_while_waiting(self, sched: Any) -> None:
        """Abort producer, consumer and plain requests before their first step."""
        a, b, c = _prompts(self, 3, seed=5)
        params = self.prepare_consumer(sched, b)
        sched.add(create_request("ab-w-prod", a, max_tokens=2, kv_transfer_params=self.producer_params()))
        sched.add(create_request("ab-w-cons", b, max_tokens=2, kv_transfer_params=params))
        sched.add(create_request("ab-w-plain", c, max_tokens=2))
        aborted = sched.abort("ab-w-prod", "ab-w-cons", "ab-w-plain")
        assert len(aborted) == 3, f"{self.name}: aborted {len(aborted)} of 3 waiting requests"
        sched.drain()
        sched.assert_empty("aborts in WAITING")

    @requires("async_load")
    def test_abort_while_waiting_for_remote_kv(self, sched: Any) -> None:
        """Abort during an async load: vLLM keeps the blocks until the worker reports the
        request in finished_recving (a connector must always report started receives)."""
        from vllm.v1.request import RequestStatus

        (prompt,) = _prompts(self, seed=7)
        params = self.prepare_consumer(sched, prompt)
        sched.add(create_request("ab-r", prompt, max_tokens=2, kv_transfer_params=params))
        sched.step()
        assert sched.status("ab-r") == RequestStatus.WAITING_FOR_REMOTE_KVS, (
            f"{self.name}: status {sched.status('ab-r')}, expected WAITING_FOR_REMOTE_KVS")
        held = sched.block_ids("ab-r")
        sched.abort("ab-r")
        sched.step()
        assert sched.request("ab-r") is not None and sched.block_ids("ab-r") == held, (
            f"{self.name}: blocks of a request aborted mid-load were freed before finished_recving: the "
            "worker could still be writing them")
        sched.step(create_kv_connector_output(finished_recving={"ab-r"}))
        sched.drain()
        sched.assert_empty("abort in WAITING_FOR_REMOTE_KVS")

    def test_abort_while_running(self, sched: Any) -> None:
        """Abort a producer mid-decode and a consumer after its load."""
        from vllm.v1.request import RequestStatus

        a, b = _prompts(self, 2, seed=9)
        params = self.prepare_consumer(sched, b)
        sched.add(create_request("ab-run-prod", a, max_tokens=8, kv_transfer_params=self.producer_params()))
        sched.add(create_request("ab-run-cons", b, max_tokens=8, kv_transfer_params=params))
        sched.step()
        if sched.status("ab-run-cons") == RequestStatus.WAITING_FOR_REMOTE_KVS:
            sched.step(create_kv_connector_output(finished_recving={"ab-run-cons"}))
        sched.run_until(lambda: sched.status("ab-run-cons") == RequestStatus.RUNNING
                        and sched.status("ab-run-prod") == RequestStatus.RUNNING,
                        "both requests RUNNING", timeout_s=self.timeout_s)
        sched.step()
        sched.abort("ab-run-prod", "ab-run-cons")
        assert "ab-run-prod" not in sched.finished or str(sched.finished["ab-run-prod"].finish_reason) != "length"
        sched.drain()
        sched.assert_empty("aborts in RUNNING")

    def test_abort_after_finish(self, sched: Any) -> None:
        """Aborting a finished request (blocks possibly still held for sending) is a no-op."""
        (prompt,) = _prompts(self, seed=11)
        sched.add(create_request("ab-f", prompt, max_tokens=1, kv_transfer_params=self.producer_params()))
        sched.run_until(lambda: "ab-f" in sched.finished, "producer to finish", timeout_s=self.timeout_s)
        assert sched.abort("ab-f") == [], f"{self.name}: abort of a finished request aborted something"
        sched.drain()
        sched.assert_empty("abort after finish")

    # ------------------------------------------------------------------ mixed batches
    def test_mixed_batch(self, sched: Any) -> None:
        """Producers, consumers and plain requests in one batch all finish, nothing leaks."""
        prompts = _prompts(self, 6, seed=13)
        tickets = [self.prepare_consumer(sched, p) for p in prompts[2:4]]
        ids = []
        for i, p in enumerate(prompts[:2]):
            ids.append(sched.add(create_request(f"mix-prod-{i}", p, max_tokens=1,
                                                kv_transfer_params=self.producer_params())).request_id)
        for i, (p, t) in enumerate(zip(prompts[2:4], tickets)):
            ids.append(sched.add(create_request(f"mix-cons-{i}", p, max_tokens=4, kv_transfer_params=t)).request_id)
        for i, p in enumerate(prompts[4:]):
            ids.append(sched.add(create_request(f"mix-plain-{i}", p, max_tokens=3)).request_id)

        sched.run_until(lambda: set(ids) <= set(sched.finished), "every request to finish",
                        kv_output=sched.loads_to_complete, timeout_s=self.timeout_s)
        reasons = {r: str(sched.finished[r].finish_reason) for r in ids}
        assert set(reasons.values()) == {"length"}, f"{self.name}: finish reasons {reasons}, expected all length"
        sched.drain()
        sched.assert_empty("mixed batch")
