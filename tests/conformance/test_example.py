"""vLLM's ExampleConnector (content-addressed safetensors store, synchronous loads)."""

from kvconnectors.conformance import (EngineEndToEndTests, FailureReportingTests, SchedulerContractTests,
                                      WorkerTransferTests)
from kvconnectors.conformance.backends import ExampleBackend


class TestExample(ExampleBackend, SchedulerContractTests, WorkerTransferTests, EngineEndToEndTests,
                  FailureReportingTests):
    pass
