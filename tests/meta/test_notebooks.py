"""The notebooks run: every notebooks/*.ipynb, top to bottom, in a fresh kernel, drawing its figures.

Notebooks are tested artifacts, not documentation that rots. Each one found by the glob (there is
no exclude list: a new notebook is picked up by being added) is executed with nbclient in a
``python3`` kernel on 8 simulated CPU devices, from a temporary working directory. The test fails
on any cell error and checks the figures: at least one per notebook, the designed number for the
notebooks listed in ``EXPECTED_FIGURES``, and one from every cell that creates a matplotlib figure.

Cheap static checks run on the stored files: valid nbformat, stored with the outputs of their
current sources (``notebooks/execute.py`` stamps each code cell with its source's hash), the device
set-up in the first code cell, and imports only from the public API of ``meshes``, ``spmd`` and
``trainers`` (their ``__init__`` exports; submodules only where the package exports them). The
execution test also fails when the stored outputs are stale: other output kinds or figure counts.

The kernel shares the test suite's persistent compilation cache (``SPMD_TEST_COMPILE_CACHE`` or
``.jax_cache``), so a re-run compiles almost nothing. Execution tests are marked ``slow`` (they
still run in CI); ``-m "not slow"`` leaves them out locally.
"""

from __future__ import annotations

import importlib.util
import os
import pkgutil
import re
import time
import types
from pathlib import Path

import nbformat
import pytest
from helpers.paths import ROOT

import meshes
import spmd
import trainers

NOTEBOOK_DIR = ROOT / "notebooks"
_spec = importlib.util.spec_from_file_location("notebooks_execute", NOTEBOOK_DIR / "execute.py")
_execute = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_execute)  # notebooks/execute.py: how the stored outputs were made
execute, scrub, source_sha = _execute.execute, _execute.scrub, _execute.source_sha
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
IDS = [p.stem for p in NOTEBOOKS]

# Figures each notebook was designed to draw (image/png outputs). Notebooks not listed here must
# draw at least one.
EXPECTED_FIGURES = {
    "01_meshes_and_shardings": 2,  # device grid of a mesh; train-state bytes per device per rule set
    "02_collectives_by_hand": 1,  # the five collectives, before and after, one row per device
    "03_tensor_and_data_parallel_gpt": 2,  # loss parity; collective bytes per axis for three layouts
    "04_pipelines": 4,  # schedule Gantt charts; bubble vs M against theory; stash depth vs M; pipelined loss curve
    "05_train_a_gpt": 2,  # LR schedule; train/eval loss and gradient norm curves
    "06_from_notebook_to_pod": 1,  # loss curve of the 2-process run
    "07_bring_your_own_model": 2,  # one digit per class; loss and accuracy curves with the resume marked
    "08_long_context_and_experts": 4,  # seq layout; ring schedule work; dispatch per device and expert; load per expert
}
KERNEL = "python3"
FIGURE_CALL = re.compile(r"\bplt\.(subplots|figure)\(")
PACKAGES = {"meshes": meshes, "spmd": spmd, "trainers": trainers}
DEVICE_SETUP = re.compile(r"\bmeshes\.simulate_cpu_devices(?:_unless_accelerator)?\(8\)")
IMPORT = re.compile(r"^\s*(?:from|import)\s+((?:meshes|spmd|trainers)(?:\.\w+)*)", re.MULTILINE)


def test_notebooks_are_found():
    assert NOTEBOOKS, f"no notebooks in {NOTEBOOK_DIR}"
    missing = set(EXPECTED_FIGURES) - set(IDS)
    assert not missing, f"EXPECTED_FIGURES names notebooks that do not exist: {sorted(missing)}"


# ---------------------------------------------------------------------------------------------
# Static checks on the stored files
# ---------------------------------------------------------------------------------------------


def code_cells(nb) -> list:
    return [c for c in nb.cells if c.cell_type == "code"]


def public_submodules(package: types.ModuleType) -> set[str]:
    """Submodules a package exports in ``__all__`` (e.g. ``spmd.hlo``, ``spmd.models``) and its subpackages
    (e.g. ``trainers.planning``), each of which has its own face."""
    exported = {name for name in package.__all__ if isinstance(getattr(package, name, None), types.ModuleType)}
    return exported | {m.name for m in pkgutil.iter_modules(package.__path__) if m.ispkg}


def non_public_imports(source: str) -> list[str]:
    """Imported module paths under meshes/spmd/trainers that are not the public API, and any _src import."""
    bad = []
    for dotted in IMPORT.findall(source):
        package, *rest = dotted.split(".")
        if rest and (len(rest) > 1 or rest[0] not in public_submodules(PACKAGES[package])):
            bad.append(dotted)
    bad += re.findall(r"^\s*(?:from|import)\s+(\S*\b_src\b\S*)", source, re.MULTILINE)
    return bad


def test_import_check_catches_private_modules():
    """Negative control for the import check: private module paths are flagged, public ones are not."""
    ok = "import meshes\nimport spmd\nfrom spmd import collectives as C\nfrom spmd.models import GPT\nimport spmd.hlo\n"
    assert non_public_imports(ok) == []
    ok += "from trainers.planning import dry_run\nfrom spmd.sharding import spec_for\n"
    assert non_public_imports(ok) == []
    bad = ("from spmd.constraints import constrain\nimport trainers.loop\nfrom spmd.models.gpt import GPT\n"
           "from trainers.planning.dryrun import dry_run\nfrom jax._src import xla_bridge\n")
    assert non_public_imports(bad) == ["spmd.constraints", "trainers.loop", "spmd.models.gpt", "trainers.planning.dryrun",
                                       "jax._src"]


