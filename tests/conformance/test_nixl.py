"""vLLM's NixlConnector on CPU (UCX over loopback, kv_buffer_device cpu). Worker transfers run
two NIXL agents in this process; end-to-end runs need two live `vllm serve` servers."""

from kvconnectors.conformance import (EngineEndToEndTests, FailureReportingTests, SchedulerContractTests,
                                      WorkerTransferTests)
from kvconnectors.conformance.backends import NixlBackend


# FailureReportingTests before EngineEndToEndTests: pytest collects base classes in reverse MRO, so
# the identity test runs first and its pair (policy fail) is kept for the fail-policy test after it.
class TestNixl(NixlBackend, SchedulerContractTests, WorkerTransferTests, FailureReportingTests,
               EngineEndToEndTests):
    pass
