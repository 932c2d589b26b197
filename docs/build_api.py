"""Build the API reference (docs/api/) from the packages' docstrings.

    .venv/bin/python docs/build_api.py [OUT_DIR]      # default: docs/api/

One Markdown page per package of ``meshes``, ``spmd`` and ``trainers``: every name in its
``__all__`` with its signature and docstring (classes with their public methods), then its
submodules with their one-line summaries. The output is deterministic (names sorted, memory
addresses removed), so ``tests/meta/test_docs.py`` can compare it with the committed pages.
"""

from __future__ import annotations

import importlib
import inspect
import os
import pathlib
import pkgutil
import re
import sys
import types

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("meshes", "spmd", "trainers")
DEFAULT_OUT = ROOT / "docs" / "api"
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_ROLE = re.compile(r":(?:func|class|mod|meth|attr|data|exc|obj):`~?([^`]+)`")
_DOUBLE = re.compile(r"``([^`]+?)``")


def _setup_devices(n: int = 8) -> None:
    """Simulated CPU devices, in case an import touches the backend (set before jax starts)."""
    if "jax" in sys.modules:
        return
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def packages() -> list[str]:
    """Every package (a module with ``__path__``) of meshes, spmd and trainers, sorted."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    out = []
    for top in PACKAGES:
        pkg = importlib.import_module(top)
        out.append(top)
        for info in pkgutil.walk_packages(pkg.__path__, top + "."):
            if info.ispkg:
                out.append(info.name)
    return sorted(out)


def submodules(package: str) -> list[str]:
    """The direct submodules and subpackages of ``package``, sorted."""
    pkg = importlib.import_module(package)
    return sorted(f"{package}.{info.name}" for info in pkgutil.iter_modules(pkg.__path__)
                  if not info.name.startswith("_"))


def markdown(doc: str) -> str:
    """A docstring as Markdown: reST roles and double backticks become code spans, ``::`` a colon."""
    doc = _ROLE.sub(r"`\1`", doc)
    doc = _DOUBLE.sub(r"`\1`", doc)
    return re.sub(r"::$", ":", doc, flags=re.M)


def docstring(obj: object) -> str:
    """``obj``'s docstring; a module's keeps its indentation (indented examples stay code blocks)."""
    if isinstance(obj, types.ModuleType):
        return (obj.__doc__ or "").strip("\n").rstrip()
    return inspect.getdoc(obj) or ""


def summary(obj: object) -> str:
    """The first line of ``obj``'s docstring, or ''."""
    doc = docstring(obj).strip()
    return markdown(doc.splitlines()[0].strip()) if doc else ""


def signature(obj: object) -> str:
    """``obj``'s signature without memory addresses, or '' when it has none."""
    try:
        sig = str(inspect.signature(obj))
    except (TypeError, ValueError):
        return ""
    return _ADDRESS.sub("", sig)


def _kind(obj: object) -> str:
    if isinstance(obj, types.ModuleType):
        return "module"
    if inspect.isclass(obj):
        return "exception" if issubclass(obj, BaseException) else "class"
    if callable(obj):
        return "function"
    return "constant"


def _own_doc(obj: object) -> str:
    """The docstring written for ``obj`` (not one inherited from its type, for constants)."""
    if _kind(obj) == "constant":
        return ""
    return inspect.getdoc(obj) or ""


def _methods(cls: type) -> list[tuple[str, str, str]]:
    """(name, signature, summary) of the public methods and properties ``cls`` itself defines."""
    out = []
    for name in sorted(vars(cls)):
        if name.startswith("_"):
            continue
        member = vars(cls)[name]
        if isinstance(member, property):
            out.append((name, "", summary(member)))
        elif isinstance(member, (staticmethod, classmethod)):
            out.append((name, signature(member.__func__), summary(member.__func__)))
        elif inspect.isfunction(member):
            out.append((name, signature(member), summary(member)))
    return out


def _constant(obj: object) -> str:
    text = _ADDRESS.sub("", repr(obj))
    return text if len(text) <= 100 and "\n" not in text else f"<{type(obj).__name__}>"


def _member(package: str, name: str) -> object:
    """``package.name``: an attribute, or a submodule a lazy package face imports on use."""
    try:
        return getattr(importlib.import_module(package), name)
    except AttributeError:
        return importlib.import_module(f"{package}.{name}")


