"""The benchmarks time the product, not copies of it (issue 35 item 5).

Static checks over benchmarks/*.py, no benchmark is run: no private attribute of the worker's parts
is touched, no private method of theirs is even named (a comment "as Puller._from_producer" marks a
hand-made copy of it), no kvconnectors source is parsed for its defaults, and `bench transfer` /
`bench layerwise` import the parts they are meant to drive.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = sorted((ROOT / "benchmarks").glob("*.py"))
# the worker's parts (tiered/worker.py assembles them): their private methods are what copies mirrored
WORKER_PARTS = ("worker", "staging", "pushes", "puller", "landed", "resliced", "pull_paths", "links", "results",
                "load")
# private names the benchmarks may never reach for, on any object
FORBIDDEN_PREFIXES = ("_pull", "_stage", "_push", "_load")
# what each benchmark must import to drive the product (any one of each tuple)
DRIVES = {
    "transfer.py": [("kvconnectors.tiered.worker", "kvconnectors.tiered.puller", "kvconnectors.benchmarks.workers")],
    "workers.py": [("kvconnectors.tiered.worker",)],
    "layerwise.py": [("kvconnectors.tiered.staging",), ("kvconnectors.tiered.landed",)],
}


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _private_defs(modules: tuple[str, ...]) -> set[str]:
    """Private (not dunder) functions, methods and self-attributes defined in kvconnectors/tiered/<modules>."""
    names: set[str] = set()
    for name in modules:
        for node in ast.walk(_tree(ROOT / "kvconnectors" / "tiered" / f"{name}.py")):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(node.name)
            elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                  and isinstance(node.value, ast.Name) and node.value.id == "self"):
                names.add(node.attr)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def _own_attribute(node: ast.Attribute) -> bool:
    """self._x / cls._x: the benchmark's own object (its classes may have private helpers)."""
    return isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")


def test_the_check_sees_the_worker_parts():
    private = _private_defs(WORKER_PARTS)
    assert {"_from_producer", "_stage_spec", "_done", "_seal_transfer", "_pull"} <= private
    assert BENCHMARKS and any(p.name == "transfer.py" for p in BENCHMARKS)


@pytest.mark.parametrize("path", BENCHMARKS, ids=lambda p: p.name)
def test_no_private_attribute_of_the_worker_parts(path):
    private = _private_defs(WORKER_PARTS)
    bad = []
    for node in ast.walk(_tree(path)):
        if not isinstance(node, ast.Attribute) or _own_attribute(node):
            continue
        if node.attr in private or node.attr.startswith(FORBIDDEN_PREFIXES):
            bad.append(f"{path.name}:{node.lineno}: .{node.attr}")
    assert not bad, "benchmarks reach into the worker's parts: " + ", ".join(bad)


@pytest.mark.parametrize("path", BENCHMARKS, ids=lambda p: p.name)
def test_no_private_method_of_the_worker_parts_is_named(path):
    """A benchmark that names a private method of the worker's parts (code or comment) copies or
    mirrors it; it should call the part's public API instead."""
    src = path.read_text()
    bad = []
    for name in sorted(_private_defs(WORKER_PARTS)):
        for m in re.finditer(rf"(?<![A-Za-z0-9_]){re.escape(name)}(?![A-Za-z0-9_])", src):
            bad.append(f"{path.name}:{src.count(chr(10), 0, m.start()) + 1}: {name}")
    assert not bad, "benchmarks name private methods of the worker's parts: " + ", ".join(bad)


@pytest.mark.parametrize("path", BENCHMARKS, ids=lambda p: p.name)
def test_no_kvconnectors_source_is_parsed(path):
    """Defaults come from the declarations (TieredConfig's fields), not from parsing their source."""
    bad = [f"{path.name}:{node.lineno}" for node in ast.walk(_tree(path))
           if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
           and isinstance(node.func.value, ast.Name) and node.func.value.id == "ast" and node.func.attr == "parse"]
    assert not bad, "benchmarks parse source code: " + ", ".join(bad)


@pytest.mark.parametrize("name", sorted(DRIVES))
def test_the_benchmarks_import_the_parts_they_drive(name):
    imported: set[str] = set()
    for node in ast.walk(_tree(ROOT / "benchmarks" / name)):
        if isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module)
            imported.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            imported.update(a.name for a in node.names)
    for anyof in DRIVES[name]:
        assert imported & set(anyof), f"benchmarks/{name} imports none of {anyof}"


def test_nixl_bench_lives_with_the_benchmarks():
    assert (ROOT / "benchmarks" / "nixl_bench.py").exists()
    assert not (ROOT / "kvconnectors" / "transport" / "nixl_bench.py").exists()
