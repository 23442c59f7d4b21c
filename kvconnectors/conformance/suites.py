"""The area mixins in suite order, for composing a test class in one line."""

from __future__ import annotations

from kvconnectors.conformance.engine_e2e import EngineEndToEndTests
from kvconnectors.conformance.failure_reporting import FailureReportingTests
from kvconnectors.conformance.scheduler_contract import SchedulerContractTests
from kvconnectors.conformance.worker_transfer import WorkerTransferTests

ALL_AREAS: tuple[type, ...] = (SchedulerContractTests, WorkerTransferTests, EngineEndToEndTests,
                               FailureReportingTests)


def suite_class(backend: type, name: str | None = None) -> type:
    """`class Test<Name>(backend, *ALL_AREAS)`, for modules that build classes dynamically."""
    return type(name or f"Test{backend.__name__.removesuffix('Backend')}", (backend, *ALL_AREAS),
                {"__doc__": f"Every conformance area against {getattr(backend, 'name', backend.__name__)}.",
                 "__module__": backend.__module__})
