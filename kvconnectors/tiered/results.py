"""The worker's results sink: which loads are done or failed, and the stats of everything.

Pull threads report each load's end here (`finish`), every part records its counters here
(`record`), and the forward thread takes them (`take`, `report`) for vLLM: done loads at once,
a failure one step later (client_errors.py). One lock, because all of them write concurrently.
"""

from __future__ import annotations

import threading

from kvconnectors.errors import TransferError
from kvconnectors.logs import get_logger
from kvconnectors.tiered.stats import TieredStats

logger = get_logger(__name__)


class LoadResults:
    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._ready = threading.Condition(self._lock)  # a load finished or failed
        self._done: set[str] = set()
        self._failed: dict[str, TransferError] = {}
        self._failed_ready: dict[str, TransferError] = {}  # reported at the next take
        self.stats = TieredStats()    # this interval's, handed to vLLM and reset
        self.totals = TieredStats()   # since start-up: what tests and diagnostics read
        self.inflight = 0

    def started(self) -> None:
        with self._lock:
            self.inflight += 1

    def finish(self, req_id: str, error: TransferError | None, bytes_by_path: dict[str, int] | None = None,
               seconds: float = 0.0) -> None:
        with self._lock:
            self.inflight -= 1
            if error is None:
                self._done.add(req_id)
                self.record("record_transfer", bytes_by_path or {}, seconds)
            else:
                self._failed[req_id] = error
                self.record("record_failure", error.cause.value)
                self.record("record_error", req_id, error.cause.value, error.detail)
            self._ready.notify_all()
        if error is not None:
            logger.error("KV load for request %s failed: %s", req_id, error)

    def record(self, what: str, *args: object) -> None:
        """Call TieredStats.`what`(*args) on this interval's stats and the totals."""
        with self._lock:  # the forward thread, the pull threads and the push sender all record
            for stats in (self.stats, self.totals):
                getattr(stats, what)(*args)

    def take(self, wait_s: float = 0.0) -> tuple[set[str], dict[str, TransferError]]:
        """Loads done now, and loads failed by the previous call: a failure's cause rides this
        step's stats to the API server, which must have it before the request's error output
        (client_errors.py); one engine step later, on failures only.

        `wait_s` (a step with nothing scheduled, only waiting on loads): wait that long at most for
        a load to finish. Without it the engine loops on empty steps; each one wakes every rank and
        its EngineCore (vLLM's shm queues spin with sched_yield for 1 s after a read), so a TP-2
        decode kept both cores of a 2-vCPU host busy and the producer's store server on one of them
        could not answer a read for seconds (tests/e2e/test_tp_servers.py)."""
        with self._lock:
            if wait_s > 0 and self.inflight > 0 and not (self._done or self._failed or self._failed_ready):
                self._ready.wait(wait_s)
            done, failed = self._done, self._failed_ready
            self._done, self._failed_ready, self._failed = set(), self._failed, {}
        return done, failed

    def report(self, store: dict | None) -> TieredStats | None:
        """This interval's stats for vLLM (with the store's report when it changed), then reset."""
        with self._lock:
            if store is not None:
                self.stats.data["store"] = store
            return None if self.stats.is_empty() else self.stats.clone_and_reset()
