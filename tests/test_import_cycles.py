"""No two modules import each other, however indirectly: a cycle means neither can be read,
tested or moved alone, and an import hidden inside a function to dodge the ``ImportError``
only hides it. The shared piece belongs a layer down.

Every ``import`` in fabric/, tracker/ and webui/ is read with ``ast``, those inside functions
(and under ``if TYPE_CHECKING``) included; an edge goes to each module named (``from x import y``
reaches x, and x.y when y is a module). A package's ``__init__`` counts as the module its name
names, so re-exporting through it is an import like any other."""
from __future__ import annotations

import ast
from pathlib import Path

from tests.test_layout import ROOT, import_base, modules


def graph() -> dict[str, set[str]]:
    """module -> the modules of fabric/, tracker/ and webui/ it imports (itself left out)."""
    found = modules()
    return {name: {t for t in imported(name, path, set(found)) if t != name} for name, path in found.items()}


def imported(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``name`` names in its imports: ``from x import y`` names
    x.y when that is a module, else x (its ``__init__``, which defines y or re-exports it)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = import_base(name, path, node)
            modules_named = {f"{base}.{a.name}" for a in node.names} & known
            out |= modules_named if len(modules_named) == len(node.names) else modules_named | {base}
    return out & known


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected group of modules, as a path that ends where it starts,
    each starting at its smallest name so the message stays the same run to run."""
    out = []
    for group in _groups(edges):
        if len(group) > 1:
            out.append(_cycle_through(min(group), group, edges))
    return sorted(out)


def _groups(edges: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's strongly connected components, iteratively (the graph is hundreds of modules deep)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.add(member)
                        if member == node:
                            break
                    groups.append(group)
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(edges.get(child, ())))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return groups


def _cycle_through(start: str, group: set[str], edges: dict[str, set[str]]) -> list[str]:
    """The shortest path from ``start`` back to itself inside ``group`` (breadth first)."""
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(edges[node] & group):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [start, *reversed(path[:-1]), start] if node != start else [start, start]
                if child not in came_from:
                    came_from[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"{start} is in a group with no cycle through it")


def test_no_module_imports_itself_back():
    found = cycles(graph())
    assert not found, "import cycles:\n" + "\n".join("  " + " -> ".join(c) for c in found)


def test_a_cycle_through_an_import_inside_a_function_is_named(monkeypatch):
    """The negative control: an import hidden in a function body still closes a cycle."""
    wire = ROOT / "fabric" / "wire" / "shard.py"
    text = wire.read_text() + "\n\ndef _late():\n    from ..compute import executor\n"
    original = Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: text if self == wire else original(self, *a, **k))
    found = cycles(graph())
    assert any(c[0] == c[-1] and "fabric.wire.shard" in c and "fabric.compute.executor" in c for c in found)


def test_the_search_names_each_cycle_once_as_a_closed_path():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"f"}, "f": {"e"}, "g": {"a"}}
    assert cycles(edges) == [["a", "b", "c", "a"], ["e", "f", "e"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_every_import_form_is_an_edge(monkeypatch):
    """``import x.y``, ``from . import y`` and a function's own ``from .x import name``."""
    path = ROOT / "fabric" / "wire" / "liveness.py"
    text = "import fabric.wire.shard\nfrom . import protocol\ndef f():\n    from ..compute.kv import KV\n"
    original = Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: text if self == path else original(self, *a, **k))
    assert graph()["fabric.wire.liveness"] == {"fabric.wire.shard", "fabric.wire.protocol", "fabric.compute.kv"}
