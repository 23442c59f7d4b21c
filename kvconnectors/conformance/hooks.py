"""What the engine and worker runners need of a connector's backend (fixtures.ConnectorBackend).

A Protocol, so the runners (engine_runs.py, workers.py) depend on this description and not on
the backend class, whose methods call the runners: calls flow from the backend down to them.
"""

from __future__ import annotations

from typing import Any, Protocol


class BackendHooks(Protocol):
    name: str
    block_size: int
    producer_role: str
    consumer_role: str
    engine_role: str

    def kv_transfer_config(self, role: str, *, policy: str = "fail",
                           extra: dict[str, Any] | None = None) -> dict[str, Any]: ...

    def environment(self, role: str, instance: str) -> dict[str, str]: ...

    def producer_params(self) -> dict[str, Any] | None: ...

    def consumer_params(self, producer_params: dict[str, Any] | None, *, sent: dict[str, Any] | None = None,
                        producer: Any = None) -> dict[str, Any] | None: ...

    def release_worker(self, worker: Any) -> None: ...

    def fault_extra(self) -> dict[str, Any] | None: ...

    def fault_params(self, params: dict[str, Any] | None) -> dict[str, Any] | None: ...

    def corrupt_extra(self) -> dict[str, Any] | None: ...
