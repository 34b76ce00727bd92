"""The packages' layering, from the source alone (ast, no imports): engine < worker < api < {cli, benchmarks}.

A module imports only its own layer and those below (benchmarks never the command line, which imports them for
`gaggle bench`), and no modules import each other in a circle, function-level imports included: two modules
that need each other are one idea split wrongly, or a callback that wants to be a parameter.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS = {"engine": 0, "worker": 1, "api": 2, "cli": 3, "benchmarks": 3}
FORBIDDEN = {("benchmarks", "cli")}  # same layer, one way only


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the layered packages by dotted name (a package by its own name)."""
    found = {}
    for package in LAYERS:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The known modules ``name`` imports anywhere in its body (``if TYPE_CHECKING:`` blocks aside)."""
    tree = ast.parse(path.read_text(), str(path))
    skipped = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and _is_type_checking(node.test)
               for stmt in node.body for n in ast.walk(stmt)}
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            targets |= {_resolve(alias.name, known) for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([node.module] if node.module else []))
            for alias in node.names:  # `from pkg import module` imports that module
                sub = f"{base}.{alias.name}"
                targets.add(sub if sub in known else _resolve(base, known))
    targets.discard(None)
    targets.discard(name)
    return targets


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _resolve(dotted: str, known: dict[str, Path]) -> str | None:
    while dotted and dotted not in known:
        dotted = dotted.rpartition(".")[0]
    return dotted or None


def graph(root: Path = ROOT) -> dict[str, set[str]]:
    known = modules(root)
    return {name: imports(name, path, known) for name, path in known.items()}


def upward_edges(edges: dict[str, set[str]]) -> list[str]:
    bad = []
    for source, targets in sorted(edges.items()):
        for target in sorted(targets):
            a, b = source.split(".")[0], target.split(".")[0]
            if LAYERS[b] > LAYERS[a] or (a, b) in FORBIDDEN:
                bad.append(f"{source} -> {target}")
    return bad


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], 0
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
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
    return sorted(found)


def test_no_package_imports_a_layer_above_it():
    bad = upward_edges(graph())
    assert not bad, "imports of a higher layer (engine < worker < api < cli, benchmarks; benchmarks never cli):\n" \
        + "\n".join(bad)


def test_no_modules_import_each_other():
    edges = graph()
    found = cycles(edges)
    described = [" <-> ".join(c) + ": " + "; ".join(f"{a} -> {b}" for a in c for b in sorted(edges[a]) if b in c)
                 for c in found]
    assert not found, "import cycles:\n" + "\n".join(described)


def test_the_checks_can_fail(tmp_path):
    """A tree with an upward import, a cycle and a benchmark importing the command line is reported as such."""
    files = {"engine/__init__.py": "", "engine/a.py": "from engine import b\nimport worker.w\n",
             "engine/b.py": "def f():\n    from engine.a import x\n",
             "worker/__init__.py": "", "worker/w.py": "from typing import TYPE_CHECKING\n"
                                                       "if TYPE_CHECKING:\n    import api.x\n",
             "api/__init__.py": "", "api/x.py": "from . import y\n", "api/y.py": "",
             "cli/__init__.py": "", "cli/main.py": "import benchmarks.tool\n",
             "benchmarks/__init__.py": "", "benchmarks/tool.py": "from cli.main import main\n"}
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    edges = graph(tmp_path)
    assert edges["api.x"] == {"api.y"} and edges["worker.w"] == set()  # relative; TYPE_CHECKING skipped
    assert upward_edges(edges) == ["benchmarks.tool -> cli.main", "engine.a -> worker.w"]
    assert cycles(edges) == [["benchmarks.tool", "cli.main"], ["engine.a", "engine.b"]]
