"""kvconnectors.conformance: a conformance suite any vLLM `KVConnectorBase_V1` can be run against.

Shipped inside the package (zarr / fsspec style), so a third party imports it instead of
vendoring a copy. Opt in with one backend class plus the area mixins you want:

    from kvconnectors.conformance import (Capabilities, ConnectorBackend, SchedulerContractTests,
                                          WorkerTransferTests, EngineEndToEndTests, FailureReportingTests)

    class MyBackend(ConnectorBackend):
        name = "MyConnector"; kv_connector = "MyConnector"; module_path = "my_pkg.connector"
        capabilities = Capabilities(async_load=True, pd_pull=True, failure_reporting=True)
        xfail = {"test_block_edge_prompt_is_found": "https://github.com/me/my_pkg/issues/7: off by one"}

    class TestMyConnector(MyBackend, SchedulerContractTests, WorkerTransferTests,
                          EngineEndToEndTests, FailureReportingTests):
        pass

Areas: scheduler_contract, worker_transfer, engine (marker `engine`), failure_reporting.
Run: `pytest --pyargs kvconnectors.conformance` (TieredConnector by default, or set
KVCONNECTORS_CONFORMANCE_BACKEND=NAME|module:Class) or `kvconnectors conformance --connector ...`.
See docs/conformance.md. Importing this package is cheap: vLLM is imported by the tests only.
"""

from __future__ import annotations

import importlib
from typing import Any

from kvconnectors._version import SUPPORTED_VLLM

SUITE_VERSION = "2026.11"

_EXPORTS = {
    "Capabilities": "kvconnectors.conformance.capabilities",
    "requires": "kvconnectors.conformance.capabilities",
    "CAPABILITY_DOCS": "kvconnectors.conformance.capabilities",
    "AREAS": "kvconnectors.conformance.capabilities",
    "ConnectorBackend": "kvconnectors.conformance.fixtures",
    "load_backend": "kvconnectors.conformance.backends",
    "SchedulerContractTests": "kvconnectors.conformance.scheduler_contract",
    "WorkerTransferTests": "kvconnectors.conformance.worker_transfer",
    "EngineEndToEndTests": "kvconnectors.conformance.engine_e2e",
    "FailureReportingTests": "kvconnectors.conformance.failure_reporting",
    "SchedulerHarness": "kvconnectors.conformance.harness",
    "EngineHarness": "kvconnectors.conformance.workers",
    "ALL_AREAS": "kvconnectors.conformance.suites",
}

__all__ = sorted(_EXPORTS) + ["SUITE_VERSION", "SUPPORTED_VLLM"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvconnectors.conformance' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