def page(package: str) -> str:
    """The Markdown page of one package."""
    pkg = importlib.import_module(package)
    lines = [f"# `{package}`", ""]
    doc = markdown(docstring(pkg))
    if doc:
        lines += [doc, ""]
    names = sorted(getattr(pkg, "__all__", []), key=lambda n: (n.lower(), n))
    if names:
        lines += ["## Names", ""]
    for name in names:
        obj = _member(package, name)
        kind = _kind(obj)
        lines += [f"### `{package}.{name}`", ""]
        if kind == "module":
            lines += [f"module `{obj.__name__}`: {summary(obj)}", ""]
            continue
        if kind == "constant":
            lines += ["```python", f"{name} = {_constant(obj)}", "```", ""]
            continue
        lines += ["```python", f"{kind} {name}{signature(obj)}", "```", ""]
        own = markdown(_own_doc(obj))
        if own:
            lines += [own, ""]
        if kind in ("class", "exception"):
            methods = _methods(obj)
            if methods:
                lines += ["Methods and properties:", ""]
                lines += [f"- `{m}{s}`" + (f": {d}" if d else "") for m, s, d in methods]
                lines.append("")
    subs = submodules(package)
    if subs:
        lines += ["## Modules", ""]
        for sub in subs:
            mod = importlib.import_module(sub)
            link = f"[`{sub}`]({sub}.md)" if hasattr(mod, "__path__") else f"`{sub}`"
            lines.append(f"- {link}: {summary(mod)}")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


# Names removed in 0.1 (pre-1.0: no aliases are kept): old name -> where it is now.
REMOVED = {
    "spmd.DP, DP_TP, FSDP, FSDP_TP, LOGICAL_DIMS, NONE, TP, RulesError": "spmd.rules (same names)",
    "spmd.PRESETS, spmd.rules.PRESETS": "spmd.rules.RULE_SETS",
    "spmd.abstract_model, spmd.variables.abstract_model": "spmd.sharding.abstract_module",
    "spmd.logical_dims, path_str, replicated, spec_for": "spmd.sharding (same names)",
    "spmd.Memory, format_sharding_table, memory, sharding_table, tree_bytes_per_device": "spmd.inspection (same names)",
    "spmd.flops": "spmd.inspection.compiled_flops",
    "spmd.Collective, format_collectives, summarize": "spmd.hlo (same names)",
    "spmd.PipelineConfig, Schedule, get_schedule": "spmd.pipeline (same names)",
    "spmd.ModelVars, format_decisions": "spmd.variables (same names)",
    "spmd.current": "spmd.constraints.active_layout",
    "trainers.lr.ScheduleConfig, make_schedule": "trainers.lr.LRConfig, make_lr_schedule",
    "Config.schedule, override keys schedule.*": "Config.lr, keys lr.*",
    "trainers.state.Sharded": "trainers.state.ShardedState",
    "trainers.planning.planner.estimate": "trainers.planning.planner.estimate_layout",
    "spmd.pipeline.schedules.gpipe, one_f_one_b, interleaved, get_schedule": "spmd.pipeline.builders (get_schedule also spmd.pipeline)",
    "spmd.pipeline.sends.SendPlan, send_plan, SentBytes, sent_bytes, minimum_sends": "spmd.pipeline.schedules",
    "spmd.pipeline.manual": "spmd.manual (shared by pipelines and gradient accumulation)",
    "trainers.launch.cli.EXIT_*": "trainers.launch.exits (cli still imports them)",
}


def index(names: list[str]) -> str:
    lines = ["# API reference", "",
             "Generated from the docstrings by `docs/build_api.py`; do not edit by hand. "
             "Regenerate with `.venv/bin/python docs/build_api.py`.", ""]
    for package in names:
        lines.append(f"- [`{package}`]({package}.md): {summary(importlib.import_module(package))}")
    lines += ["", "## Removed in 0.1", "", "Old names are not kept as aliases before 1.0. Where each one went:", "",
              "| old | now |", "|---|---|"]
    lines += [f"| {old} | {new} |" for old, new in REMOVED.items()]
    return "\n".join(lines) + "\n"


def build() -> dict[str, str]:
    """{file name: Markdown text} of the whole reference."""
    names = packages()
    pages = {f"{p}.md": page(p) for p in names}
    pages["README.md"] = index(names)
    return pages


def write(out_dir: str | os.PathLike = DEFAULT_OUT) -> list[pathlib.Path]:
    """Write the reference into ``out_dir`` (stale pages removed); returns the files written."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pages = build()
    for stale in out.glob("*.md"):
        if stale.name not in pages:
            stale.unlink()
    written = []
    for name, text in sorted(pages.items()):
        path = out / name
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    _setup_devices()
    files = write(argv[0] if argv else DEFAULT_OUT)
    print(f"wrote {len(files)} pages to {files[0].parent}")


if __name__ == "__main__":
    main()
