"""kvconnectors' records go through vLLM's logging inside vLLM, and are plain records elsewhere.

In-process tests use a stand-in for vLLM's logging setup (a handler with a format on the "vllm"
logger, which does not propagate, as vLLM configures it); the subprocess tests run the real plugin
entry point with vLLM's own logging configuration.
"""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvconnectors import logs
from kvconnectors.store import reaper
from kvconnectors.tiered import prom, worker
from kvconnectors.transport import server

REPO = Path(__file__).resolve().parents[2]
FORMAT = "%(levelname)s %(name)s pid=%(process)d %(message)s"


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def loggers():
    """The "kvconnectors" logger as a program leaves it, "vllm" as vLLM configures it (its handler
    writes to `out`), and a handler on the root logger; all three put back as they were after."""
    names = (logs.ROOT, logs.VLLM, "")
    saved = [(lg, lg.handlers[:], lg.level, lg.propagate, lg.disabled) for lg in map(logging.getLogger, names)]
    ours, vllm, root = (logging.getLogger(n) for n in names)
    ours.handlers, ours.propagate, ours.disabled = [], True, False
    ours.setLevel(logging.NOTSET)
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter(FORMAT))
    vllm.handlers, vllm.propagate, vllm.disabled = [handler], False, False
    vllm.setLevel(logging.INFO)
    at_root = Records()
    root.addHandler(at_root)
    try:
        yield out, vllm, at_root
    finally:
        for lg, handlers, level, propagate, disabled in saved:
            lg.handlers, lg.propagate, lg.disabled = handlers, propagate, disabled
            lg.setLevel(level)


@pytest.mark.parametrize("module", [worker, server, reaper, prom], ids=lambda m: m.__name__)
def test_inside_vllm_a_record_comes_out_through_vllms_handler(loggers, module) -> None:
    """The store's summary line (INFO) of a worker comes out once, in vLLM's format, at vLLM's level;
    vLLM's level set after the plugin loaded (the API server's --log-level) is followed.

    Seen to fail: without `root.setLevel(logging.DEBUG)` in use_vllm_logging the INFO line was
    missing (the root's WARNING applied); without `propagate = False` the root handler got it too;
    with the level of vLLM's logger not checked in ToVllm.handle, the DEBUG line came out at INFO."""
    out, vllm, at_root = loggers
    logger = getattr(module, "logger", None) or module.log
    name = module.__name__
    assert logs.use_vllm_logging()
    logger.info("TieredConnector store: %s DRAM, serving %s:%d", "1 GiB", "127.0.0.1", 8100)
    logger.debug("not at INFO")
    line = "TieredConnector store: 1 GiB DRAM, serving 127.0.0.1:8100"
    assert out.getvalue() == f"INFO {name} pid={os.getpid()} {line}\n"
    assert at_root.records == [], "a record went out twice: through vLLM's handler and the root's"

    vllm.setLevel(logging.DEBUG)
    logger.debug("now at DEBUG")
    assert out.getvalue().endswith(f"DEBUG {name} pid={os.getpid()} now at DEBUG\n")


def test_outside_vllm_a_plain_logger(loggers) -> None:
    """Without the bridge (proxy, CLI, benchmarks) records go to the root logger, not to vLLM's.

    Seen to fail: with get_logger returning logging.getLogger("vllm." + name), the record reached
    vLLM's handler and not the root's."""
    out, _, at_root = loggers
    logs.get_logger("kvconnectors.proxy").warning("plain")
    assert [r.getMessage() for r in at_root.records] == ["plain"]
    assert out.getvalue() == ""


