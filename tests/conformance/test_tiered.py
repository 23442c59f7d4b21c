"""TieredConnector (kvconnectors' own) against every conformance area."""

from kvconnectors.conformance import (EngineEndToEndTests, FailureReportingTests, SchedulerContractTests,
                                      WorkerTransferTests)
from kvconnectors.conformance.backends import TieredBackend


class TestTiered(TieredBackend, SchedulerContractTests, WorkerTransferTests, EngineEndToEndTests,
                 FailureReportingTests):
    pass
