"""Imports by role (issue 35, item 6): the connector vLLM loads pulls in only what it uses; `import
kvconnectors` and `kvconnectors --help` pull in nothing heavy; the package never imports the
`integration/` and `benchmarks/` folders installed beside it (setup.py MAPPED) — only the CLI
dispatcher names them, as strings it imports when their command runs.

The runtime checks run in a fresh interpreter each, so nothing this pytest process imported hides an
import. vLLM itself imports aiohttp and tqdm, so for those a look at `sys.modules` proves nothing: the
connector check traces the import statements that our own modules execute instead.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "kvconnectors"
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}

# What vLLM imports for kv_connector "TieredConnector": the facade and the two sides it builds.
CONNECTOR_MODULES = ("kvconnectors.tiered.connector", "kvconnectors.tiered.scheduler",
                     "kvconnectors.tiered.worker")
# Our modules of other roles: the proxy, launcher, Ray Serve app (integration), the benchmarks, the
# test and conformance tooling, the command line. None serves a running connector.
OTHER_ROLES = ("kvconnectors.integration", "kvconnectors.benchmarks", "kvconnectors.testing",
               "kvconnectors.conformance", "kvconnectors.cli", "kvconnectors.planner_cli",
               "kvconnectors.serving", "kvconnectors.ray")
# Their third-party packages: HTTP (the proxy, the workload), progress bars, Ray, plots.
THEIR_PACKAGES = ("aiohttp", "tqdm", "ray", "matplotlib")
# The folders installed beside the package (setup.py MAPPED): the package never imports them.
BESIDE = ("kvconnectors.integration", "kvconnectors.benchmarks")

MARK = "IMPORT-TRACE "
# Imports the modules named in argv with every import statement that a kvconnectors module executes
# recorded (`import x`, `from x import y`, importlib.import_module), and prints one JSON line:
# sys.modules afterwards and, per top-level package, which of our modules imported it.
TRACE = r"""
import builtins, importlib, json, sys
ours = {}
real_import, real_import_module = builtins.__import__, importlib.import_module

def note(name, importer):
    if importer.startswith("kvconnectors") and name:
        ours.setdefault(name.split(".")[0], set()).add(importer)

def traced_import(name, globals=None, locals=None, fromlist=(), level=0):
    if level == 0:
        note(name, (globals or {}).get("__name__") or "")
    return real_import(name, globals, locals, fromlist, level)

def traced_import_module(name, package=None):
    if not name.startswith("."):
        note(name, sys._getframe(1).f_globals.get("__name__") or "")
    return real_import_module(name, package)

builtins.__import__, importlib.import_module = traced_import, traced_import_module
for name in sys.argv[1:]:
    real_import_module(name)
print(MARK + json.dumps({"modules": sorted(sys.modules), "ours": {k: sorted(v) for k, v in ours.items()}}))
""".replace("MARK", repr(MARK))


def trace(*modules: str) -> tuple[set[str], dict[str, list[str]]]:
    """(sys.modules, {package: [our modules that import it]}) of a fresh interpreter after importing
    `modules`."""
    proc = subprocess.run([sys.executable, "-c", TRACE, *modules], capture_output=True, text=True, timeout=300,
                          cwd=REPO, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith(MARK))
    found = json.loads(line[len(MARK):])
    return set(found["modules"]), found["ours"]


def loaded(modules: set[str], prefixes: tuple[str, ...]) -> list[str]:
    """The modules under `prefixes` that `modules` holds, each named once: a package stands for its
    submodules (torch, not torch.nn and 1,000 more)."""
    hits = {m for m in modules if any(m == p or m.startswith(p + ".") for p in prefixes)}
    return sorted(m for m in hits if not any(m.startswith(h + ".") for h in hits))


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed (the cpu or cuda extra)")
def test_the_connector_loads_only_what_it_uses():
    """Negative control: `from kvconnectors.integration.proxy import config` in tiered/scheduler.py
    (or `import tqdm` in tiered/worker.py) fails this test, naming the module and who imported it."""
    modules, ours = trace(*CONNECTOR_MODULES)
    assert "torch" in ours and "vllm" in ours, f"the trace saw no import of torch/vllm: {sorted(ours)}"
    assert not loaded(modules, OTHER_ROLES), f"the connector loaded {loaded(modules, OTHER_ROLES)}"
    pulled = {name: ours[name] for name in THEIR_PACKAGES if name in ours}
    assert not pulled, f"the connector's modules import {pulled}"
    assert not loaded(modules, ("ray", "matplotlib")), "the connector (or vLLM under it) loaded Ray or matplotlib"


def test_import_kvconnectors_alone_is_light():
    modules, _ = trace("kvconnectors")
    heavy = loaded(modules, ("torch", "vllm", "numpy", "aiohttp", "ray", *BESIDE))
    assert not heavy, f"`import kvconnectors` loaded {heavy}"


def test_the_package_never_imports_the_folders_beside_it():
    """Every import statement under kvconnectors/, wherever it stands (module level, a function,
    under TYPE_CHECKING). The CLI dispatcher names those commands' modules as strings
    (cli.COMMANDS), which is allowed: the command line is the top of the arrows. Negative control:
    the tree before this rule (kvconnectors/demo.py, ray/backend.py, testing/rayapps.py) fails it
    with their five imports."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            hits = [n for n in names if any(n == b or n.startswith(b + ".") for b in BESIDE)]
            if hits:
                found.append(f"{path.relative_to(REPO)}:{node.lineno}: {hits[0]}")
    assert not found, "kvconnectors/ imports the folders installed beside it:\n" + "\n".join(found)