def test_use_vllm_logging_is_idempotent_and_a_programs_own_setup_wins(loggers) -> None:
    """Seen to fail: without the isinstance check the second call returned False (its own handler read
    as a program's setup); without the check for a configured logger, the bridge replaced the
    program's setup (use_vllm_logging returned True)."""
    out, _, _ = loggers
    ours = logging.getLogger(logs.ROOT)
    assert logs.use_vllm_logging() and logs.use_vllm_logging()
    assert sum(isinstance(h, logs.ToVllm) for h in ours.handlers) == 1
    logs.get_logger("kvconnectors.x").warning("once")
    assert out.getvalue().count("once") == 1

    ours.handlers = [Records()]
    ours.setLevel(logging.NOTSET)
    ours.propagate = True
    assert not logs.use_vllm_logging()
    assert not any(isinstance(h, logs.ToVllm) for h in ours.handlers) and ours.propagate


def test_get_logger_refuses_a_name_outside_kvconnectors() -> None:
    """Seen to fail: with the prefix check removed, no error was raised."""
    with pytest.raises(ValueError, match="'integration.cluster' is not under 'kvconnectors'"):
        logs.get_logger("integration.cluster")
    with pytest.raises(ValueError, match="kvconnectorsx"):
        logs.get_logger("kvconnectorsx.a")
    assert logs.get_logger("kvconnectors").name == "kvconnectors"


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]), **env}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=environ, timeout=300, cwd=REPO)


def test_store_transport_and_the_logging_helper_import_no_vllm() -> None:
    """The store and transport packages stay vLLM-free (logs.py finds vLLM's logger by name), and the
    plugin's own modules import vLLM only when they run.

    Seen to fail: with `import vllm.logger` at the top of logs.py, 'vllm' was in sys.modules."""
    proc = _python("""
        import sys
        import kvconnectors.logs, kvconnectors.registry, kvconnectors.tiered.client_errors
        import kvconnectors.tiered.metrics, kvconnectors.store
        import kvconnectors.transport.server, kvconnectors.transport.push, kvconnectors.transport.client
        print(sorted(m for m in sys.modules if m == "vllm" or m.startswith("vllm.")))
    """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[]", proc.stdout


def test_the_plugin_entry_point_sets_up_a_vllm_process() -> None:
    """vLLM's real logging setup and hook: with the entry point run and vLLM's logging configured
    after it (the API server's order), the store's summary line comes out at INFO in vLLM's format
    on vLLM's stream, the client-errors hook is patched, and the connector itself is not imported (a
    vLLM process that does not use it must not pay for it or fail on it).

    Seen to fail: with `logs.use_vllm_logging()` left out of registry.setup_process, stdout had no
    summary line (it went to the root logger, which had no handler: nothing printed at INFO)."""
    proc = _python("""
        import os, sys
        from kvconnectors.registry import register_with_vllm
        register_with_vllm()
        # as `vllm serve`: plugins load while the parser is built, logging is configured after
        from vllm.config.logging import LoggingConfig
        from vllm.logger import configure_logging
        configure_logging(LoggingConfig(log_level="INFO"))
        from kvconnectors.tiered import client_errors
        from vllm.entrypoints.generate.base.serving import GenerateBaseServing
        from kvconnectors.logs import get_logger
        get_logger("kvconnectors.tiered.worker").info("TieredConnector store: 1 GiB DRAM, serving h:1")
        print("pid", os.getpid())
        print("patched", getattr(GenerateBaseServing._raise_if_error, client_errors._MARK, False))
        print("connector imported", "kvconnectors.tiered.connector" in sys.modules)
    """, VLLM_CONFIGURE_LOGGING="1", VLLM_LOGGING_LEVEL="INFO", VLLM_LOGGING_STREAM="ext://sys.stdout",
        VLLM_LOGGING_COLOR="0", NO_COLOR="1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    pid = next(line.split()[1] for line in lines if line.startswith("pid "))
    summary = [line for line in lines if "TieredConnector store: 1 GiB DRAM, serving h:1" in line]
    assert len(summary) == 1, proc.stdout[-3000:]
    assert f"pid={pid}) INFO " in summary[0] and "[<string>:" in summary[0], summary[0]  # vLLM's format
    assert "patched True" in lines and "connector imported False" in lines, proc.stdout[-3000:]
