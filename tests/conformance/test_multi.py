"""Conformance run of Multi (see kvconnectors/conformance/backends.py for what it declares and why
some areas skip on a CPU-only host)."""

from kvconnectors.conformance import (EngineEndToEndTests, FailureReportingTests, SchedulerContractTests,
                                      WorkerTransferTests)
from kvconnectors.conformance.backends import MultiBackend


class TestMulti(MultiBackend, SchedulerContractTests, WorkerTransferTests, EngineEndToEndTests,
               FailureReportingTests):
    pass
