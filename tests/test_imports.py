"""The package's import graph, read with `ast` from the sources: no two modules import each other (directly or
through others; imports inside functions count, only `if TYPE_CHECKING:` blocks do not), and no module imports
another module's private (underscore) names."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "normtune"
SKIP = {"tests", "docs", "build", "dist"}


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in SKIP or any(part.startswith(".") for part in rel.parts):
            continue
        parts = [PACKAGE, *rel.with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def _imports(name: str, path: Path, modules: dict[str, Path]):
    """(imported module, imported names) pairs of module `name`, resolved within the package."""
    tree = ast.parse(path.read_text(), str(path))
    skip = _type_checking_lines(tree)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules:
                    yield alias.name, ()
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target not in modules:
                continue
            names = []
            for alias in node.names:
                if f"{target}.{alias.name}" in modules:  # a submodule
                    yield f"{target}.{alias.name}", ()
                else:
                    names.append(alias.name)
            if names:
                yield target, tuple(names)


def _graph():
    modules = _modules()
    graph, private = {}, []
    for name, path in modules.items():
        graph[name] = set()
        for target, names in _imports(name, path, modules):
            if target != name:
                graph[name].add(target)
            private += [f"{name} imports {target}.{n}" for n in names if n.startswith("_") and not n.startswith("__")]
    return graph, private


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_checker_sees_a_cycle_and_a_private_import():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    graph, _ = _graph()
    assert "normtune.kernels.strategies.rows" in graph["normtune.kernels.strategies"]


def test_no_import_cycles():
    graph, _ = _graph()
    assert _cycles(graph) == []


def test_no_private_names_imported_across_modules():
    _, private = _graph()
    assert private == []


def _rooms(graph: dict[str, set[str]], package: str = f"{PACKAGE}.tuner") -> dict[str, set[str]]:
    """The graph with each subpackage of `package` folded into one node (its modules' imports together)."""
    def room(name):
        if not name.startswith(package + "."):
            return name
        return ".".join(name.split(".")[:len(package.split(".")) + 1])

    out: dict[str, set[str]] = {}
    for name, targets in graph.items():
        out.setdefault(room(name), set()).update(room(t) for t in targets if room(t) != room(name))
    return out


def test_the_tuner_subpackages_do_not_import_each_other_in_a_circle():
    folded = _rooms({"normtune.tuner.a.x": {"normtune.tuner.b.y"}, "normtune.tuner.b.z": {"normtune.tuner.a.w"}})
    assert _cycles(folded) == [["normtune.tuner.a", "normtune.tuner.b"]]
    graph, _ = _graph()
    rooms = _rooms(graph)
    assert {"normtune.tuner.store", "normtune.tuner.measure", "normtune.tuner.tables", "normtune.tuner.tune"} \
        <= set(rooms)
    assert _cycles(rooms) == []


def test_the_tune_sits_on_top_of_the_tuner():
    # `normtune tune` drives the sweep, the tables and the store; none of them may depend on it (only its command).
    rooms = _rooms(_graph()[0])
    users = sorted(name for name, targets in rooms.items() if "normtune.tuner.tune" in targets)
    assert users == ["normtune.commands.tune"], users
