"""`ConnectorBackend`: the one class a connector overrides to run the conformance suite.

fsspec-style opt-in: subclass it once per connector, then combine it with the area mixins you
want (`SchedulerContractTests`, `WorkerTransferTests`, `EngineEndToEndTests`,
`FailureReportingTests`):

    class TieredBackend(ConnectorBackend):
        name = "TieredConnector"; kv_connector = "TieredConnector"; module_path = "kvconnectors.tiered"
        capabilities = Capabilities(async_load=True, pd_pull=True, failure_reporting=True)
    class TestTiered(TieredBackend, SchedulerContractTests, WorkerTransferTests): pass

What a backend MUST set: `name`, `kv_connector` (and `module_path` for an out-of-tree class).
What it MAY override (all have working defaults for a "pull with a ticket" connector):
`own` (True for kvconnectors' own connectors and anything composed of them: if such a backend
cannot be imported or constructed, every test FAILS with the exception and its traceback instead
of skipping as "unavailable here"), `capabilities`, `xfail` (strict, test name -> "issue URL:
why"), `skips` (test or area name -> the precise reason it cannot run here), `extra_config(role)`,
`environment(role, instance)`, `unavailable()`, `producer_params()`, `prepare_scheduler(harness)`,
`prepare_consumer(harness, prompt)` (the backdoor that makes a prompt loadable),
`consumer_params(params, sent=, producer=)`, `fault_extra()` / `fault_params()` /
`corrupt_extra()` (fault hooks), `worker_context()` / `release_worker()`, `run_pd(...)` (how to
run a real prefill -> decode pair of engines). docs/conformance.md has the full table.

Scenarios backends never override live in the mixins; every wait is bounded by `timeout_s`.
"""

from __future__ import annotations

import itertools
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest

from kvconnectors.conformance.capabilities import Capabilities, area_of, missing, skip_reason


