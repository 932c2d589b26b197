"""Imports flow one way: meshes <- spmd <- trainers, and inside trainers: the run <- planning <- launch;
no two modules import each other; only trainers/state.py reads the train state by key.
Checked on the source with ``ast``.

Every ``import x``, ``from x import y``, relative ``from ..x import y`` (resolved against the
importing module's package) and literal ``importlib.import_module("x")`` / ``__import__("x")``
counts, wherever it appears (module level, inside functions, under ``TYPE_CHECKING``).
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest
from helpers.paths import ROOT

PACKAGES = ("meshes", "spmd", "trainers")
# package -> packages it must never import
FORBIDDEN = {"meshes": {"spmd", "trainers"}, "spmd": {"trainers"}, "trainers": set()}
# inside trainers: the run (every other module) never imports planning or launch; planning never imports launch
LAYERS = ("trainers.planning", "trainers.launch")
BEYOND = "<relative import beyond the top-level package>"


def module_name(path: pathlib.Path) -> str:
    """'spmd.models.gpt' for ROOT/spmd/models/gpt.py; 'spmd.models' for its __init__.py."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(source: str, module: str, is_package: bool = False) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``source``, relative ones resolved."""
    package = module.split(".") if is_package else module.split(".")[:-1]
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                out.append((node.lineno, node.module or ""))
                continue
            if node.level - 1 > len(package) - 1:
                out.append((node.lineno, BEYOND))
                continue
            base = package[: len(package) - (node.level - 1)]
            if node.module:
                out.append((node.lineno, ".".join(base + node.module.split("."))))
            else:  # from .. import x: x may be a module of that package
                out += [(node.lineno, ".".join(base + [alias.name])) for alias in node.names]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                out.append((node.lineno, node.args[0].value))
    return out


def violations(source: str, module: str, is_package: bool = False) -> list[str]:
    """Imports in ``source`` (module ``module``) that break the layering."""
    top = module.split(".")[0]
    bad = []
    for line, name in imported_modules(source, module, is_package):
        target = name.split(".")[0]
        if target in FORBIDDEN.get(top, ()) or name.startswith("<") or _above(name, module):
            bad.append(f"{module}:{line} imports {name}")
    return bad


def _layer(module: str) -> int:
    """0 for the run, 1 + index in LAYERS for trainers.planning / trainers.launch and their modules."""
    if module == "trainers.__main__":  # python -m trainers: the CLI's entry point
        return len(LAYERS)
    for i, layer in enumerate(LAYERS):
        if module == layer or module.startswith(layer + "."):
            return i + 1
    return 0


def _above(name: str, module: str) -> bool:
    """Whether trainers module ``module`` imports ``name`` from a layer above its own."""
    if module == "trainers" or not module.startswith("trainers.") or not name.startswith("trainers."):
        return False  # the package face is not a layer; it imports the run only (checked below)
    return _layer(name) > _layer(module)


def sources(package: str) -> list[pathlib.Path]:
    return sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("package", PACKAGES)
def test_layering(package):
    files = sources(package)
    assert files, f"no sources under {ROOT / package}"
    bad = []
    for path in files:
        bad += violations(path.read_text(), module_name(path), path.name == "__init__.py")
    assert bad == [], "imports against the layering (meshes <- spmd <- trainers; run <- planning <- launch):\n" + "\n".join(bad)


def test_the_trainers_face_imports_the_run_only():
    """``import trainers`` must not load the planner or the CLI."""
    names = [n for _, n in imported_modules((ROOT / "trainers" / "__init__.py").read_text(), "trainers", True)]
    assert names and not [n for n in names if _layer(n)], names


def test_the_walk_sees_the_allowed_imports():
    """The checker is not vacuous: it finds the imports that are allowed."""
    found = {}
    for package in PACKAGES:
        names = set()
        for path in sources(package):
            names |= {n.split(".")[0] for _, n in imported_modules(path.read_text(), module_name(path),
                                                                  path.name == "__init__.py")}
        found[package] = names
    assert "jax" in found["meshes"]
    assert "meshes" in found["spmd"]
    assert {"spmd", "meshes"} & found["trainers"]


