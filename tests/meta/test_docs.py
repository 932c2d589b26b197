"""The docs: the committed API reference is current, references resolve, and the code keeps its size limits.

- ``docs/api/`` equals what ``docs/build_api.py`` generates from the docstrings now;
- every backticked ``meshes.*`` / ``spmd.*`` / ``trainers.*`` name in docs/*.md, README.md and the
  module docstrings resolves to a module or attribute, and every relative link and backticked repository
  path there points to an existing file;
- every package ``__init__`` exports at most 20 names, no module is over 400 lines, and module
  docstrings stay short (the long explanations live in docs/).
"""

from __future__ import annotations

import ast
import importlib
import pathlib
import re
import sys

import pytest
from helpers.paths import ROOT

DOCS = ROOT / "docs"
PACKAGES = ("meshes", "spmd", "trainers")
MAX_EXPORTS = 20
MAX_LINES = 400
MAX_DOCSTRING_LINES = 12
REGENERATE = ".venv/bin/python docs/build_api.py"

sys.path.insert(0, str(DOCS))
import build_api  # noqa: E402

sys.path.remove(str(DOCS))


def sources() -> list[pathlib.Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def markdown_files() -> list[pathlib.Path]:
    return sorted(DOCS.glob("*.md")) + [ROOT / "README.md"]


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def module_docstring(path: pathlib.Path) -> str:
    return ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""


def without_code_blocks(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)


# -- (a) the committed reference is current ----------------------------------------------------------


def test_api_reference_is_current(tmp_path):
    build_api.write(tmp_path)
    built = {p.name: p.read_text(encoding="utf-8") for p in tmp_path.glob("*.md")}
    committed = {p.name: p.read_text(encoding="utf-8") for p in (DOCS / "api").glob("*.md")}
    stale = sorted(n for n in built.keys() | committed.keys() if built.get(n) != committed.get(n))
    assert not stale, f"docs/api/ is stale ({', '.join(stale)}); regenerate it with: {REGENERATE}"


# -- (b) no broken references ----------------------------------------------------------------------

_BACKTICKED = re.compile(r"`([^`\n]+)`")
_DOTTED = re.compile(r"^~?((?:meshes|spmd|trainers)(?:\.[A-Za-z_][A-Za-z0-9_]*)+)(:[A-Za-z_][A-Za-z0-9_]*)?")
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_REPO_PATH = re.compile(r"^(?:meshes|spmd|trainers|tests|benchmarks|notebooks|docs)/[\w./-]*$")


def resolve(dotted: str) -> bool:
    """Import the longest importable prefix of ``dotted``, getattr the rest."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        name = ".".join(parts[:i])
        try:
            obj = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name is not None and not name.startswith(e.name) and not e.name.startswith(name):
                raise
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def references() -> list[tuple[str, str]]:
    """(where, backticked text) for every markdown file and module docstring."""
    out = []
    for path in markdown_files():
        text = without_code_blocks(path.read_text(encoding="utf-8"))
        out += [(str(path.relative_to(ROOT)), m) for m in _BACKTICKED.findall(text)]
    for path in sources():
        out += [(str(path.relative_to(ROOT)), m) for m in _BACKTICKED.findall(module_docstring(path))]
    return out


def test_dotted_names_resolve():
    broken = []
    for where, text in references():
        m = _DOTTED.match(text.strip())
        if not m:
            continue
        name, attr = m.group(1), m.group(2)
        ok = resolve(name + ("." + attr[1:] if attr else ""))
        if not ok:
            broken.append(f"{where}: `{text}`")
    assert not broken, "names that do not resolve:\n" + "\n".join(sorted(set(broken)))


def test_links_and_paths_exist():
    broken = []
    for path in markdown_files():
        text = path.read_text(encoding="utf-8")
        for target in _LINK.findall(text):
            if re.match(r"^[a-z]+:", target) or target.startswith("#"):
                continue
            if not (path.parent / target.split("#")[0]).exists():
                broken.append(f"{path.relative_to(ROOT)}: link ({target})")
    for where, text in references():
        if _REPO_PATH.match(text) and not (ROOT / text).exists():
            broken.append(f"{where}: path `{text}`")
    assert not broken, "missing files:\n" + "\n".join(sorted(set(broken)))


# -- (c), (d) size limits ----------------------------------------------------------------------------


@pytest.mark.parametrize("package", build_api.packages())
def test_package_exports_at_most_20_names(package):
    names = getattr(importlib.import_module(package), "__all__", [])
    assert len(names) <= MAX_EXPORTS, f"{package}.__all__ has {len(names)} names (at most {MAX_EXPORTS})"


def test_modules_at_most_400_lines():
    long = {str(p.relative_to(ROOT)): n for p in sources() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_module_docstrings_are_short():
    long = {
        module_name(p): n for p in sources() if (n := len(module_docstring(p).splitlines())) > MAX_DOCSTRING_LINES
    }
    assert not long, f"module docstrings over {MAX_DOCSTRING_LINES} lines (move the detail to docs/): {long}"
