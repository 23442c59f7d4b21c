"""TieredConnector (kvconnectors' own) against every conformance area."""

from kvconnectors.conformance import (EngineEndToEndTests, FailureReportingTests, SchedulerContractTests,
                                      WorkerTransferTests)
from kvconnectors.conformance.backends import TieredBackend
from kvconnectors.conformance.worker_transfer import run_transfer
from kvconnectors.testing.prompts import token_prompts


class TestTiered(TieredBackend, SchedulerContractTests, WorkerTransferTests, EngineEndToEndTests,
                 FailureReportingTests):
    def test_kv_arrives_intact_when_no_layer_hook_runs(self, pair) -> None:
        """A replayed full CUDA graph runs no per-layer hook (save_kv_layer): the producer stages
        the step's layers in wait_for_save instead, so pull mode keeps full graphs and stays exact."""
        producer, consumer = pair
        producer.layer_hooks = False
        prompts = token_prompts(list(self.prompt_lengths), seed=31)
        t = run_transfer(self, producer, consumer, prompts)
        self._check_landings(t, producer, require_load=set(range(len(prompts))))
        assert not t.failed_recving and not t.invalid_block_ids
