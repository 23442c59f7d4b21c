"""pytest plugin for the conformance suite: markers, area selection, a results file.

Load it with `pytest_plugins = ["kvconnectors.conformance.plugin"]` in a root conftest, or by
importing its hooks into any conftest (this package's conftest.py and tests/conformance do).
Every hook is idempotent, so being registered twice is harmless.

Environment (read by the hooks; set by `kvconnectors conformance`):
- KVCONNECTORS_CONFORMANCE_AREAS: comma-separated areas to keep (others are deselected);
- KVCONNECTORS_CONFORMANCE_RESULTS: write one JSON record per test there at session end.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from kvconnectors.transport.ucx_env import set_cpu_defaults

# Before vLLM is imported anywhere: in-process engines, no InfiniBand probing by UCX (NIXL).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
set_cpu_defaults()

ENV_AREAS = "KVCONNECTORS_CONFORMANCE_AREAS"
ENV_RESULTS = "KVCONNECTORS_CONFORMANCE_RESULTS"

_results: dict[str, dict[str, Any]] = {}
_areas: dict[str, str | None] = {}


def pytest_configure(config: Any) -> None:
    config.addinivalue_line("markers", "engine: builds real vLLM engines or servers (slow, serial)")
    if not config.pluginmanager.hasplugin("timeout"):
        config.addinivalue_line("markers", "timeout(seconds): per-test timeout (needs pytest-timeout)")


def item_area(item: Any) -> str | None:
    from kvconnectors.conformance.capabilities import area_of

    cls = getattr(item, "cls", None)
    if cls is None:
        return None
    return area_of(cls, getattr(item, "originalname", item.name))


# Backstop per area (pytest-timeout), for hangs below the suite's own bounded waits (e.g. a
# transport thread that never returns in a C extension). A test's own timeout mark wins.
AREA_TIMEOUT_S = {"scheduler_contract": 120, "worker_transfer": 180, "failure_reporting": 180, "engine": 900}


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    has_timeout = config.pluginmanager.hasplugin("timeout")
    for item in items:
        area = _areas[item.nodeid] = item_area(item)
        if has_timeout and area in AREA_TIMEOUT_S and item.get_closest_marker("timeout") is None:
            import pytest

            item.add_marker(pytest.mark.timeout(AREA_TIMEOUT_S[area]))
    wanted = {a.strip() for a in os.environ.get(ENV_AREAS, "").split(",") if a.strip()}
    if not wanted:
        return
    keep, drop = [], []
    for item in items:
        (keep if _areas.get(item.nodeid) in wanted else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def _reason(report: Any) -> str:
    lr = report.longrepr
    if isinstance(lr, tuple) and len(lr) == 3:   # skip: (path, line, "Skipped: why")
        return str(lr[2]).removeprefix("Skipped: ")
    crash = getattr(lr, "reprcrash", None)
    if crash is not None and getattr(crash, "message", None):
        return str(crash.message)
    text = str(lr or "").strip()
    return text.splitlines()[-1] if text else ""


def pytest_runtest_logreport(report: Any) -> None:
    rec = _results.setdefault(report.nodeid, {
        "nodeid": report.nodeid, "test": report.nodeid.split("::")[-1], "area": _areas.get(report.nodeid),
        "outcome": None, "reason": "", "duration_s": 0.0})
    rec["duration_s"] = round(rec["duration_s"] + float(getattr(report, "duration", 0.0) or 0.0), 3)
    wasxfail = getattr(report, "wasxfail", None)
    if report.when == "setup":
        if report.skipped:
            rec.update(outcome="xfailed" if wasxfail is not None else "skipped",
                       reason=wasxfail if wasxfail is not None else _reason(report))
        elif report.failed:
            rec.update(outcome="error", reason=_reason(report))
    elif report.when == "call":
        if wasxfail is not None and report.skipped:
            rec.update(outcome="xfailed", reason=str(wasxfail))
        elif report.skipped:
            rec.update(outcome="skipped", reason=_reason(report))
        elif report.failed:
            text = str(report.longrepr or "")
            rec.update(outcome="failed", reason=("unexpected pass of a strict xfail: " + text.split("] ", 1)[-1])
                       if text.startswith("[XPASS(strict)]") else _reason(report))
        else:
            rec.update(outcome="passed", reason="")
    elif report.when == "teardown" and report.failed and rec["outcome"] in (None, "passed"):
        rec.update(outcome="error", reason="teardown: " + _reason(report))


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    path = os.environ.get(ENV_RESULTS)
    if path:
        Path(path).write_text(json.dumps(list(_results.values()), indent=1))
