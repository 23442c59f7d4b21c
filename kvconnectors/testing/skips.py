"""No silent skips: a pytest session fails when a test skips for a reason that no pattern of a
committed allowlist accepts (issue #17, item 10).

A missing capability, package or host feature must not turn a suite green by skipping its tests:
every accepted skip is a written-down decision (tests/allowed_skips.txt), anything else fails the
session (exit status 1) and is listed in the terminal summary.

What counts as a skip: any test report (setup, call or teardown, so a `pytest.skip` raised in a
fixture counts) or collection report (module-level skip, `importorskip`) with outcome "skipped",
except xfails (they carry `wasxfail`; strict xfails are decisions recorded elsewhere). Deselected
tests never run, so they produce no report and are not skips.

Allowlist format: one regular expression per line, matched with `re.match` against the reason
(anchored at its start; end a pattern with `$` to pin the whole reason). Every pattern needs at
least one `#` comment line above it, in the same block (blank lines end a block), saying why the
skip is allowed; consecutive patterns share that comment. Catch-alls (`.*`, `.+`, a pattern that
matches an empty reason) are refused, so the file cannot allow arbitrary skips.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

PLUGIN_NAME = "kvconnectors-skip-allowlist"
CATCH_ALLS = (".*", ".+")


@dataclass(frozen=True)
class AllowedSkip:
    pattern: re.Pattern[str]
    why: str
    line: int


def parse_allowlist(text: str, source: str = "<allowlist>") -> list[AllowedSkip]:
    """The patterns of an allowlist file; ValueError names the line of any malformed entry."""
    entries: list[AllowedSkip] = []
    why: list[str] = []
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line:
            why = []  # a blank line ends a comment block
        elif line.startswith("#"):
            why.append(line[1:].strip())
        else:
            entries.append(AllowedSkip(_compile(line, f"{source}:{n}", why), " ".join(why), n))
    return entries


def _compile(line: str, where: str, why: list[str]) -> re.Pattern[str]:
    if not any(why):
        raise ValueError(f"{where}: pattern {line!r} has no '#' comment above it saying why the skip is allowed")
    if any(c in line for c in CATCH_ALLS):
        raise ValueError(f"{where}: pattern {line!r} contains a catch-all ({' or '.join(CATCH_ALLS)})")
    try:
        rx = re.compile(line)
    except re.error as exc:
        raise ValueError(f"{where}: pattern {line!r} is not a regular expression: {exc}") from exc
    if rx.match(""):
        raise ValueError(f"{where}: pattern {line!r} matches an empty reason, so it would allow any skip")
    return rx


def skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    """The reason a skipped report carries, without pytest's "Skipped: " prefix."""
    lr = report.longrepr
    if isinstance(lr, tuple) and len(lr) == 3:  # (path, line, "Skipped: why")
        return str(lr[2]).removeprefix("Skipped: ")
    return str(lr)


class SkipAllowlist:
    """pytest plugin: records skips no pattern allows and fails the session on any."""

    def __init__(self, entries: list[AllowedSkip], source: str) -> None:
        self.entries = entries
        self.source = source
        self.unlisted: list[tuple[str, str]] = []  # (nodeid, reason)

    def allows(self, reason: str) -> bool:
        return any(e.pattern.match(reason) for e in self.entries)

    def record(self, report: pytest.TestReport | pytest.CollectReport) -> None:
        if not report.skipped or hasattr(report, "wasxfail"):
            return
        reason = skip_reason(report)
        if not self.allows(reason):
            self.unlisted.append((report.nodeid, reason))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.record(report)

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        self.record(report)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        # Only a would-be success is turned into a failure: a failed, interrupted or broken
        # run keeps its own status.
        if self.unlisted and session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if not self.unlisted:
            return
        tr = terminalreporter
        tr.section("skips not in the allowlist", sep="=", red=True, bold=True)
        tr.line(f"{len(self.unlisted)} skip(s) match no pattern of {self.source}, so the session fails. "
                "Fix the cause, or add a pattern there with a comment saying why the skip is allowed.")
        for nodeid, reason in self.unlisted:
            tr.line(f"SKIP NOT ALLOWED {nodeid}: {reason}", red=True)


def install(config: pytest.Config, allowlist: Path) -> SkipAllowlist:
    """Register the plugin once per session with the patterns of `allowlist`."""
    existing = config.pluginmanager.get_plugin(PLUGIN_NAME)
    if existing is not None:
        return existing
    plugin = SkipAllowlist(parse_allowlist(allowlist.read_text(), str(allowlist)), str(allowlist))
    config.pluginmanager.register(plugin, PLUGIN_NAME)
    return plugin
