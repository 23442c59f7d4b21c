"""integration/monitoring/: the alert rules and the Grafana dashboard name only metrics TieredConnector
exports, in the form Prometheus sees them (counters with `_total`, the histogram's `_bucket`, gauges as
declared), and each rule has what Prometheus and an on-call reader need. Seen to fail: with
`store_dram_capacity_bytes` misspelt in alerts.yaml, and with `transfer_failures` written without
`_total` in the dashboard. (That each name appears in a live /metrics scrape of a P/D pair is not
tested yet: counters with labels appear only once counted.)"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from kvconnectors.tiered import metrics

MONITORING = Path(__file__).resolve().parents[2] / "integration" / "monitoring"
RULES = MONITORING / "alerts.yaml"
DASHBOARD = MONITORING / "grafana-dashboard.json"
NAME = re.compile(r"kvconnectors:[a-z_]+")


def exported_names() -> dict[str, str]:
    """Every name a scrape shows for a declared metric -> its kind."""
    out: dict[str, str] = {}
    for m in metrics.ALL:
        if m.kind == "counter":
            out[m.name + "_total"] = m.kind
        elif m.kind == "histogram":
            for suffix in ("_bucket", "_sum", "_count"):
                out[m.name + suffix] = m.kind
        else:
            out[m.name] = m.kind
    return out


def rules() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def test_every_rule_is_complete() -> None:
    names = [r["alert"] for r in rules()]
    assert len(names) == len(set(names)) and len(names) >= 8, names
    for r in rules():
        assert r["expr"].strip() and r["labels"]["severity"] in ("info", "warning", "critical"), r
        assert r["annotations"]["summary"], r


@pytest.mark.parametrize("rule", rules(), ids=lambda r: r["alert"])
def test_rules_name_only_exported_metrics(rule: dict) -> None:
    exported = exported_names()
    used = NAME.findall(rule["expr"])
    assert used, f"{rule['alert']} names no kvconnectors metric"
    unknown = [n for n in used if n not in exported]
    assert not unknown, f"{rule['alert']}: {unknown} is not exported (known: {sorted(exported)})"
    if "rate(" in rule["expr"] or "increase(" in rule["expr"]:
        assert all(exported[n] != "gauge" or "increase(" in rule["expr"] for n in used), rule["expr"]


def dashboard_exprs() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p["targets"]]


def test_the_dashboard_names_only_exported_metrics() -> None:
    exported = exported_names()
    exprs = dashboard_exprs()
    assert len(exprs) >= 12
    for title, expr in exprs:
        unknown = [n for n in NAME.findall(expr) if n not in exported]
        assert not unknown, f"panel {title!r}: {unknown} is not exported"
    # every declared metric family is on the dashboard or in an alert (nothing exported goes unseen)
    seen = {n for _, e in exprs for n in NAME.findall(e)} | {n for r in rules() for n in NAME.findall(r["expr"])}
    families = {m.name for m in metrics.ALL if "deprecated" not in m.help}
    unseen = sorted(f for f in families if not seen & {f, f + "_total", f + "_bucket"})
    assert not unseen, f"declared but neither charted nor alerted on: {unseen}"
