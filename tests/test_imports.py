"""The package's import graph, read with `ast` from the sources: no two modules import each other (directly or
through others), and no module imports another module's private (underscore) names. Every import counts: `import`
and `from` statements anywhere (inside functions and `if TYPE_CHECKING:` blocks too) and `importlib.import_module`
calls, whose target may be an f-string (`f"{__package__}.{self.name}_launch"`: every module of that form)."""

from __future__ import annotations

import ast
import re
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


def _dynamic(node: ast.Call, name: str, package: str, modules: dict[str, Path]) -> list[str]:
    """The package's modules an `importlib.import_module(...)` call may import: a string's, or, for an f-string,
    every module its pattern matches (`__package__` and `__name__` are this module's; any other value any name)."""
    func = node.func
    called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    if called != "import_module" or not node.args:
        return []
    arg = node.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        pattern = re.escape(arg.value)
    elif isinstance(arg, ast.JoinedStr):
        known = {"__package__": package, "__name__": name}
        pattern = "".join(re.escape(part.value) if isinstance(part, ast.Constant)
                          else re.escape(known[part.value.id]) if getattr(part.value, "id", None) in known
                          else r"[\w.]+" for part in arg.values)
    else:
        return []
    return [module for module in modules if re.fullmatch(pattern, module)]


def _imports(name: str, path: Path, modules: dict[str, Path]):
    """(imported module, imported names) pairs of module `name`, resolved within the package."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            for target in _dynamic(node, name, package, modules):
                yield target, ()
        elif isinstance(node, ast.Import):
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


def test_the_checker_sees_imports_inside_functions_type_checking_and_importlib(tmp_path):
    """Each kind of import the graph must hold, on a throwaway package: a loop through each is found."""
    sources = {
        "__init__.py": "",
        "a.py": "def f():\n    from . import b\n",
        "b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .c import C\n",
        "c.py": "import importlib\n\ndef plan(name):\n    return importlib.import_module(f'{__package__}.{name}_launch')\n",
        "x_launch.py": "from .a import f\n",
        "d.py": "import importlib\nimportlib.import_module('normtune.a')\n",
    }
    modules = {}
    for file, text in sources.items():
        (tmp_path / file).write_text(text)
        modules["normtune" if file == "__init__.py" else f"normtune.{file[:-3]}"] = tmp_path / file
    graph = {name: {t for t, _ in _imports(name, path, modules)} for name, path in modules.items()}
    assert graph == {"normtune": set(), "normtune.a": {"normtune.b"}, "normtune.b": {"normtune.c"}, "normtune.c": {"normtune.x_launch"},
                     "normtune.x_launch": {"normtune.a"}, "normtune.d": {"normtune.a"}}
    assert _cycles(graph) == [["normtune.a", "normtune.b", "normtune.c", "normtune.x_launch"]]
    real, _ = _graph()  # the strategies' launch modules, imported by name on a strategy's first launch
    assert {"normtune.kernels.strategies.rows_launch", "normtune.kernels.strategies.dual_launch"} \
        <= real["normtune.kernels.strategies.base"]


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


# kernels/ by seam, bottom to top: the values, the strategies and the kernels (the package's own modules,
# strategies/, backward/), then select/ (which config runs), api/ (the call path: functions, modules, ops), and
# patching/ (`normtune.patch`). A room imports only rooms below it; the package's `__init__` re-exports from all.
KERNEL_LAYERS = {f"{PACKAGE}.kernels.select": 1, f"{PACKAGE}.kernels.api": 2, f"{PACKAGE}.kernels.patching": 3}


def test_the_kernels_subpackages_are_layered():
    rooms = _rooms(_graph()[0], f"{PACKAGE}.kernels")
    assert set(KERNEL_LAYERS) <= set(rooms)
    wrong = []
    for name, targets in rooms.items():
        if name == f"{PACKAGE}.kernels" or not name.startswith(f"{PACKAGE}.kernels."):
            continue  # the package's __init__, and everything above kernels/, may import any room
        level = KERNEL_LAYERS.get(name, 0)
        wrong += [f"{name} imports {t}" for t in sorted(targets) if KERNEL_LAYERS.get(t, 0) >= level > 0
                  or (level == 0 and t in KERNEL_LAYERS)]
    assert not wrong, wrong
    assert not [c for c in _cycles(rooms) if set(c) & set(KERNEL_LAYERS)]


def test_no_folder_imports_another_in_a_circle():
    # Each subpackage folded into one node (a top-level module stays its own): kernels/backward/ imports no strategy,
    # the strategies import the backward kernels, and the launch above both (backward_launch.py) imports both.
    folded = _rooms({"normtune.kernels.backward.plan": {"normtune.kernels.strategies.configs"},
                     "normtune.kernels.strategies.rows_launch": {"normtune.kernels.backward.rows"}},
                    f"{PACKAGE}.kernels")
    assert _cycles(folded) == [["normtune.kernels.backward", "normtune.kernels.strategies"]]
    graph, _ = _graph()
    for package in (PACKAGE, f"{PACKAGE}.kernels", f"{PACKAGE}.tuner"):
        assert _cycles(_rooms(graph, package)) == [], package