def test_device_setup_check():
    """Negative control for the first-cell check: the two helpers with 8 devices pass, anything else fails."""
    ok = ["meshes.simulate_cpu_devices_unless_accelerator(8)", "import meshes\nmeshes.simulate_cpu_devices(8)\n"]
    bad = ["meshes.simulate_cpu_devices(4)", "meshes.simulate_cpu_devices_unless_accelerator()",
           "simulate_cpu_devices(8)"]
    assert [bool(DEVICE_SETUP.search(s)) for s in ok + bad] == [True, True, False, False, False]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_stored_notebook_is_clean(path: Path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    kernelspec = nb.metadata.get("kernelspec", {})
    assert kernelspec.get("name") == KERNEL, f"{path.name}: kernelspec {kernelspec}, expected name {KERNEL!r}"
    cells = code_cells(nb)
    assert cells, f"{path.name} has no code cells"
    stale = [i for i, c in enumerate(cells) if c.metadata.get("spmd", {}).get("source_sha256") != source_sha(c.source)]
    assert not stale, (f"{path.name}: code cells {stale} are stored without the outputs of their current source; "
                       f"run .venv/bin/python notebooks/execute.py {path.stem}")
    assert all(c.execution_count is not None for c in cells), f"{path.name}: stored with cells that never ran"
    volatile = [i for i, c in enumerate(cells) for out in c.outputs if scrub(_text(out)) != _text(out)]
    assert not volatile, f"{path.name}: code cells {volatile} store addresses, temporary paths or timings"
    first = cells[0].source
    assert DEVICE_SETUP.search(first) and "import jax\n" not in first, (
        f"{path.name}: the first code cell must set up the devices before anything imports jax: "
        "meshes.simulate_cpu_devices_unless_accelerator(8) (real devices with an accelerator plugin, else 8 "
        "simulated CPU devices) or meshes.simulate_cpu_devices(8)"
    )
    for i, cell in enumerate(cells):
        bad = non_public_imports(cell.source)
        assert not bad, f"{path.name}, code cell {i}: imports outside the public API: {bad}"


# ---------------------------------------------------------------------------------------------
# Execution
# ---------------------------------------------------------------------------------------------


def figures(cell) -> int:
    return sum(1 for out in cell.get("outputs", []) if "image/png" in out.get("data", {}))


def test_figure_count_can_be_zero():
    """Negative control for the figure checks: a cell without an image output counts zero."""
    text = nbformat.v4.new_code_cell("print(1)", outputs=[nbformat.v4.new_output("stream", name="stdout", text="1\n")])
    image = nbformat.v4.new_code_cell("plt.show()", outputs=[
        nbformat.v4.new_output("display_data", data={"image/png": "iVBORw0KGgo=", "text/plain": "<Figure>"})])
    assert (figures(text), figures(image), figures(nbformat.v4.new_code_cell("x"))) == (0, 1, 0)


def _text(out) -> str:
    """The text of one output (a stream's, or a result's text/plain), for the volatility check."""
    if out.get("output_type") == "stream":
        return out.get("text", "")
    value = out.get("data", {}).get("text/plain", "")
    return "".join(value) if isinstance(value, list) else value


def kinds(cells) -> list[list[str]]:
    """Per code cell, the kinds of its outputs: the result MIME types in order, then the stream names
    present, each once. stdout and stderr are two channels that the kernel flushes on its own timing,
    so how they split and interleave varies from run to run; which streams a cell writes does not."""
    out = []
    for c in cells:
        results = [o.output_type + ":" + ",".join(sorted(k for k in o.get("data", {}) if k != "text/plain"))
                   for o in c.outputs if o.output_type != "stream"]
        out.append(results + sorted({o.get("name") for o in c.outputs if o.output_type == "stream"}))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_notebook_runs(path: Path, tmp_path: Path, record_property):
    from nbclient.exceptions import CellExecutionError

    stored = nbformat.read(path, as_version=4)
    nb = nbformat.read(path, as_version=4)
    for cell in code_cells(nb):
        cell.outputs, cell.execution_count = [], None
    start = time.perf_counter()
    try:  # cwd: tmp_path, nothing is written next to the notebooks
        execute(nb, str(tmp_path), os.environ.get("SPMD_TEST_COMPILE_CACHE"))
    except CellExecutionError as err:
        pytest.fail(f"{path.name} failed in a cell:\n{err}", pytrace=False)
    elapsed = time.perf_counter() - start
    record_property("execution_s", round(elapsed, 1))
    print(f"{path.name}: executed in {elapsed:.1f} s")

    cells = code_cells(nb)
    assert all(c.execution_count is not None for c in cells), f"{path.name}: not every code cell ran"
    errors = [out for c in cells for out in c.outputs if out.output_type == "error"]
    assert not errors, f"{path.name}: error outputs {[(e.ename, e.evalue) for e in errors]}"
    silent = [i for i, c in enumerate(cells) if FIGURE_CALL.search(c.source) and figures(c) == 0]
    assert not silent, f"{path.name}: code cells {silent} create a figure but show none (display(fig) or plt.show())"
    n_figures = sum(figures(c) for c in cells)
    assert n_figures >= 1, f"{path.name} drew no figure"
    if path.stem in EXPECTED_FIGURES:
        assert n_figures == EXPECTED_FIGURES[path.stem], (
            f"{path.name} drew {n_figures} figure(s), designed to draw {EXPECTED_FIGURES[path.stem]}"
        )
    fresh, old = kinds(cells), kinds(code_cells(stored))
    assert fresh == old and n_figures == sum(figures(c) for c in code_cells(stored)), (
        f"{path.name}: the stored outputs are stale (cells whose output kinds differ: "
        f"{[i for i, (a, b) in enumerate(zip(fresh, old)) if a != b]}); run .venv/bin/python notebooks/execute.py "
        f"{path.stem}")
