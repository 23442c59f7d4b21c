"""Where kvconnectors' log records go: through vLLM's logging inside vLLM, plain `logging` elsewhere.

Every module logs through `get_logger(__name__)`, a logger under "kvconnectors". Outside vLLM (the
proxy, the CLI, benchmarks, tests) these are plain loggers: records propagate to the root logger and
whatever the program configured there. Inside vLLM, `use_vllm_logging()` runs once per process (from
the plugin entry point, registry.py): the "kvconnectors" logger then hands each record to vLLM's
"vllm" logger, so it comes out through vLLM's handler and format (process name, pid, level, time,
file:line) and is kept or dropped by vLLM's level (VLLM_LOGGING_LEVEL, `--log-level`), like vLLM's
own lines; the store's summary line (INFO) appears in `vllm serve` logs.

Why a forwarding handler rather than loggers named "vllm.kvconnectors.*": the names stay the same in
every process whatever was imported first (the store and transport packages never import vLLM, and a
name chosen by `"vllm" in sys.modules` would depend on import order); a program can still configure
"kvconnectors" itself; and vLLM's logger is looked up when a record is logged. That last point is
needed, not a nicety: `vllm serve` loads plugins while it builds its argument parser and configures
logging (handler, format, `--log-level`) only after, so there is nothing to copy at plugin time; and a
later dictConfig replaces vLLM's handler. This module never imports vLLM: it finds its logger by name.
"""

from __future__ import annotations

import logging
import threading
import time

ROOT = "kvconnectors"
VLLM = "vllm"

_lock = threading.Lock()


def get_logger(name: str) -> logging.Logger:
    """The logger of module `name` (pass `__name__`), which must be under "kvconnectors": a logger
    outside it would bypass vLLM's logging inside vLLM."""
    if name != ROOT and not name.startswith(ROOT + "."):
        raise ValueError(f"logger name {name!r} is not under {ROOT!r}: its records would bypass vLLM's "
                         f"logging; use a name that starts with '{ROOT}.'")
    return logging.getLogger(name)


class ToVllm(logging.Handler):
    """Hands each record to vLLM's logger, which decides (its level now) and formats (its handlers)."""

    def handle(self, record: logging.LogRecord) -> logging.LogRecord | bool:
        # No lock of our own: vLLM's handlers take theirs; ours would serialise every kvconnectors line.
        target = logging.getLogger(VLLM)
        if not target.isEnabledFor(record.levelno) or not self.filter(record):
            return False
        target.handle(record)
        return record

    def emit(self, record: logging.LogRecord) -> None:
        self.handle(record)


def use_vllm_logging() -> bool:
    """Route "kvconnectors" records through vLLM's logger in this process (idempotent). False, and
    nothing changed, when the program configured the "kvconnectors" logger itself (a handler or a
    level): its own setup wins."""
    root = logging.getLogger(ROOT)
    with _lock:
        if any(isinstance(h, ToVllm) for h in root.handlers):
            return True
        if root.handlers or root.level != logging.NOTSET:
            return False
        root.addHandler(ToVllm())
        # Let every record reach ToVllm, which applies vLLM's level when the record is logged: a
        # level copied now would miss the API server's logging config, applied after plugins load.
        root.setLevel(logging.DEBUG)
        # As vLLM's own logger: each line once, through vLLM's handler, not again through the root's.
        root.propagate = False
        return True


class LogLimiter:
    """At most one line per `interval_s` and key on `logger` (what a peer can provoke at will: refusals,
    failed logins); the next line says how many were left out."""

    def __init__(self, logger: logging.Logger, interval_s: float = 10.0):
        self.logger, self.interval_s = logger, interval_s
        self._state: dict[str, list[float]] = {}  # key -> [next allowed time, suppressed count]
        self._lock = threading.Lock()

    def log(self, level: int, key: str, msg: str, *args: object, exc_info: bool = False) -> bool:
        now = time.monotonic()
        with self._lock:
            st = self._state.get(key)
            if st is not None and now < st[0]:
                st[1] += 1
                return False
            left_out = int(st[1]) if st is not None else 0
            self._state[key] = [now + self.interval_s, 0]
        if left_out:
            msg += " (%d more like it in the last %.0f s not logged)"
            args = (*args, left_out, self.interval_s)
        self.logger.log(level, msg, *args, exc_info=exc_info)
        return True

    def warning(self, key: str, msg: str, *args: object, exc_info: bool = False) -> bool:
        return self.log(logging.WARNING, key, msg, *args, exc_info=exc_info)

    def info(self, key: str, msg: str, *args: object) -> bool:
        return self.log(logging.INFO, key, msg, *args)
