"""The package's import structure: no module of `kvconnectors/` imports itself back through others,
and the mover imports nothing from the transport.

The graph is read from the source with `ast`, not from `sys.modules` after an import: every import
counts, wherever it stands (module level, under `if TYPE_CHECKING:`, inside a function), because an
import hidden from the interpreter still hides an arrow that runs back up. `kvconnectors.integration`
and `kvconnectors.benchmarks` are the top-level `integration/` and `benchmarks/` folders installed
under the package's name (setup.py MAPPED): they are not part of this graph.
"""

from __future__ import annotations

import ast
from collections import deque
from pathlib import Path

import pytest

PACKAGE = "kvconnectors"
ROOT = Path(__file__).resolve().parents[2] / PACKAGE


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under the package folder."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _is_package(module: str, files: dict[str, Path]) -> bool:
    return files[module].name == "__init__.py"


def _absolute(node: ast.ImportFrom, module: str, files: dict[str, Path]) -> str:
    """The module an ImportFrom names, with a relative one resolved against `module`."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if not _is_package(module, files):
        base.pop()  # a plain module's relative imports start from its package
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _known(name: str, files: dict[str, Path]) -> str | None:
    """`name`, or the closest enclosing module of the package that exists (an import of a name
    inside a module is an arrow to that module)."""
    while name:
        if name in files:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(module: str, files: dict[str, Path]) -> set[str]:
    """Modules of the package that `module` imports, anywhere in its file."""
    tree = ast.parse(files[module].read_text(), filename=str(files[module]))
    targets: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, module, files)
            # `from pkg import name`: `name` may be a submodule (an arrow to it) or a name in pkg
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base for alias in node.names]
        else:
            continue
        for name in names:
            if name == PACKAGE or name.startswith(PACKAGE + "."):
                target = _known(name, files)
                if target is not None and target != module:
                    targets.add(target)
    return targets


def import_graph(files: dict[str, Path] | None = None) -> dict[str, set[str]]:
    files = files if files is not None else module_files()
    return {module: imports_of(module, files) for module in files}


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components of more than one module: each holds at least one circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(start: str) -> None:  # iterative: no recursion limit on a deep package
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def shortest_circle(graph: dict[str, set[str]], start: str, within: set[str]) -> list[str]:
    """The shortest chain start -> ... -> start inside one component (breadth first)."""
    came_from: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for nxt in sorted(graph[node] & within):
            if nxt == start:
                chain = [node]
                while chain[-1] != start:
                    chain.append(came_from[chain[-1]])
                return [*reversed(chain), start]
            if nxt not in came_from:
                came_from[nxt] = node
                queue.append(nxt)
    return []


def circles(graph: dict[str, set[str]]) -> list[str]:
    """Readable circles: for each component, the shortest circle through each of its modules
    (duplicates dropped), written a -> b -> c -> a with the package prefix left off."""
    lines = []
    for component in strongly_connected(graph):
        members = set(component)
        seen: set[frozenset[str]] = set()
        short = ", ".join(m.removeprefix(PACKAGE + ".") for m in component)
        lines.append(f"{len(component)} modules import each other: {short}")
        for start in component:
            chain = shortest_circle(graph, start, members)
            if chain and frozenset(chain) not in seen:
                seen.add(frozenset(chain))
                lines.append("  " + " -> ".join(m.removeprefix(PACKAGE + ".") for m in chain))
    return lines


def test_the_graph_sees_every_form_of_import(tmp_path):
    pkg = tmp_path / PACKAGE
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from .leaf import X\n")
    (pkg / "sub" / "leaf.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from kvconnectors.top import T\n"
        "X = 1\n")
    (pkg / "top.py").write_text(
        "import kvconnectors.other\n"
        "def f():\n    from kvconnectors.sub import leaf\n"
        "from kvconnectors import integration\n")
    (pkg / "other.py").write_text("from .sub import X\nfrom . import top\n")
    files = module_files(pkg)
    graph = import_graph(files)
    assert graph == {"kvconnectors": set(), "kvconnectors.sub": {"kvconnectors.sub.leaf"},
                     "kvconnectors.sub.leaf": {"kvconnectors.top"},
                     "kvconnectors.top": {"kvconnectors.other", "kvconnectors.sub.leaf", "kvconnectors"},
                     "kvconnectors.other": {"kvconnectors.sub", "kvconnectors.top"}}
    assert circles(graph) == ["4 modules import each other: other, sub, sub.leaf, top",
                              "  other -> top -> other",
                              "  sub -> sub.leaf -> top -> other -> sub",
                              "  sub.leaf -> top -> sub.leaf"]


def test_no_import_circle_in_the_package():
    found = circles(import_graph())
    assert not found, "import circles in kvconnectors/:\n" + "\n".join(found)


def test_the_mover_imports_nothing_from_the_transport():
    graph = import_graph()
    upward = sorted(f"{module} -> {target}" for module, targets in graph.items()
                    if module.startswith(f"{PACKAGE}.mover")
                    for target in targets if target.startswith(f"{PACKAGE}.transport"))
    assert not upward, "the mover imports the transport:\n" + "\n".join(upward)
