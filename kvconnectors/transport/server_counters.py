"""ServerCounters: what a store server counts, written by each of its parts (accept, handshake,
pull service, dispatch) and read by operators, StatusReply and the tests. One lock, its own."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass
class ServerCounters:
    connections: int = 0
    active_connections: int = 0
    auth_failures: int = 0
    integrity_failures: int = 0
    rejected: dict[str, int] = field(default_factory=dict)  # cause -> count
    bytes_sent: int = 0
    reads: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False, compare=False)

    def reject(self, cause: str) -> None:
        self.rejected[cause] = self.rejected.get(cause, 0) + 1

    def count_connection(self) -> None:
        with self._lock:
            self.connections += 1

    def count_auth_failure(self) -> None:
        with self._lock:
            self.auth_failures += 1

    def count_integrity_failure(self) -> None:
        with self._lock:
            self.integrity_failures += 1

    def count_read(self, nbytes: int) -> None:
        with self._lock:
            self.bytes_sent += nbytes
            self.reads += 1