# ------------------------------------------------------------------------------------ the command line
def run_cli(*argv: str, absent: str | None = None) -> subprocess.CompletedProcess[str]:
    """`kvconnectors ARGV` in a fresh interpreter, with `absent` made unimportable (None in sys.modules:
    its import raises ModuleNotFoundError, as on a host without it) and no way to start a process, so
    a command that got past its missing dependency could start no server here. Prints sys.modules."""
    code = ("import sys, subprocess\n"
            f"if {absent!r}: sys.modules[{absent!r}] = None\n"
            "subprocess.Popen = None\n"
            "from kvconnectors.cli import main\n"
            "try:\n    rc = main(sys.argv[1:])\nexcept SystemExit as exc:\n    rc = exc.code\n"
            f"print({MARK!r} + ' '.join(sorted(sys.modules)))\n"
            "sys.exit(rc)\n")
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120, cwd=REPO,
                          env=ENV)


def modules_of(proc: subprocess.CompletedProcess[str]) -> set[str]:
    line = next(x for x in proc.stdout.splitlines() if x.startswith(MARK))
    return set(line[len(MARK):].split())


def test_top_level_help_imports_no_command():
    """`kvconnectors --help` with the base dependencies only. Negative control: the old dispatcher
    (every command's module imported for the top-level help) loads kvconnectors.integration.proxy,
    aiohttp and the benchmarks here, and this fails."""
    from kvconnectors import cli

    proc = run_cli("--help")
    assert proc.returncode == 0 and "serve-pd" in proc.stdout, proc.stderr
    commands = tuple(module for module, _ in cli.COMMANDS.values())
    heavy = loaded(modules_of(proc), ("torch", "vllm", "numpy", "aiohttp", "ray", "matplotlib", *BESIDE, *commands))
    assert not heavy, f"`kvconnectors --help` loaded {heavy}"


def test_a_command_imports_only_its_own_module():
    from kvconnectors import cli

    proc = run_cli("plan", "--help")
    assert proc.returncode == 0 and "--link" in proc.stdout, proc.stderr
    others = tuple(module for name, (module, _) in cli.COMMANDS.items() if name != "plan")
    modules = modules_of(proc)
    assert "kvconnectors.planner_cli" in modules
    assert not loaded(modules, others), f"`kvconnectors plan --help` loaded {loaded(modules, others)}"


@pytest.mark.parametrize(("absent", "argv", "install"), [
    ("aiohttp", ("proxy", "--help"), "pip install aiohttp (a base dependency"),
    ("matplotlib", ("plan", "--model", "llama-8b", "--gpu", "h100-sxm", "--link", "100gbe", "--plot", "PNG"),
     "pip install 'kvconnectors[plot]'"),
    ("vllm", ("demo", "--requests", "1", "--out", "OUT", "--no-plot"), "pip install 'kvconnectors[cpu]' or "),
    ("vllm", ("serve-pd", "--model", "MODEL", "--prefill", "1", "--decode", "1", "--device", "cpu", "--proxy", "none"),
     "pip install 'kvconnectors[cpu]' or "),
], ids=["proxy-aiohttp", "plot-matplotlib", "demo-vllm", "serve-pd-vllm"])
def test_a_missing_dependency_is_one_line_naming_module_and_extra(absent, argv, install, tmp_path):
    """Exit status 2 and one line (no traceback) that names the module and what to install.
    Negative control: without the dispatcher's ModuleNotFoundError handler each case ends in a
    traceback with exit status 1; without the launcher's vLLM check serve-pd gets past it."""
    argv = [str(tmp_path / a) if a in ("PNG", "OUT", "MODEL") else a for a in argv]
    proc = run_cli(*argv, absent=absent)
    errors = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(errors) == 1, errors
    assert errors[0].startswith(f"kvconnectors {argv[0]}: error: needs {absent}"), errors[0]
    assert install in errors[0], errors[0]


def test_an_unknown_missing_module_is_not_reworded():
    """A missing module that is no dependency of ours is a bug: the dispatcher re-raises it whole."""
    from kvconnectors.extras import missing_dependency

    assert missing_dependency(ModuleNotFoundError("No module named 'kvconnectors.gone'", name="kvconnectors.gone")) is None
    assert missing_dependency(ImportError("cannot import name 'x' from 'numpy'", name="numpy")) is None
    assert missing_dependency(ModuleNotFoundError("No module named 'ray'", name="ray")) == (
        "needs ray, which is not installed: pip install 'kvconnectors[ray]'")


def test_the_extras_named_are_the_packages_extras():
    """Every extra extras.py names exists and installs a distribution of that import name; every base
    dependency it names is a requirement without an extra (read from the installed metadata, which
    setup.py wrote)."""
    import importlib.metadata
    import re

    from kvconnectors.extras import BASE, OPTIONAL

    def dist(requirement: str) -> str:
        return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9._-]+", requirement).group()).lower()

    meta = importlib.metadata.metadata("kvconnectors")
    requires = importlib.metadata.requires("kvconnectors") or []
    extras = set(meta.get_all("Provides-Extra") or ())
    by_extra: dict[str, set[str]] = {}
    for line in requires:
        marker = re.search(r"""extra\s*==\s*["']([^"']+)["']""", line)
        by_extra.setdefault(marker.group(1) if marker else "", set()).add(dist(line))
    for module, wanted in OPTIONAL.items():
        assert set(wanted) <= extras, f"{module}: extras {set(wanted) - extras} are not setup.py's"
        name = dist(module)
        assert any(d == name or d.startswith(name + "-") for e in wanted for d in by_extra.get(e, ())), (
            f"no extra of {wanted} installs {module}: {[sorted(by_extra.get(e, ())) for e in wanted]}")
    assert {dist(m) for m in BASE} <= by_extra[""], sorted({dist(m) for m in BASE} - by_extra[""])