class ConnectorBackend:
    """Fixtures and hooks for one connector. Class attributes, not fixtures, on purpose: a
    fixture overridden by a plain method would be silently ignored."""

    # ---------------------------------------------------------------- MUST
    name: ClassVar[str] = ""
    kv_connector: ClassVar[str] = ""
    # ---------------------------------------------------------------- MAY
    module_path: ClassVar[str | None] = None
    # kvconnectors' own connector (or one composed of it): not importable or constructible here is
    # a defect of this project, never an environment it may skip in.
    own: ClassVar[bool] = False
    capabilities: ClassVar[Capabilities] = Capabilities()
    xfail: ClassVar[dict[str, str]] = {}      # test name -> "https://issue: reason"  (strict)
    skips: ClassVar[dict[str, str]] = {}      # test or area name -> precise reason it cannot run here
    block_size: ClassVar[int] = 32
    scheduler_role: ClassVar[str] = "kv_both"     # scheduler-contract tests: producer and consumer in one
    producer_role: ClassVar[str] = "kv_producer"
    consumer_role: ClassVar[str] = "kv_consumer"
    engine_role: ClassVar[str] = "kv_both"        # one-engine P/D (kvconnectors.testing.pd)
    needs_parallel_state: ClassVar[bool] = False  # worker side needs vLLM's TP group (NIXL)
    timeout_s: ClassVar[float] = 30.0             # bound on every wait
    prompt_lengths: ClassVar[tuple[int, ...]] = (101, 64, 40)  # 3 blocks + 5, exactly 2 blocks, 1 + 8

    _seq = itertools.count()
    tmp_path: Path | None = None   # set per test by the gate (pytest's tmp_path)

    # ---------------------------------------------------------------- gate (autouse)
    @pytest.fixture(autouse=True, scope="class")
    def _kept_pair_ends_with_the_class(self) -> Iterator[None]:
        """The live server pair engine tests may keep (engine_runs.KEPT_PAIR) stops with the class."""
        yield
        from kvconnectors.conformance.engine_runs import KEPT_PAIR

        KEPT_PAIR.close()

    @pytest.fixture(autouse=True)
    def _conformance_gate(self, request: pytest.FixtureRequest, tmp_path: Path) -> None:
        """Per test: availability, declared capabilities, known skips, strict xfails."""
        self.tmp_path = tmp_path
        test = request.node.name
        base = getattr(request.node, "originalname", test)
        if not self.name or not self.kv_connector:
            pytest.fail(f"{type(self).__name__}: a backend must set `name` and `kv_connector`")
        reason, trace = self._availability()
        if reason and self.own:
            pytest.fail(f"{self.name}: kvconnectors' own connector cannot be imported or constructed (a defect, "
                        f"not a skip): {reason}" + (f"\n{trace}" if trace else ""), pytrace=False)
        if reason:
            pytest.skip(f"{self.name}: unavailable here: {reason}")
        area = area_of(type(self), base)
        for key in (test, base, area):  # precise known reasons first
            if key and key in self.skips:
                pytest.skip(f"{self.name}: {self.skips[key]}")
        fn = getattr(request, "function", None)
        if fn is not None:
            for cap in missing(self.capabilities, fn):
                pytest.skip(skip_reason(self.name, cap))
        for key in (test, base):
            if key in self.xfail:
                # Strict, and only for assertion failures: a crash is not the known issue.
                request.applymarker(pytest.mark.xfail(reason=f"{self.name}: known issue: {self.xfail[key]}",
                                                      strict=True, raises=AssertionError))
                break

    _unavailable_memo: ClassVar[dict[type, tuple[str | None, str]]] = {}

    def _availability(self) -> tuple[str | None, str]:
        """(why this backend cannot run here, or None; the traceback summary when an exception
        said so), once per backend class. An own backend first imports every connector class it
        configures, raising, so its failure carries the traceback."""
        memo = ConnectorBackend._unavailable_memo
        cls = type(self)
        if cls not in memo:
            try:
                if self.own:
                    self.connector_classes()
                memo[cls] = (self.unavailable(), "")
            except Exception as exc:  # noqa: BLE001 - the reason is the report
                memo[cls] = (f"{type(exc).__name__}: {exc}", _traceback_summary(exc))
        return memo[cls]

    # ---------------------------------------------------------------- configuration
    def extra_config(self, role: str) -> dict[str, Any]:
        """`kv_connector_extra_config` for an engine of this role."""
        return {}

    def kv_transfer_config(self, role: str, *, policy: str = "fail",
                           extra: dict[str, Any] | None = None) -> dict[str, Any]:
        cfg: dict[str, Any] = {"kv_connector": self.kv_connector, "kv_role": role,
                               "kv_load_failure_policy": policy,
                               "kv_connector_extra_config": {**self.extra_config(role), **(extra or {})}}
        if self.module_path:
            cfg["kv_connector_module_path"] = self.module_path
        return cfg

    def environment(self, role: str, instance: str) -> dict[str, str]:
        """Environment variables an engine of this role needs (e.g. distinct side-channel
        ports when two engines live in one process); applied while its objects are built and
        stepped."""
        return {}

    def connector_class(self) -> type:
        from vllm.config import KVTransferConfig
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        return KVConnectorFactory.get_connector_class(KVTransferConfig(
            kv_connector=self.kv_connector, kv_connector_module_path=self.module_path, kv_role="kv_both"))

    def connector_classes(self) -> list[type]:
        """Every connector class this backend configures: the top-level one and, for a
        MultiConnector, each child in `kv_connector_extra_config["connectors"]` (vLLM imports
        those only when it builds the connector)."""
        from vllm.config import KVTransferConfig
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        cfg = self.kv_transfer_config(self.scheduler_role)
        specs = [cfg, *cfg.get("kv_connector_extra_config", {}).get("connectors", [])]
        return [KVConnectorFactory.get_connector_class(KVTransferConfig(
            kv_connector=spec["kv_connector"], kv_connector_module_path=spec.get("kv_connector_module_path"),
            kv_role="kv_both")) for spec in specs]

    def unavailable(self) -> str | None:
        """Why this backend cannot run at all here (None = it can). Default: the connector
        class must import. Precise reasons only: the exception as raised."""
        try:
            self.connector_class()
        except Exception as exc:  # noqa: BLE001
            return f"{type(exc).__name__}: {exc}"
        return None

    # ---------------------------------------------------------------- scheduler side
    def scheduler(self, role: str | None = None, *, policy: str = "fail", name: str = "engine",
                  extra: dict[str, Any] | None = None) -> Any:
        """A `SchedulerHarness` with this connector's scheduler side (closed at teardown by
        the mixins' `sched` fixtures)."""
        from kvconnectors.conformance.harness import SchedulerHarness, create_vllm_config

        cfg = create_vllm_config(self.kv_transfer_config(role or self.scheduler_role, policy=policy, extra=extra),
                                 block_size=self.block_size)
        h = SchedulerHarness(cfg, name=name)
        try:
            self.prepare_scheduler(h)
        except BaseException:
            h.close()
            raise
        return h

    def prepare_scheduler(self, harness: Any) -> None:
        """Called once after the scheduler is built (e.g. hand it worker handshake metadata)."""

    def producer_params(self) -> dict[str, Any] | None:
        """kv_transfer_params of a prefill (producer) request, as a P/D proxy sends them."""
        return {"do_remote_decode": True}

    def prepare_consumer(self, harness: Any, prompt: list[int]) -> dict[str, Any] | None:
        """Make `prompt` loadable by `harness`'s connector and return the kv_transfer_params a
        consumer request must carry (None if it needs none, e.g. a content-addressed store).

        Default: run the producer path in the same scheduler (kv_both) and return the params
        `request_finished` handed back; blocks the connector held are released as its worker
        would after the consumer read them."""
        from kvconnectors.conformance.harness import create_request

        rid = f"producer-{next(self._seq)}"
        harness.add(create_request(rid, prompt, max_tokens=1, kv_transfer_params=self.producer_params()))
        harness.run_until(lambda: rid in harness.finished, f"producer request {rid} to finish",
                          timeout_s=self.timeout_s)
        params = harness.finished[rid].kv_transfer_params
        harness.finish_held()
        assert params, (f"{self.name}: producer request finished with kv_transfer_params={params!r}, expected "
                        "the params a consumer needs (override prepare_consumer if the connector needs none)")
        return dict(params)

    def consumer_params(self, producer_params: dict[str, Any] | None, *, sent: dict[str, Any] | None = None,
                        producer: Any = None) -> dict[str, Any] | None:
        """What a P/D proxy forwards to the consumer: by default the params the producer's
        response carried. `sent` is what the producer request carried, `producer` the producer
        engine (an `EngineHarness` in worker tests), for proxies that inject params themselves."""
        return producer_params

    def release_worker(self, worker: Any) -> None:
        """Called after a worker-side connector's shutdown(): free what shutdown() leaves alive
        (e.g. transport agents whose progress threads would keep spinning). Default: nothing."""

    def worker_context(self) -> Any:
        """A context manager held while worker-side connector objects live in this process
        (e.g. to stub a device query on the CPU platform). Default: nothing."""
        import contextlib

        return contextlib.nullcontext()

    def expected_load_tokens(self, prompt_len: int) -> int | None:
        """How many tokens a consumer of a `prompt_len` prompt should get from the connector
        (None = any positive number)."""
        return None

    # ---------------------------------------------------------------- worker side
    def engine_pair(self, *, policy: str = "fail", producer_extra: dict[str, Any] | None = None,
                    consumer_extra: dict[str, Any] | None = None) -> tuple[Any, Any]:
        """Producer and consumer `EngineHarness`es (scheduler + worker connector + CPU caches)."""
        from kvconnectors.conformance.workers import EngineHarness

        producer = EngineHarness(self, self.producer_role, name="producer", seed=1, policy=policy,
                                 extra=producer_extra)
        try:
            consumer = EngineHarness(self, self.consumer_role, name="consumer", seed=2, policy=policy,
                                     extra=consumer_extra)
        except BaseException:
            producer.close()
            raise
        return producer, consumer

    def fault_extra(self) -> dict[str, Any] | None:
        """Producer-side extra config that makes every consumer load fail in a way the connector
        detects (None = the backend has no fault hook)."""
        return None

    def fault_params(self, params: dict[str, Any] | None) -> dict[str, Any] | None:
        """Consumer params rewritten so that the load fails in a way the connector detects,
        for connectors without a configurable fault hook. Return None if there is no such
        rewrite (the default). The producer is then left holding its blocks until its own
        timeout, so tests using this skip the producer-side leak check."""
        return None

    def corrupt_extra(self) -> dict[str, Any] | None:
        """Extra config (both roles) under which transferred bytes are corrupted *undetected*,
        for negative controls (None = no such hook)."""
        return None

    # ---------------------------------------------------------------- engines
    def run_pd(self, model: str, prompts: list[list[int]], max_tokens: int, *, fault: str | None = None,
               policy: str = "fail", workdir: Path) -> Any:
        """Prefill every prompt on a producer, decode on a consumer; return a `PDRun`.
        `fault`: None, "corrupt" (bytes changed undetected) or "fail" (loads fail detectably).
        Default: one in-process engine with kv_role `engine_role` (kvconnectors.testing.pd)."""
        from kvconnectors.conformance.engine_runs import one_engine_pd

        if self.capabilities.needs_two_engines:
            pytest.skip(f"{self.name}: declares needs_two_engines but its backend overrides no run_pd hook to run "
                        "a live producer/consumer pair (see engine_runs.server_pd)")

        return one_engine_pd(self, model, prompts, max_tokens, fault=fault, policy=policy)


def _traceback_summary(exc: BaseException, frames: int = 8) -> str:
    """The innermost `frames` frames and the exception line: enough to see where it was raised."""
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__, limit=-frames)).rstrip()
