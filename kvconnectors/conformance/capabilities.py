"""What a connector declares it can do, and how tests ask for it.

A backend declares `capabilities = Capabilities(...)` as a *class attribute* (not a fixture: a
fixture overridden by a plain method is silently ignored, the s3fs hazard). A test that needs a
capability is decorated with `@requires("async_load")`; on a backend that does not declare it
the test is skipped with a reason that names the backend and the capability:

    "ExampleConnector: capability 'async_load' not declared (loads that complete between steps ...)"

Declarations cannot lie silently: `SchedulerContractTests.test_declared_capabilities_hold`
checks the ones observable without an engine (hma, async_load).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

REQUIRES_ATTR = "_conformance_requires"


@dataclass(frozen=True)
class Capabilities:
    """One flag per optional behaviour of a `KVConnectorBase_V1`. Defaults are the conservative
    "not declared"; `runs_on_cpu` defaults to True because the suite's own harness is CPU-only."""

    async_load: bool = False
    layerwise_load: bool = False
    pd_push: bool = False
    pd_pull: bool = False
    failure_reporting: bool = False
    hma: bool = False
    runs_on_cpu: bool = True
    needs_two_engines: bool = False

    def declared(self) -> list[str]:
        return [f.name for f in dataclasses.fields(self) if getattr(self, f.name)]

    def has(self, name: str) -> bool:
        if name not in CAPABILITY_DOCS:
            raise KeyError(f"unknown capability {name!r}; known: {', '.join(CAPABILITY_DOCS)}")
        return bool(getattr(self, name))


CAPABILITY_DOCS: dict[str, str] = {
    "async_load": "get_num_new_matched_tokens may return load_async=True: the request waits in "
                  "WAITING_FOR_REMOTE_KVS until the worker reports it in finished_recving",
    "layerwise_load": "wait_for_layer_load / save_kv_layer move KV layer by layer, overlapping compute",
    "pd_push": "the producer writes KV into the consumer's blocks",
    "pd_pull": "request_finished returns kv_transfer_params; a consumer request carrying them pulls "
               "the KV from the producer",
    "failure_reporting": "failed loads are reported to the scheduler (failed_recving or "
                         "get_block_ids_with_load_errors) so kv_load_failure_policy applies",
    "hma": "implements SupportsHMA (hybrid KV cache manager)",
    "runs_on_cpu": "the worker side works with host (CPU) KV caches on vLLM's CPU platform",
    "needs_two_engines": "a consumer cannot load from a producer in the same engine (kv_both is not "
                         "enough): end-to-end runs need two live engines",
}


def requires(*names: str) -> Callable[[F], F]:
    """Mark a conformance test as needing every capability in `names`."""
    for n in names:
        if n not in CAPABILITY_DOCS:
            raise KeyError(f"unknown capability {n!r}; known: {', '.join(CAPABILITY_DOCS)}")

    def deco(fn: F) -> F:
        setattr(fn, REQUIRES_ATTR, tuple(getattr(fn, REQUIRES_ATTR, ())) + names)
        return fn
    return deco


def missing(capabilities: Capabilities, fn: Callable[..., Any]) -> list[str]:
    return [n for n in getattr(fn, REQUIRES_ATTR, ()) if not capabilities.has(n)]


def skip_reason(backend_name: str, capability: str) -> str:
    return f"{backend_name}: capability {capability!r} not declared ({CAPABILITY_DOCS[capability]})"


# ------------------------------------------------------------------------------------ areas

AREA_ATTR = "conformance_area"
AREAS: dict[str, str] = {
    "scheduler_contract": "vLLM's real Scheduler with the connector's scheduler side, fake worker outputs",
    "worker_transfer": "real CPU KV tensors through the connector's worker side, producer to consumer",
    "engine": "real vLLM engines on CPU with the tiny model (marker `engine`)",
    "failure_reporting": "load failures reach the scheduler and kv_load_failure_policy is honoured",
}


def area_of(cls: type, test_name: str) -> str | None:
    """The area of test `test_name` on `cls`: the `conformance_area` of the mixin defining it."""
    for klass in getattr(cls, "__mro__", ()):
        if test_name in vars(klass):
            return vars(klass).get(AREA_ATTR)
    return None
