"""A background thread that calls `expire_now()` every `interval_s`, so expired entries give their
memory back (and show up in the metrics) even when no other call touches the store. Correctness
does not depend on it: every store call expires lazily first, and create() always does."""

from __future__ import annotations

import threading
from typing import Callable

from kvconnectors.logs import get_logger
from kvconnectors.store.errors import StoreClosedError

log = get_logger(__name__)


class Reaper:
    def __init__(self, store: "object", interval_s: float = 1.0,
                 on_expired: Callable[[list[str]], None] | None = None):
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self._store, self._interval, self._on_expired = store, interval_s, on_expired
        self._stop = threading.Event()  # waits, never spins
        self._thread = threading.Thread(target=self._run, name="kvc-store-reaper", daemon=True)

    def start(self) -> "Reaper":
        self._thread.start()
        return self

    def stop(self, timeout: float | None = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def __enter__(self) -> "Reaper":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                keys = self._store.expire_now()  # type: ignore[attr-defined]
            except StoreClosedError:
                return
            except Exception:  # noqa: BLE001 - a reaper that dies silently leaks memory; keep going
                log.exception("store reaper: expire_now failed")
                continue
            if keys and self._on_expired is not None:
                self._on_expired(keys)
