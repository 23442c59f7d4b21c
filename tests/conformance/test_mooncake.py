"""vLLM's MooncakeConnector over the TCP TransferEngine. Its worker queries an accelerator at
construction; on a CPU-only host the worker-transfer area stubs that query in-process (see
MOONCAKE_DEVICE_QUERY in kvconnectors/conformance/backends.py), and the engine area, which
cannot be stubbed, skips with that reason (it runs on a GPU machine)."""

from kvconnectors.conformance import (EngineEndToEndTests, FailureReportingTests, SchedulerContractTests,
                                      WorkerTransferTests)
from kvconnectors.conformance.backends import MooncakeBackend


class TestMooncake(MooncakeBackend, SchedulerContractTests, WorkerTransferTests, EngineEndToEndTests,
                   FailureReportingTests):
    pass
