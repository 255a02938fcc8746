"""Imports only go down (AGENTS.md, docs/architecture.md "Layers"): cli -> tools -> train -> models ->
parallel -> ops -> protocol -> config, and no module of pithtrain/ imports one that imports it back,
directly or through others. Read with `ast`, so imports inside functions (lazy ones) count too."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "pithtrain"
# Top to bottom; a module may import its own layer (without a circle) or any layer below it.
LAYERS = ("cli", "tools", "train", "models", "parallel", "ops", "protocol", "config")
TOP = {"pithtrain", "pithtrain.__main__", "pithtrain.cli", "pithtrain.launch"}  # the command line's layer


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The pithtrain modules `name` imports anywhere in its source. `from pkg import sub` names the
    submodule; `from pkg.mod import x` names pkg.mod (not its parent package's __init__)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return {m for m in found if m in modules and m != name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _layer(module: str) -> int:
    if module in TOP:
        return 0
    return LAYERS.index(module.split(".")[1])


def test_no_import_circles():
    graph = _graph()
    assert len(graph) > 30 and "pithtrain.train.loop" in graph  # the walk found the package
    circles = []
    for start in sorted(graph):  # depth-first from each module: a path back to it is a circle
        stack = [(start, [start])]
        seen = set()
        while stack:
            node, path = stack.pop()
            for nxt in sorted(graph[node]):
                if nxt == start:
                    circles.append(" -> ".join(path + [start]))
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, path + [nxt]))
    assert not circles, "import circles:\n" + "\n".join(sorted(set(circles)))


def test_imports_go_down():
    graph = _graph()
    upward = [f"{a} imports {b}" for a in sorted(graph) for b in sorted(graph[a]) if _layer(b) < _layer(a)]
    assert not upward, "imports against the layering (cli -> tools -> train -> models -> parallel -> ops -> " \
                       "protocol -> config):\n" + "\n".join(upward)


def test_the_check_sees_a_circle(tmp_path):
    """The walker itself: a lazy import inside a function is an edge."""
    src = tmp_path / "pithtrain"
    (src / "a").mkdir(parents=True)
    (src / "a" / "x.py").write_text("def f():\n    from pithtrain.a.y import g\n")
    (src / "a" / "y.py").write_text("from pithtrain.a import x\n")
    modules = {"pithtrain.a.x": src / "a" / "x.py", "pithtrain.a.y": src / "a" / "y.py"}
    assert _imports("pithtrain.a.x", modules["pithtrain.a.x"], modules) == {"pithtrain.a.y"}
    assert _imports("pithtrain.a.y", modules["pithtrain.a.y"], modules) == {"pithtrain.a.x"}
