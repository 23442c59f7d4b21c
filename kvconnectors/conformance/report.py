"""The area x result matrix of a conformance run, as plain text and Markdown.

Input: the records the plugin writes (`KVCONNECTORS_CONFORMANCE_RESULTS`), one per test:
{"nodeid", "test", "area", "outcome": passed|failed|error|skipped|xfailed, "reason", "duration_s"}.
No vLLM or pytest import here.
"""

from __future__ import annotations

import textwrap
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

OUTCOMES = ("passed", "failed", "error", "skipped", "xfailed")
LABELS = {"passed": "pass", "failed": "fail", "error": "error", "skipped": "skip", "xfailed": "xfail"}
AREA_ORDER = ("scheduler_contract", "worker_transfer", "engine", "failure_reporting")


@dataclass
class Matrix:
    connector: str
    counts: dict[str, Counter] = field(default_factory=dict)        # area -> outcome -> n
    details: list[dict[str, Any]] = field(default_factory=list)     # every non-passing record
    header: dict[str, str] = field(default_factory=dict)            # suite / vLLM versions, command

    @property
    def failed(self) -> int:
        return sum(c["failed"] + c["error"] for c in self.counts.values())

    @property
    def total(self) -> int:
        return sum(sum(c.values()) for c in self.counts.values())


def build_matrix(connector: str, records: Iterable[dict[str, Any]], header: dict[str, str] | None = None) -> Matrix:
    m = Matrix(connector=connector, header=dict(header or {}))
    for rec in records:
        area = rec.get("area") or "other"
        outcome = rec.get("outcome") or "error"
        m.counts.setdefault(area, Counter())[outcome] += 1
        if outcome != "passed":
            m.details.append(rec)
    order = {a: i for i, a in enumerate(AREA_ORDER)}
    m.counts = dict(sorted(m.counts.items(), key=lambda kv: order.get(kv[0], len(order))))
    rank = {"failed": 0, "error": 0, "xfailed": 1, "skipped": 2}
    m.details.sort(key=lambda r: (order.get(r.get("area") or "", 99), rank.get(r.get("outcome"), 3), r.get("test", "")))
    return m


def _rows(m: Matrix) -> list[list[str]]:
    rows = [[area] + [str(c.get(o, 0)) for o in OUTCOMES] for area, c in m.counts.items()]
    total = Counter()
    for c in m.counts.values():
        total.update(c)
    rows.append(["total"] + [str(total.get(o, 0)) for o in OUTCOMES])
    return rows


def _verdict(m: Matrix) -> str:
    if m.total == 0:
        return "NO TESTS RAN"
    return "CONFORMS (no failures)" if m.failed == 0 else f"DOES NOT CONFORM ({m.failed} failing)"


def render_text(m: Matrix, width: int = 100) -> str:
    head = ["area"] + [LABELS[o] for o in OUTCOMES]
    rows = _rows(m)
    widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
    fmt = lambda r: "  ".join(c.ljust(widths[0]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(r))  # noqa: E731
    out = [f"Conformance of {m.connector}: {_verdict(m)}"]
    out += [f"  {k}: {v}" for k, v in m.header.items()]
    out += ["", fmt(head), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows]
    if m.details:
        out += ["", "Not passing:"]
        for r in m.details:
            out.append(f"  [{LABELS.get(r.get('outcome'), r.get('outcome'))}] {r.get('area') or 'other'} :: "
                       f"{r.get('test')}")
            reason = " ".join(str(r.get("reason") or "").split())
            if reason:
                out += textwrap.wrap(reason, width=width, initial_indent="      ", subsequent_indent="      ")
    return "\n".join(out)


def _md_escape(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def render_markdown(m: Matrix) -> str:
    head = ["area"] + [LABELS[o] for o in OUTCOMES]
    out = [f"# Conformance report: {m.connector}", "", f"**{_verdict(m)}**", ""]
    out += [f"- {k}: `{v}`" for k, v in m.header.items()]
    out += ["", "| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * len(OUTCOMES)) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in _rows(m)]
    if m.details:
        out += ["", "## Not passing", "", "| result | area | test | why |", "|---|---|---|---|"]
        for r in m.details:
            out.append(f"| {LABELS.get(r.get('outcome'), r.get('outcome'))} | {r.get('area') or 'other'} | "
                       f"`{_md_escape(r.get('test', ''))}` | {_md_escape(r.get('reason') or '')} |")
    return "\n".join(out) + "\n"
