"""Meta-tests of the conformance gate: kvconnectors' own connectors (TieredConnector, and
MultiConnector composed of it) FAIL when they cannot be imported or constructed, while a
third-party backend still skips with its precise reason. One child pytest runs two
scheduler-contract tests (vLLM's real Scheduler, no engine) for unbroken controls, for backends
whose TieredConnector module raises ImportError (a stand-in module path, for Tiered alone and as
Multi's child), and for ones whose TieredConnector.__init__ raises (an unknown setting)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

SUITE = textwrap.dedent('''
    from kvconnectors.conformance import SchedulerContractTests
    from kvconnectors.conformance.backends import MultiBackend, TieredBackend
    from kvconnectors.conformance.fixtures import ConnectorBackend

    BROKEN_MODULE = "kvc_meta_broken_tiered"   # raises ImportError when imported (written beside this file)
    BAD_SETTING = {"meta_test_unknown_setting": 1}   # TieredConnector.__init__ raises ConfigError on it


    class TestTiered(TieredBackend, SchedulerContractTests):
        """Control: unbroken, both tests pass."""


    class TestMulti(MultiBackend, SchedulerContractTests):
        """Control: unbroken, both tests pass."""


    class TestTieredImportBroken(TieredBackend, SchedulerContractTests):
        module_path = BROKEN_MODULE


    class TestMultiImportBroken(MultiBackend, SchedulerContractTests):
        def kv_transfer_config(self, role, *, policy="fail", extra=None):
            cfg = super().kv_transfer_config(role, policy=policy, extra=extra)
            cfg["kv_connector_extra_config"]["connectors"][0]["kv_connector_module_path"] = BROKEN_MODULE
            return cfg


    class TestTieredConstructBroken(TieredBackend, SchedulerContractTests):
        def extra_config(self, role):
            return {**super().extra_config(role), **BAD_SETTING}


    class TestMultiConstructBroken(MultiBackend, SchedulerContractTests):
        def kv_transfer_config(self, role, *, policy="fail", extra=None):
            return super().kv_transfer_config(role, policy=policy, extra={**(extra or {}), **BAD_SETTING})


    class ThirdPartyBackend(ConnectorBackend):
        name = "ThirdParty"; kv_connector = "GoneConnector"; module_path = "kvc_meta_no_such_module"


    class TestThirdParty(ThirdPartyBackend, SchedulerContractTests):
        pass
''')

BROKEN_MODULE = textwrap.dedent('''
    from kvconnectors.tiered import TieredConnector  # noqa: F401  (what a real module would export)

    raise ImportError("kvc_meta_broken_tiered broken on purpose (meta-test)")
''')

CONFTEST = ("from kvconnectors.conformance.plugin import (pytest_collection_modifyitems, pytest_configure,\n"
            "    pytest_runtest_logreport, pytest_sessionfinish)\n")

# One test that constructs the connector (the `sched` fixture) and one that only imports it.
TESTS = ("test_declared_capabilities_hold", "test_producer_lifecycle")
SELECT = " or ".join(TESTS)


@dataclass
class ChildRun:
    results: dict[str, dict]   # "Class::test" -> the suite plugin's record
    output: str                # the child pytest's stdout + stderr

    def outcome(self, cls: str, test: str) -> dict:
        return self.results[f"{cls}::{test}"]


@pytest.fixture(scope="module")
def child(tmp_path_factory: pytest.TempPathFactory) -> ChildRun:
    """The suite above, run once in a child pytest (one vLLM import for every test here)."""
    d = tmp_path_factory.mktemp("own-backends")
    (d / "test_own.py").write_text(SUITE)
    (d / "kvc_meta_broken_tiered.py").write_text(BROKEN_MODULE)
    (d / "conftest.py").write_text(CONFTEST)
    (d / "pytest.ini").write_text("[pytest]\n")
    results = d / "results.json"
    env = dict(os.environ, KVCONNECTORS_CONFORMANCE_RESULTS=str(results))
    env.pop("KVCONNECTORS_CONFORMANCE_AREAS", None)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", str(d / "pytest.ini"),
                           "-k", SELECT, str(d / "test_own.py")],
                          cwd=d, env=env, capture_output=True, text=True, timeout=600)
    output = proc.stdout + proc.stderr
    assert results.exists(), f"no results file; pytest said:\n{output}"
    return ChildRun({r["nodeid"].split("::", 1)[1]: r for r in json.loads(results.read_text())}, output)


@pytest.mark.timeout(600)
def test_controls_pass(child: ChildRun) -> None:
    """Unbroken, the same tests pass: the failures below come from the breakage alone."""
    for cls in ("TestTiered", "TestMulti"):
        for test in TESTS:
            rec = child.outcome(cls, test)
            assert rec["outcome"] == "passed", (rec, child.output[-3000:])


@pytest.mark.timeout(600)
def test_own_connector_import_error_fails_not_skips(child: ChildRun) -> None:
    """TieredConnector's module raising ImportError (alone, or as MultiConnector's first child):
    every test fails in the gate with the exception, and the output carries its traceback. Seen
    to fail: with `own = False` on TieredBackend and MultiBackend (the old behaviour) three of
    the four were 'skipped' ("unavailable here: ImportError: ...") and this test reported them."""
    for cls in ("TestTieredImportBroken", "TestMultiImportBroken"):
        for test in TESTS:
            rec = child.outcome(cls, test)
            assert rec["outcome"] in ("failed", "error"), (rec, child.output[-3000:])
            assert "own connector cannot be imported or constructed" in rec["reason"], rec
            assert "ImportError: kvc_meta_broken_tiered broken on purpose" in rec["reason"], rec
    assert child.output.count("kvconnectors' own connector cannot be imported or constructed") >= 4, \
        child.output[-3000:]
    # the traceback summary: the frame that raised, in the broken module
    assert "Traceback" in child.output and "kvc_meta_broken_tiered.py" in child.output, child.output[-3000:]


@pytest.mark.timeout(600)
def test_own_connector_construction_error_fails_not_skips(child: ChildRun) -> None:
    """TieredConnector.__init__ raising (an unknown setting; alone, or as MultiConnector's child):
    every test that builds the connector fails; the import-only declarations test still passes.
    Seen to fail: with ConnectorBackend.scheduler wrapped to pytest.skip on any exception (in the
    child's conftest), the producer tests were 'skipped' and this test reported them."""
    for cls in ("TestTieredConstructBroken", "TestMultiConstructBroken"):
        built = child.outcome(cls, "test_producer_lifecycle")
        assert built["outcome"] in ("failed", "error"), (built, child.output[-3000:])
        assert "meta_test_unknown_setting" in built["reason"], built
        declared = child.outcome(cls, "test_declared_capabilities_hold")
        assert declared["outcome"] == "passed", (declared, child.output[-3000:])


@pytest.mark.timeout(600)
def test_third_party_backend_still_skips(child: ChildRun) -> None:
    """Not ours: an import error is a skip with the precise reason, as before."""
    for test in TESTS:
        rec = child.outcome("TestThirdParty", test)
        assert rec["outcome"] == "skipped", rec
        assert rec["reason"] == ("ThirdParty: unavailable here: ModuleNotFoundError: "
                                 "No module named 'kvc_meta_no_such_module'"), rec
