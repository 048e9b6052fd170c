"""No import circles among the project's own modules.

Every import counts: module level, under ``if TYPE_CHECKING``, and inside functions (a
function-local import hides a circle from Python's loader, not from a reader). The test
reads the sources with ``ast``; it imports nothing.
"""
from __future__ import annotations

import ast
import os

PACKAGES = ("srt", "constrained", "sampling", "distributed")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _modules() -> dict[str, str]:
    mods = {}
    for package in PACKAGES:
        for folder, _, names in os.walk(os.path.join(ROOT, package)):
            for n in names:
                if n.endswith(".py"):
                    rel = os.path.relpath(os.path.join(folder, n), ROOT)[:-3].replace(os.sep, ".")
                    mods[rel.removesuffix(".__init__")] = os.path.join(folder, n)
    return mods


def _imports(path: str, mods: dict[str, str]) -> set[str]:
    """The project modules ``path`` imports (``from pkg import sub`` names the submodule)."""
    names = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = [f"{node.module}.{a.name}" for a in node.names]
            names.update(s for s in subs if s in mods)
            if not all(s in mods for s in subs):
                names.add(node.module)
    found = set()
    for name in names:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        if name:
            found.add(name)
    return found


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(p, mods) - {m} for m, p in mods.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on_stack, out, counter = {}, {}, [], set(), [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]; counter[0] += 1
        stack.append(root); on_stack.add(root)
        while work:
            v, children = work[-1]
            child = next((w for w in children if w in graph), None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]; counter[0] += 1
                    stack.append(child); on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[v] = min(low[v], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop(); on_stack.discard(w); comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_no_import_circles():
    found = cycles(import_graph())
    assert not found, "import circles: " + "; ".join(" <-> ".join(c) for c in found)


def test_the_detector_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"x": {"y"}, "y": set()}) == []


def test_the_graph_sees_function_local_and_type_checking_imports(tmp_path):
    mods = {"pkg.a": "", "pkg.b": "", "pkg.c": ""}
    src = tmp_path / "a.py"
    src.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import X\n"
                   "def f():\n    from pkg import c\n")
    assert _imports(str(src), mods) == {"pkg.b", "pkg.c"}