@pytest.mark.parametrize(
    "module, is_package, source, expected",
    [
        ("meshes.build", False, "import spmd\n", ["meshes.build:1 imports spmd"]),
        ("meshes.build", False, "import numpy\nfrom spmd.rules import Rules\n", ["meshes.build:2 imports spmd.rules"]),
        ("meshes.build", False, "def f():\n    import trainers.optim\n", ["meshes.build:2 imports trainers.optim"]),
        ("meshes.build", False, "from ..spmd import rules\n", [f"meshes.build:1 imports {BEYOND}"]),
        ("spmd.models.gpt", False, "from ...trainers import optim\n", [f"spmd.models.gpt:1 imports {BEYOND}"]),
        ("spmd.models.gpt", False, "import importlib\nimportlib.import_module('trainers.optim')\n",
         ["spmd.models.gpt:2 imports trainers.optim"]),
        ("spmd", True, "from . import rules\nfrom .models import gpt\n", []),
        ("spmd.models.gpt", False, "from .. import rules\nfrom ..stack import Stack\nimport meshes\n", []),
        ("trainers.optim", False, "import spmd\nfrom meshes import make_mesh\n", []),
        ("trainers.config", False, "from trainers.planning.diagnose import check_pipeline\n",
         ["trainers.config:1 imports trainers.planning.diagnose"]),
        ("trainers.planning.planner", False, "from trainers.launch import cli\n",
         ["trainers.planning.planner:1 imports trainers.launch"]),
        ("trainers.launch.cli", False, "from trainers.planning import dry_run\nfrom trainers import loop\n", []),
        ("trainers.planning.costs", False, "from trainers.faults import guard\n", []),
    ],
)
def test_checker_negative_controls(module, is_package, source, expected):
    assert violations(source, module, is_package) == expected


def test_relative_imports_resolve():
    assert imported_modules("from .. import rules\nfrom ..stack import Stack\n", "spmd.models.gpt") == [
        (1, "spmd.rules"), (2, "spmd.stack")]
    assert imported_modules("from .layers import param\n", "spmd.models", is_package=True) == [
        (1, "spmd.models.layers")]
    assert imported_modules("from .build import make_mesh\n", "meshes.presets") == [(1, "meshes.build")]


def import_graph() -> dict[str, set[str]]:
    """module -> the modules of the tree it imports (anywhere in its source), package faces left out:
    ``from spmd.pipeline import sends`` is an edge to ``spmd.pipeline.sends``, ``import spmd`` none."""
    files = {module_name(p): p for package in PACKAGES for p in sources(package)}
    modules = {m for m, p in files.items() if p.name != "__init__.py"}
    graph: dict[str, set[str]] = {}
    for m in modules:
        edges = set()
        for _, name in imported_modules(files[m].read_text(), m):
            for candidate in (name, *(name.rsplit(".", k)[0] for k in (1,))):
                if candidate in modules and candidate != m:
                    edges.add(candidate)
                    break
        graph[m] = edges
    # ``from a.b import c`` where ``a.b.c`` is a module: the walk above saw only ``a.b``; add the module
    for m in modules:
        tree = ast.parse(files[m].read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                graph[m] |= {f"{node.module}.{a.name}" for a in node.names} & (modules - {m})
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of ``graph``: one path per strongly connected component of two or more modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    """No two modules import each other, directly or through others, even from inside a function."""
    found = cycles(import_graph())
    assert found == [], "import circles (module groups that import each other):\n" + "\n".join(map(str, found))


def test_the_circle_check_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


STATE_FIELDS = ("params", "opt_state", "step", "rng", "skipped", "bad_streak", "model_state", "guard", "outer_params",
                "outer_opt_state")
STATE_KEY = re.compile(r"\bstate(?:\.get\(|\[)\s*[\"'](" + "|".join(STATE_FIELDS) + r")[\"']")


def test_only_the_state_module_reads_the_train_state_by_key():
    """The train state is a typed ``trainers.state.TrainState``: code reads ``state.params``, not
    ``state["params"]`` (checkpoints, which store it as a dict, are the one exception; in ``trainers.data``
    a ``state`` is a loader's position)."""
    allowed = ("trainers/state.py", "trainers/checkpoint/", "trainers/data/")  # data/: a loader's own position
    found = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}" for package in (*PACKAGES, "benchmarks")
             for p in sources(package) if not str(p.relative_to(ROOT)).startswith(allowed)
             for n, line in enumerate(p.read_text().splitlines(), 1) if STATE_KEY.search(line)]
    assert found == [], "the train state read by string key:\n" + "\n".join(found)
    assert STATE_KEY.search('x = sharded.state["params"]') and not STATE_KEY.search('data_state["guard"]')
