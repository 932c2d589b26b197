"""Execute the notebooks and store them with their outputs: ``python notebooks/execute.py [NAME ...]``.

Each notebook runs top to bottom in a fresh ``python3`` kernel on 8 simulated CPU devices (from a
temporary working directory), then is written back with its outputs, figures included, made
reproducible: execution counts renumbered, timing metadata dropped, object addresses, temporary
paths and wall-clock figures (seconds, tokens/s, MFU, dates) replaced by ``…``. Each code cell
records the SHA-256 of its source (``metadata.spmd.source_sha256``): ``tests/meta/test_notebooks.py``
fails when a cell was edited without running this again, or when executing gives other kinds of
output or another number of figures than the stored ones.
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK_DIR = ROOT / "notebooks"
KERNEL = "python3"
CELL_TIMEOUT_S = 300

# Text that changes from run to run, and what it becomes in the stored notebook.
_VOLATILE = [
    (re.compile(r" at 0x[0-9a-fA-F]+"), " at 0x…"),
    (re.compile(r"(/tmp|/var/folders|/private/var)/[\w./\-]+"), "/tmp/…"),
    (re.compile(r"\b\d{4}-\d{2}-\d{2}[ T]\d{2}:\d{2}:\d{2}(?:\.\d+)?"), "…"),
    # a figure followed by a unit of time or throughput (not a key: "tok/s=" is the next key of a log line)
    (re.compile(r"\b\d[\d.,]*(?:e[+-]?\d+)?(?=\s*(?:s|ms|µs|us|min|tok/s|tokens/s|examples/s|steps/s|it/s|FLOP/s)\b(?!=))"),
     "…"),
    (re.compile(r"\b(tok/s|mfu|tokens_per_s|examples_per_s)=[\d.e+\-]+"), r"\1=…"),  # the progress line's
    (re.compile(r'"(time|step_time_s|tokens_per_s|examples_per_s|mfu)": [\d.e+\-]+'), r'"\1": …'),  # metrics.jsonl
    (re.compile(r"\bMFU(\s+)[\d.]+%"), r"MFU\1…%"),
]


def scrub(text: str) -> str:
    """``text`` with addresses, temporary paths, dates and wall-clock figures replaced by ``…``."""
    for pattern, repl in _VOLATILE:
        text = pattern.sub(repl, text)
    return text


def source_sha(source: str) -> str:
    return hashlib.sha256(source.encode("utf-8")).hexdigest()


def kernel_env(cache: str | None = None) -> dict[str, str]:
    """The kernel's environment: 8 simulated CPU devices, Jupyter's inline (Agg) matplotlib backend,
    this source tree on the path, and a persistent compilation cache (``cache``, default ``.jax_cache``)."""
    env = dict(os.environ)
    flag = "--xla_force_host_platform_device_count=8"
    if flag not in env.get("XLA_FLAGS", ""):
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {flag}".strip()
    env["JAX_PLATFORMS"] = "cpu"
    env["MPLBACKEND"] = "module://matplotlib_inline.backend_inline"  # Agg rendering, images as outputs
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    env["JAX_COMPILATION_CACHE_DIR"] = os.path.abspath(cache or str(ROOT / ".jax_cache"))
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    env["TQDM_DISABLE"] = "1"  # progress bars redraw with timings
    return env


def execute(nb, workdir: str, cache: str | None = None):
    """Run ``nb`` (an nbformat notebook, changed in place) in a fresh kernel from ``workdir``."""
    from nbclient import NotebookClient

    client = NotebookClient(nb, kernel_name=KERNEL, timeout=CELL_TIMEOUT_S, startup_timeout=120,
                            resources={"metadata": {"path": workdir}})
    client.execute(env=kernel_env(cache))
    return nb


def normalise(nb):
    """``nb`` made reproducible (see the module docstring), each code cell stamped with its source's hash."""
    count = 0
    nb.metadata.pop("widgets", None)
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
        if cell.cell_type != "code":
            continue
        count += 1
        cell.execution_count = count
        cell.metadata["spmd"] = {"source_sha256": source_sha(cell.source)}
        kept = []
        for out in cell.outputs:
            if out.output_type == "stream" and out.name == "stderr" and not out.text.strip():
                continue
            if out.get("execution_count") is not None:
                out["execution_count"] = count
            if out.output_type == "stream":
                out.text = scrub(out.text)
            for key in ("text/plain", "text/html", "text/markdown"):
                if key in out.get("data", {}):
                    value = out["data"][key]
                    out["data"][key] = scrub("".join(value) if isinstance(value, list) else value)
            if out.output_type == "stream":
                out.pop("metadata", None)
            if out.output_type == "stream" and kept and kept[-1].output_type == "stream" and kept[-1].name == out.name:
                kept[-1].text += out.text  # one stream output however the kernel's flushes split it
                continue
            kept.append(out)
        cell.outputs = kept
    return nb


def run(path: Path) -> float:
    """Execute one notebook and store it with its outputs; returns the seconds it took."""
    import nbformat

    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as workdir:
        execute(nb, workdir)
    nbformat.write(normalise(nb), path)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    names = sys.argv[1:] if argv is None else argv
    paths = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
    if names:
        paths = [p for p in paths if p.stem in names or p.name in names]
        if not paths:
            print(f"no notebook named {names}; valid: {[p.stem for p in sorted(NOTEBOOK_DIR.glob('*.ipynb'))]}",
                  file=sys.stderr)
            return 2
    for path in paths:
        print(f"{path.name}: executed and stored in {run(path):.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
