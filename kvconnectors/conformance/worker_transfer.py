"""Area "worker_transfer": real KV tensors through the connector's WORKER side, producer to
consumer, in this process (no model, no engine).

Two `EngineHarness`es (scheduler + worker connector + CPU KV caches of vLLM's CPU layout) are
stepped in lockstep: the producer prefills prompts (its caches hold seeded random "KV"), the
consumer is handed what a P/D proxy would hand it and loads. The blocks that arrive must equal
the source blocks byte for byte: whole blocks for the tokens the connector said it loaded, and
the loaded token slots of a partial last block.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

from kvconnectors.conformance.capabilities import requires
from kvconnectors.conformance.harness import create_request
from kvconnectors.conformance.workers import compare_blocks, single_rank_parallel_state
from kvconnectors.testing import process_state
from kvconnectors.testing.prompts import token_prompts


@dataclass
class Landing:
    """What the consumer had in its blocks right after the step that first scheduled it."""
    block_ids: list[int]
    num_computed_tokens: int
    data: dict[str, list[Any]]


@dataclass
class Transfer:
    prompts: list[list[int]]
    src_blocks: dict[int, list[int]] = field(default_factory=dict)    # prompt index -> producer blocks
    landings: dict[int, Landing] = field(default_factory=dict)         # prompt index -> consumer landing
    producer_params: dict[int, Any] = field(default_factory=dict)    # what the producer's response carried
    sent_params: dict[int, Any] = field(default_factory=dict)        # what the producer request carried
    failed_recving: set[str] = field(default_factory=set)
    invalid_block_ids: set[int] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    consumer_blocks: dict[int, list[int]] = field(default_factory=dict)  # blocks allocated to each consumer


@contextlib.contextmanager
def engine_pair(backend: Any, **kwargs: Any):
    stack = contextlib.ExitStack()
    with stack:
        stack.enter_context(process_state.kept())  # workers pin this thread, write os.environ
        stack.enter_context(backend.worker_context())
        if backend.needs_parallel_state:
            from kvconnectors.conformance.harness import create_vllm_config

            stack.enter_context(single_rank_parallel_state(create_vllm_config(None)))
        producer, consumer = backend.engine_pair(**kwargs)
        stack.callback(producer.close)
        stack.callback(consumer.close)
        yield producer, consumer


def run_transfer(backend: Any, producer: Any, consumer: Any, prompts: list[list[int]], *,
                 consumer_max_tokens: int = 2, params_hook: Any = None, wait_for_producer: bool = True) -> Transfer:
    """Prefill `prompts` on the producer, load and decode them on the consumer; returns what
    landed where. Both engines are stepped until every consumer request finished and (with
    `wait_for_producer`) the producer holds no blocks for sending; bounded by
    `backend.timeout_s`. `params_hook` may rewrite the params handed to the consumer.

    Checked on every step (the get_finished contract): finished_sending only for ids that were
    passed in finished_req_ids, finished_recving only for requests that were loading."""
    from vllm.v1.request import RequestStatus

    t = Transfer(prompts=prompts)
    pid = {f"p{i}": i for i in range(len(prompts))}
    cid = {f"c{i}": i for i in range(len(prompts))}
    finished_seen: set[str] = set()
    violations: list[str] = []

    def on_producer(so: Any, out: Any) -> None:
        for r in so.scheduled_new_reqs:
            if r.req_id in pid:
                t.src_blocks[pid[r.req_id]] = list(r.block_ids[0])
        # get_finished contract: a finished_sending id must have been passed in finished_req_ids.
        finished_seen.update(so.finished_req_ids)
        for r in out.finished_sending or ():
            if r not in finished_seen:
                violations.append(f"producer reported finished_sending {r!r} before it was in finished_req_ids")

    def on_consumer(so: Any, out: Any) -> None:
        for r in so.scheduled_new_reqs:
            if r.req_id in cid and cid[r.req_id] not in t.landings:
                blocks = list(r.block_ids[0])
                t.landings[cid[r.req_id]] = Landing(blocks, r.num_computed_tokens,
                                                    consumer.block_bytes(blocks, r.num_computed_tokens))
        t.failed_recving |= set(out.failed_recving or ())
        t.invalid_block_ids |= set(out.invalid_block_ids or ())
        t.finished_recving |= set(out.finished_recving or ())
        for r in set(out.finished_recving or ()) - set(cid):
            violations.append(f"consumer reported finished_recving {r!r}, a request that never loaded")
        for rid, i in cid.items():
            ids = consumer.sched.block_ids(rid)
            if ids:
                t.consumer_blocks.setdefault(i, ids)

    producer.on_step.append(on_producer)
    consumer.on_step.append(on_consumer)
    for name, i in pid.items():
        t.sent_params[i] = backend.producer_params()
        producer.sched.add(create_request(name, prompts[i], max_tokens=1, kv_transfer_params=t.sent_params[i]))
    deadline = time.monotonic() + backend.timeout_s
    while not set(pid) <= set(producer.sched.finished):
        assert time.monotonic() < deadline, (
            f"{backend.name}: producer requests not finished after {backend.timeout_s}s; seen "
            f"{producer.sched.describe()}")
        producer.step()
    for name, i in pid.items():
        t.producer_params[i] = producer.sched.finished[name].kv_transfer_params
    for name, i in cid.items():
        params = backend.consumer_params(t.producer_params[i], sent=t.sent_params[i], producer=producer)
        if params_hook is not None:
            params = params_hook(params)
        consumer.sched.add(create_request(name, prompts[i], max_tokens=consumer_max_tokens,
                                          kv_transfer_params=params))

    def done() -> bool:
        return set(cid) <= set(consumer.sched.finished) and not (wait_for_producer
                                                                   and producer.sched.held_finished())

    while not done():
        if time.monotonic() > deadline:
            waiting = [r for r in cid if consumer.sched.status(r) == RequestStatus.WAITING_FOR_REMOTE_KVS]
            raise AssertionError(
                f"{backend.name}: transfer not complete after {backend.timeout_s}s: consumer requests still "
                f"waiting for KV: {waiting}; consumer {consumer.sched.describe()}; producer holds "
                f"{producer.sched.held_finished()}")
        consumer.step()
        producer.step()
        time.sleep(0.005)  # async loads and sends progress on their own threads
    consumer.sched.drain(release_held=False)
    if wait_for_producer:
        producer.sched.drain(release_held=False)
    assert not violations, f"{backend.name}: " + "; ".join(violations[:4])
    return t


class WorkerTransferTests:
    conformance_area = "worker_transfer"

    @pytest.fixture
    def pair(self) -> Any:
        with engine_pair(self) as p:
            yield p

    def _check_landings(self, t: Transfer, producer: Any, *, require_load: set[int]) -> None:
        for i, prompt in enumerate(t.prompts):
            landing = t.landings.get(i)
            assert landing is not None, f"{self.name}: consumer request c{i} was never scheduled"
            n = landing.num_computed_tokens
            if i in require_load:
                assert n > 0, (f"{self.name}: prompt {i} ({len(prompt)} tokens) loaded 0 tokens, expected > 0: "
                               "the consumer recomputed it, so byte identity would prove nothing")
            src = producer.block_bytes(t.src_blocks[i], n)
            diffs = compare_blocks(src, landing.data)
            assert not diffs, (f"{self.name}: prompt {i} ({len(prompt)} tokens, {n} loaded): destination blocks "
                               f"{landing.block_ids[:8]} differ from source blocks {t.src_blocks[i][:8]}: "
                               + "; ".join(diffs[:4]))

    @requires("runs_on_cpu")
    def test_kv_bytes_arrive_intact(self, pair: Any) -> None:
        """Prompts of 3 blocks + 5, exactly 2 blocks and 1 block + 8 tokens: every loaded block
        equals its source block byte for byte."""
        producer, consumer = pair
        prompts = token_prompts(list(self.prompt_lengths), seed=21)
        t = run_transfer(self, producer, consumer, prompts)
        long = {i for i, p in enumerate(prompts) if (self.expected_load_tokens(len(p)) or len(p)) > 0}
        self._check_landings(t, producer, require_load=long)
        assert not t.failed_recving and not t.invalid_block_ids, (
            f"{self.name}: clean transfer reported failures: failed_recving={t.failed_recving}, "
            f"invalid_block_ids={t.invalid_block_ids}")
        for h in (producer, consumer):
            h.sched.assert_empty("worker transfer")

    @requires("runs_on_cpu")
    def test_block_edge_prompt_is_found(self, pair: Any) -> None:
        """A prompt of k*block_size + 1 tokens (k full blocks before the last token) saved by the
        producer must be found and loaded by the consumer."""
        producer, consumer = pair
        bs = self.block_size
        prompts = token_prompts([bs + 1, 2 * bs + 1, 3 * bs + 1], seed=23)
        t = run_transfer(self, producer, consumer, prompts)
        loaded = [t.landings[i].num_computed_tokens for i in range(len(prompts))]
        assert all(n >= bs for n in loaded), (
            f"{self.name}: prompts of {[len(p) for p in prompts]} tokens loaded {loaded} tokens, expected at least "
            f"one full block ({bs}) each")
        self._check_landings(t, producer, require_load=set(range(len(prompts))))
        for h in (producer, consumer):
            h.sched.assert_empty("block-edge transfer")

    @requires("runs_on_cpu")
    def test_corruption_is_visible(self) -> None:
        """Negative control: with the backend's corruption hook on (bytes changed in flight,
        integrity checks off), the byte comparison above must see the damage, or it proves
        nothing."""
        extra = self.corrupt_extra()
        if extra is None:
            pytest.skip(f"{self.name}: no corruption hook (corrupt_extra() returns None)")
        prompts = token_prompts([self.prompt_lengths[0]], seed=27)
        with engine_pair(self, producer_extra=extra, consumer_extra=extra) as (producer, consumer):
            t = run_transfer(self, producer, consumer, prompts)
            landing = t.landings[0]
            assert landing.num_computed_tokens > 0, f"{self.name}: nothing loaded under the corruption hook"
            diffs = compare_blocks(producer.block_bytes(t.src_blocks[0], landing.num_computed_tokens), landing.data)
            assert diffs, (f"{self.name}: corrupt_extra() is on but the {landing.num_computed_tokens} loaded tokens "
                           "arrived intact: the hook corrupts nothing")

    @requires("layerwise_load", "runs_on_cpu")
    def test_layer_is_loaded_when_wait_for_layer_load_returns(self, pair: Any) -> None:
        """Layer-wise loading: when wait_for_layer_load(layer) returns in the step that first
        runs a consumer request, that layer's loaded blocks already equal the source."""
        producer, consumer = pair
        prompts = token_prompts([self.prompt_lengths[0]], seed=29)
        seen: dict[str, Any] = {}

        def on_layer(so: Any, layer: str) -> None:
            for r in so.scheduled_new_reqs:
                if r.req_id == "c0" and layer not in seen:
                    ids, n = list(r.block_ids[0]), r.num_computed_tokens
                    seen[layer] = (ids, n, consumer.block_bytes(ids, n)[layer])

        consumer.on_layer.append(on_layer)
        t = run_transfer(self, producer, consumer, prompts)
        assert set(seen) == set(consumer.kv_caches), (
            f"{self.name}: wait_for_layer_load was reached for layers {sorted(seen)} of c0's first step, expected "
            f"all {len(consumer.kv_caches)}")
        for layer, (ids, n, data) in seen.items():
            src = producer.block_bytes(t.src_blocks[0], n)[layer]
            diffs = compare_blocks({layer: src}, {layer: data})
            assert not diffs, f"{self.name}: right after wait_for_layer_load({layer!r}): " + "; ".join(diffs[:3])
