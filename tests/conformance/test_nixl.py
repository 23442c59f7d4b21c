"""vLLM's NixlConnector on CPU (UCX over loopback, kv_buffer_device cpu). Worker transfers run
two NIXL agents in this process; end-to-end runs need two live `vllm serve` servers."""

from kvconnectors.conformance import (EngineEndToEndTests, FailureReportingTests, SchedulerContractTests,
                                      WorkerTransferTests)
from kvconnectors.conformance.backends import NixlBackend


class TestNixl(NixlBackend, SchedulerContractTests, WorkerTransferTests, EngineEndToEndTests,
               FailureReportingTests):
    pass
