"""The layout shows the architecture, and stays so: which way each import may point, and
no class or function grown past what a reader can hold (docs/ARCHITECTURE.md).

Every import in the source is read with ``ast``, those inside functions included."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("fabric", "tracker", "webui")
MAX_CLASS_LINES = 350
MAX_FUNCTION_LINES = 50

# package -> (modules it may import from these packages, third-party modules it must not import)
HEAVY = {"torch", "transformers", "numpy", "safetensors", "gguf"}
SOCKETS = {"zmq", "socket", "quart", "hypercorn"}
RULES = {
    "fabric.wire": ({"fabric.wire"}, HEAVY | SOCKETS),
    "fabric.compute": ({"fabric.wire", "fabric.compute"}, SOCKETS),
    "fabric.net": ({"fabric.wire", "fabric.net", "fabric.metrics"}, HEAVY),
    "fabric.toolcalls": ({"fabric.wire", "fabric.toolcalls"}, HEAVY | SOCKETS),
    "fabric.node": ({"fabric.wire", "fabric.compute", "fabric.net", "fabric.node", "fabric.metrics",
                     "fabric.toolcalls"}, {"quart"}),
    "fabric.client": ({"fabric.wire", "fabric.net", "fabric.client", "fabric.toolcalls"}, HEAVY),
    "fabric.fetch": ({"fabric.wire", "fabric.compute.gguf_manifest", "fabric.compute.gguf_partial",
                      "fabric.compute.gguf_info", "fabric.compute.model_ref", "fabric.net", "fabric.client",
                      "fabric.fetch"}, {"torch", "transformers", "quart"}),
    "tracker": ({"fabric.wire", "fabric.net", "fabric.metrics", "tracker"}, HEAVY | {"quart"}),
    "tracker.planner": ({"fabric.wire", "tracker.node_records", "tracker.planner"}, SOCKETS | {"sqlite3", "threading"}),
    "tracker.stats": ({"fabric.wire", "tracker.stats"}, SOCKETS | {"sqlite3", "threading"}),
    "tracker.views": ({"fabric.wire", "tracker"}, SOCKETS | {"sqlite3", "threading"}),
    "webui": ({"fabric", "fabric.wire", "fabric.net", "fabric.client", "fabric.metrics", "fabric.flags",
               "fabric.config", "webui"}, HEAVY),
}


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def imports(name: str, path: Path) -> set[str]:
    """Absolute names of every module ``name`` imports (``from x import y`` gives x.y too,
    for y may be a module)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = import_base(name, path, node)
            out.add(base)
            out |= {f"{base}.{a.name}" for a in node.names}
    return out


def import_base(name: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute module ``from ... import`` names in module ``name``, a relative one resolved."""
    if not node.level:
        return node.module or ""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    parts = package.split(".")
    return ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))


def rule_for(name: str):
    matches = [key for key in RULES if name == key or name.startswith(key + ".")]
    return RULES[max(matches, key=len)] if matches else None


def violations() -> list[str]:
    found = modules()
    bad = []
    for name, path in sorted(found.items()):
        rule = rule_for(name)
        if rule is None:
            continue
        allowed, banned = rule
        for target in sorted(imports(name, path)):
            top = target.split(".")[0]
            if top in banned:
                bad.append(f"{name} imports {target}")
            elif top in PACKAGES and target in found and not any(
                    target == a or target.startswith(a + ".") for a in allowed):
                bad.append(f"{name} imports {target}")
    return bad


def test_imports_point_the_way_the_architecture_says():
    assert violations() == []


def test_the_rules_catch_an_import_the_wrong_way(monkeypatch):
    wire = ROOT / "fabric" / "wire" / "protocol.py"
    text = wire.read_text() + "\nimport torch\nfrom ..node import node\n"
    original = Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: text if self == wire else original(self, *a, **k))
    found = violations()
    assert "fabric.wire.protocol imports torch" in found
    assert "fabric.wire.protocol imports fabric.node" in found


def census() -> list[tuple[int, int, str]]:
    """(lines, limit, where) of every class and function over its limit."""
    over = []
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                limit = MAX_CLASS_LINES if isinstance(node, ast.ClassDef) else MAX_FUNCTION_LINES
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    over.append((lines, limit, f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"))
    return sorted(over, reverse=True)


def test_no_class_or_function_outgrows_a_reader():
    assert census() == []


@pytest.mark.parametrize("package", PACKAGES)
def test_every_module_is_seen(package):
    assert any(name.startswith(package) for name in modules())
