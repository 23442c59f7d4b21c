"""No silent skips (issue #17, item 10): tests/conftest.py installs kvconnectors.testing.skips, which
fails the session on any skip whose reason matches no pattern of tests/allowed_skips.txt.

The meta-tests run tiny pytest sessions (pytester) under a verbatim copy of tests/conftest.py with
their own allowlist, and check the exit status and the terminal summary.

Seen to fail (each break made once, then restored): with `SkipAllowlist.pytest_sessionfinish` made
a no-op, the five cases expecting 1 without a failing test exited 0; with `record` ignoring
setup-phase reports, the fixture-skip and skipif cases exited 0; with `record` counting xfails, the
strict-xfail and deselection cases exited 1; with the comment block above the last committed patterns
deleted, the session stopped with INTERNALERROR naming that line; with the TieredConnector
layerwise line deleted from tests/allowed_skips.txt, or a pattern "NixlConnector: " added to it,
test_committed_allowlist_allows_todays_skips_and_nothing_else failed naming the reasons.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from kvconnectors.conformance import backends as b
from kvconnectors.conformance.capabilities import skip_reason
from kvconnectors.testing.skips import PLUGIN_NAME, parse_allowlist

pytest_plugins = ["pytester"]

TESTS = Path(__file__).resolve().parents[1]
ALLOWLIST = TESTS / "allowed_skips.txt"

INNER_ALLOWLIST = "# the one reason these tiny sessions allow\nallowed: a written-down reason$\n"

INNER_TESTS = textwrap.dedent('''
    import pytest

    def test_ok():
        pass

    def test_allowed():
        pytest.skip("allowed: a written-down reason")

    def test_unlisted():
        pytest.skip("Ray is not installed")

    @pytest.fixture
    def netns():
        pytest.skip("needs network namespaces")

    def test_fixture_skip(netns):
        pass

    @pytest.mark.skipif(True, reason="skipif: nobody wrote this down")
    def test_marker_skip():
        pass

    @pytest.mark.xfail(strict=True, reason="known issue")
    def test_strict_xfail():
        assert False

    def test_fails():
        assert False
''')

INNER_MODULE_SKIP = 'import pytest\npytest.skip("module-level: not written down", allow_module_level=True)\n'


@pytest.fixture
def inner(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    """A directory with the committed conftest (verbatim), a one-pattern allowlist and tiny tests."""
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")  # builtins only: fast, and no third-party hooks
    pytester.makeconftest((TESTS / "conftest.py").read_text())
    pytester.makefile(".txt", allowed_skips=INNER_ALLOWLIST)
    pytester.makepyfile(test_inner=INNER_TESTS, test_module_skip=INNER_MODULE_SKIP)
    return pytester


CASES = {  # id: (pytest args, exit status, reasons that must be reported as not allowed)
    "no skips": (["test_inner.py", "-k", "test_ok"], 0, []),
    "allowlisted skip": (["test_inner.py", "-k", "test_ok or test_allowed"], 0, []),
    "strict xfail is no skip": (["test_inner.py", "-k", "test_strict_xfail"], 0, []),
    "unlisted skip": (["test_inner.py", "-k", "test_allowed or test_unlisted"], 1, ["Ray is not installed"]),
    "skip in a fixture": (["test_inner.py", "-k", "test_fixture_skip"], 1, ["needs network namespaces"]),
    "skipif marker": (["test_inner.py", "-k", "test_marker_skip"], 1, ["skipif: nobody wrote this down"]),
    "deselected skips are no skips": (["test_inner.py", "-k", "not (unlisted or fixture_skip or marker_skip "
                                       "or fails)"], 0, []),
    "-x keeps a failure's status and still reports": (["test_inner.py", "-x", "-k", "unlisted or fails"], 1,
                                                       ["Ray is not installed"]),
    "-x with skips only": (["test_inner.py", "-x", "-k", "allowed or unlisted"], 1, ["Ray is not installed"]),
    "module-level skip": (["test_module_skip.py"], 1, ["module-level: not written down"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_session_status(inner: pytest.Pytester, case: str) -> None:
    args, status, unlisted = CASES[case]
    result = inner.runpytest("-p", "no:cacheprovider", *args)
    out = result.stdout.str()
    assert result.ret == status, f"{case}: exit status {result.ret}, expected {status}\n{out}"
    for reason in unlisted:
        assert f": {reason}" in out and "SKIP NOT ALLOWED" in out, f"{case}: {reason!r} not reported\n{out}"
    if not unlisted:
        assert "skips not in the allowlist" not in out, f"{case}: reported a skip as not allowed\n{out}"


def test_committed_conftest_installs_the_committed_allowlist(request: pytest.FixtureRequest) -> None:
    plugin = request.config.pluginmanager.get_plugin(PLUGIN_NAME)
    assert plugin is not None, "tests/conftest.py did not install the skip allowlist"
    assert Path(plugin.source) == ALLOWLIST and plugin.entries


@pytest.mark.parametrize("text, error", [
    ("allowed: x$\n", "no '#' comment"),
    ("# why\n\nallowed: x$\n", "no '#' comment"),          # a blank line ends the comment block
    ("# why\nNixlConnector: .*\n", "catch-all"),
    ("# why\nNixlConnector: .+\n", "catch-all"),
    ("# why\n(x)?\n", "matches an empty reason"),
    ("# why\nbad (paren\n", "not a regular expression"),
])
def test_malformed_allowlists_are_refused(text: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        parse_allowlist(text)


def _todays_skips() -> list[str]:
    """The skip reasons the suite produces on this CPU-only host, built from the code that raises them."""
    reasons = [skip_reason(b.ExampleBackend.name, cap) for cap in ("async_load", "failure_reporting")]
    reasons += [skip_reason(cls.name, "layerwise_load") for cls in
                (b.TieredBackend, b.MultiBackend, b.ExampleBackend, b.NixlBackend, b.MooncakeBackend)]
    reasons += [f"{cls.name}: no corruption hook (corrupt_extra() returns None)"
                for cls in (b.ExampleBackend, b.NixlBackend, b.MooncakeBackend)]
    reasons += [f"{b.OffloadingBackend.name}: {b.OFFLOADING_WORKER_ON_CPU}",
                f"{b.OffloadingBackend.name}: {b.OFFLOADING_NO_BACKDOOR}",
                f"{b.MooncakeBackend.name}: {b.MOONCAKE_ENGINE_ON_CPU}"]
    # vLLM's CPU attention writer on an AVX2 host (test_cpu_attn_packing.py probes it): no amx kernel,
    # no fp8-cache vec kernel. On an AVX-512 host these checks run instead of skipping.
    from test_cpu_attn_packing import writer_skip_reason

    avx2, missing = "AVX2, no AVX-512", "Unsupported CPU attention configuration: head_dim={} isa={} kv_cache_idx={}"
    reasons += [writer_skip_reason("0.32", "amx", "bfloat16", "", avx2, missing.format(32, 0, 0)),
                writer_skip_reason("0.32", "vec", "float32", "fp8_e5m2", avx2, missing.format(128, 1, 2))]
    lmcache = b.LMCacheBackend().unavailable()
    if lmcache is not None:  # lmcache has no wheel here; where it imports, this skip does not happen
        reasons.append(f"{b.LMCacheBackend.name}: unavailable here: {lmcache}")
    return reasons


# Skips that must fail the suite: our connectors broken or losing a capability, a missing package,
# a host feature, and third-party gaps nobody wrote down.
NOT_ALLOWED = [
    "TieredConnector: unavailable here: ImportError: cannot import name 'TieredConnector'",
    "MultiConnector(TieredConnector+ExampleConnector): unavailable here: KeyError: 'connectors'",
    "NixlConnector: unavailable here: NIXL does not import (ModuleNotFoundError: No module named 'nixl')",
    "MooncakeConnector: unavailable here: mooncake does not import (ModuleNotFoundError: No module named 'mooncake')",
    "LMCacheConnectorV1: unavailable here: ImportError: libcudart.so.12: cannot open shared object file",
    skip_reason(b.TieredBackend.name, "async_load"),
    skip_reason(b.TieredBackend.name, "failure_reporting"),
    skip_reason(b.MultiBackend.name, "pd_pull"),
    skip_reason(b.NixlBackend.name, "runs_on_cpu"),
    f"{b.TieredBackend.name}: no corruption hook (corrupt_extra() returns None)",
    f"{b.MultiBackend.name}: no corruption hook (corrupt_extra() returns None)",
    f"{b.TieredBackend.name}: no fault-injection hook (fault_extra() and fault_params() return None)",
    f"{b.MooncakeBackend.name}: declares needs_two_engines but its backend overrides no run_pd hook",
    f"{b.LMCacheBackend.name}: content-addressed store with no scheduler-only backdoor",
    f"{b.MooncakeBackend.name}: {b.MOONCAKE_DEVICE_QUERY}",
    "NIXL not importable: No module named 'nixl'",
    "could not import 'vllm': No module named 'vllm'",
    "filesystem under /tmp/pytest-of-root/x refuses O_DIRECT",
    "needs two cores to pin two servers apart",
    "no unwritable directory available to root here",
    "Ray is not installed",
    "needs network namespaces",
]


def test_committed_allowlist_allows_todays_skips_and_nothing_else() -> None:
    entries = parse_allowlist(ALLOWLIST.read_text(), str(ALLOWLIST))
    allowed = _todays_skips()
    refused = [r for r in allowed if not any(e.pattern.match(r) for e in entries)]
    assert not refused, f"today's skips the allowlist refuses: {refused}"
    stale = [f"line {e.line}: {e.pattern.pattern}" for e in entries if not any(e.pattern.match(r) for r in allowed)]
    assert not stale, f"allowlist patterns no known skip needs: {stale}"
    let_through = [r for r in NOT_ALLOWED if any(e.pattern.match(r) for e in entries)]
    assert not let_through, f"the allowlist lets these skips through: {let_through}"
