"""The suite's own machinery, without vLLM: capability skips, strict xfails, precise skips,
area selection, the results file, the matrix and the `kvconnectors conformance` command."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvconnectors.conformance import cli
from kvconnectors.conformance.capabilities import AREAS, Capabilities, area_of, requires, skip_reason
from kvconnectors.conformance.report import build_matrix, render_markdown, render_text

FAKE_SUITE = textwrap.dedent('''
    from kvconnectors.conformance.capabilities import Capabilities, requires
    from kvconnectors.conformance.fixtures import ConnectorBackend

    class FakeBackend(ConnectorBackend):
        name = "Fake"; kv_connector = "FakeConnector"
        capabilities = Capabilities(async_load=True)
        xfail = {"test_passes": "https://example.invalid/1: claimed broken",
                 "test_fails": "https://example.invalid/2: really broken"}
        skips = {"test_precise": "needs a GPU: RuntimeError seen at x.py:1"}
        def unavailable(self):
            return None

    class FakeAreaTests:
        conformance_area = "scheduler_contract"
        def test_passes(self):
            pass
        def test_fails(self):
            assert 1 == 2, "seen 1, expected 2"
        @requires("pd_push")
        def test_needs_push(self):
            pass
        @requires("async_load")
        def test_needs_async(self):
            pass
        def test_precise(self):
            pass

    class FakeWorkerTests:
        conformance_area = "worker_transfer"
        def test_worker(self):
            pass

    class TestFake(FakeBackend, FakeAreaTests, FakeWorkerTests):
        pass

    class GoneBackend(FakeBackend):
        def unavailable(self):
            return "ModuleNotFoundError: No module named 'gone'"

    class TestGone(GoneBackend, FakeAreaTests):
        pass
''')


def _run_fake(tmp_path: Path, areas: str = "") -> dict[str, dict]:
    (tmp_path / "test_fake.py").write_text(FAKE_SUITE)
    (tmp_path / "conftest.py").write_text("from kvconnectors.conformance.plugin import (pytest_configure,\n"
                                          "    pytest_collection_modifyitems, pytest_runtest_logreport,\n"
                                          "    pytest_sessionfinish)\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    results = tmp_path / "results.json"
    env = dict(os.environ, KVCONNECTORS_CONFORMANCE_RESULTS=str(results), KVCONNECTORS_CONFORMANCE_AREAS=areas)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c",
                           str(tmp_path / "pytest.ini"), str(tmp_path / "test_fake.py")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert results.exists(), f"no results file; pytest said:\n{proc.stdout}\n{proc.stderr}"
    return {r["nodeid"].split("::", 1)[1]: r for r in json.loads(results.read_text())}


def test_gate_skips_xfails_and_records(tmp_path: Path) -> None:
    got = _run_fake(tmp_path)
    outcome = {k: v["outcome"] for k, v in got.items()}
    assert outcome == {
        "TestFake::test_passes": "failed",          # strict: an xfail that passes is an error
        "TestFake::test_fails": "xfailed",
        "TestFake::test_needs_push": "skipped",
        "TestFake::test_needs_async": "passed",
        "TestFake::test_precise": "skipped",
        "TestFake::test_worker": "passed",
        "TestGone::test_passes": "skipped", "TestGone::test_fails": "skipped",
        "TestGone::test_needs_push": "skipped", "TestGone::test_needs_async": "skipped",
        "TestGone::test_precise": "skipped",
    }, outcome
    assert got["TestFake::test_passes"]["reason"].startswith("unexpected pass of a strict xfail"), got
    assert "https://example.invalid/2" in got["TestFake::test_fails"]["reason"]
    assert got["TestFake::test_needs_push"]["reason"] == skip_reason("Fake", "pd_push")
    assert got["TestFake::test_precise"]["reason"] == "Fake: needs a GPU: RuntimeError seen at x.py:1"
    assert got["TestGone::test_passes"]["reason"] == (
        "Fake: unavailable here: ModuleNotFoundError: No module named 'gone'")
    assert got["TestFake::test_worker"]["area"] == "worker_transfer"
    assert got["TestFake::test_passes"]["area"] == "scheduler_contract"


def test_area_selection(tmp_path: Path) -> None:
    got = _run_fake(tmp_path, areas="worker_transfer")
    assert list(got) == ["TestFake::test_worker"], list(got)


def test_capabilities_api() -> None:
    caps = Capabilities(async_load=True, pd_pull=True)
    assert caps.declared() == ["async_load", "pd_pull", "runs_on_cpu"]
    with pytest.raises(KeyError, match="unknown capability 'teleport'"):
        requires("teleport")
    with pytest.raises(KeyError):
        caps.has("teleport")

    class Mixin:
        conformance_area = "engine"

        def test_x(self) -> None: ...

    class Combined(Mixin):
        pass

    assert area_of(Combined, "test_x") == "engine"
    assert area_of(Combined, "test_missing") is None
    assert set(AREAS) == {"scheduler_contract", "worker_transfer", "engine", "failure_reporting"}


RECORDS = [
    {"nodeid": "a::T::test_1", "test": "test_1", "area": "scheduler_contract", "outcome": "passed", "reason": ""},
    {"nodeid": "a::T::test_2", "test": "test_2", "area": "worker_transfer", "outcome": "xfailed",
     "reason": "X: known issue: https://example.invalid/3: off by one"},
    {"nodeid": "a::T::test_3", "test": "test_3", "area": "worker_transfer", "outcome": "failed",
     "reason": "AssertionError: X: prompt 0 loaded 0 tokens, expected > 0 | with a pipe"},
    {"nodeid": "a::T::test_4", "test": "test_4", "area": "engine", "outcome": "skipped",
     "reason": "X: capability 'runs_on_cpu' not declared"},
]


def test_matrix_text_and_markdown() -> None:
    m = build_matrix("X", RECORDS, {"suite": "test"})
    assert m.failed == 1 and m.total == 4
    text = render_text(m)
    assert "DOES NOT CONFORM (1 failing)" in text
    assert "[fail] worker_transfer :: test_3" in text and "loaded 0 tokens" in text
    lines = text.splitlines()
    row = next(line for line in lines if line.startswith("worker_transfer"))
    assert row.split() == ["worker_transfer", "0", "1", "0", "0", "1"], row
    md = render_markdown(m)
    assert "| worker_transfer | 0 | 1 | 0 | 0 | 1 |" in md
    assert "with a pipe" in md and "\\| with a pipe" in md   # table-safe
    assert "https://example.invalid/3" in md


def _args(**kw: object) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    argv = ["--connector", str(kw.pop("connector", "TieredConnector"))]
    for k, v in kw.items():
        argv += [f"--{k}", str(v)] if v is not True else [f"--{k}"]
    return parser.parse_args(argv)


def test_cli_runs_pytest_and_prints_matrix(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    seen: dict[str, object] = {}

    def fake_run(cmd: list[str], env: dict[str, str], **kw: object) -> subprocess.CompletedProcess:
        seen.update(cmd=cmd, env=env)
        Path(env["KVCONNECTORS_CONFORMANCE_RESULTS"]).write_text(json.dumps(RECORDS))
        return subprocess.CompletedProcess(cmd, 1, stdout="1 failed")

    monkeypatch.setattr(cli.subprocess, "run", fake_run)
    report = tmp_path / "r.md"
    rc = cli.run(_args(connector="my_pkg.mod:MyConnector", area="worker_transfer", report=report))
    assert rc == 1
    cmd, env = seen["cmd"], seen["env"]
    assert cmd[1:5] == ["-m", "pytest", "--pyargs", "kvconnectors.conformance"] and "not engine" in cmd
    assert env["KVCONNECTORS_CONFORMANCE_BACKEND"] == "my_pkg.mod:MyConnector"
    assert env["KVCONNECTORS_CONFORMANCE_AREAS"] == "worker_transfer"
    assert "DOES NOT CONFORM" in capsys.readouterr().out
    assert report.read_text().startswith("# Conformance report: my_pkg.mod:MyConnector")

    monkeypatch.setattr(cli.subprocess, "run", lambda cmd, env, **kw: (
        Path(env["KVCONNECTORS_CONFORMANCE_RESULTS"]).write_text(json.dumps(RECORDS[:2])),
        subprocess.CompletedProcess(cmd, 0, stdout=""))[1])
    assert cli.run(_args(engine=True)) == 0


def test_cli_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.run(_args(connector="NoSuchThing")) == 2
    assert "unknown connector 'NoSuchThing'" in capsys.readouterr().err
    assert cli.run(_args(area="engine")) == 2
