"""Who an error raised while tracing a task belongs to: the user's task, a refusal of the toolkit, or a toolkit bug.

The loop traces the task's model and loss on the first batch. An exception there is reported by where
it was raised (:func:`attribute`): in the task's own code, or a :class:`ContractError` the toolkit raises
on what the task returned (a contract violation: :class:`TaskError`, exit 2 from the CLI), as a
``ValueError`` raised by the toolkit itself (a refusal with its own message: unchanged, exit 2), or
inside the libraries the toolkit depends on (jax, flax, optax, ...) while the toolkit was calling them
(a bug in the toolkit: :class:`InternalError`, exit 1, the original traceback chained).

A frame is the task's when it is neither the toolkit's nor the standard library's nor in one of the
toolkit's own dependencies (:func:`frame_owner`), wherever it is installed: a task installed into
site-packages, and any library only the task calls, are the task's.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import sysconfig
import traceback
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

import meshes
import spmd

_TOOLKIT = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (meshes, spmd))
_TRAINERS = os.path.dirname(os.path.abspath(__file__)) + os.sep
_STDLIB = tuple({os.path.abspath(sysconfig.get_paths()[k]) + os.sep for k in ("stdlib", "platstdlib")}
                | {os.path.dirname(os.__file__) + os.sep})
_INSTALLED = re.compile(r"[/\\](?:site|dist)-packages[/\\]([^/\\]+)")
# the toolkit's dependencies' import names, when its distribution metadata cannot be read (a source checkout)
_KNOWN_DEPENDENCIES = frozenset({
    "jax", "jaxlib", "jax_plugins", "jax_cuda12_plugin", "jax_cuda12_pjrt", "libtpu", "flax", "optax", "orbax", "grain",
    "numpy", "ml_dtypes", "tqdm", "tensorboardX", "yaml", "_yaml", "tokenizers", "pyarrow", "safetensors", "datasets",
    "absl", "etils", "opt_einsum", "tensorstore", "msgpack", "google", "typing_extensions", "rich", "treescope",
    "scipy", "chex", "toolz", "array_record", "cloudpickle", "simplejson", "humanize", "aiofiles", "nest_asyncio"})


class TaskError(ValueError):
    """The task's model, loss or metrics failed on the first batch (a contract violation)."""


class ContractError(TypeError):
    """What the task returned breaks the task contract (docs/training.md): raised by the toolkit's checks of
    a loss's or a metric's result, reported as the task's error (exit 2), never as a toolkit bug."""


class InternalError(RuntimeError):
    """An error inside the toolkit's own code path: a bug, whatever the task."""


@functools.cache
def dependencies() -> frozenset[str]:
    """The import names of the toolkit's dependencies and of theirs (installed distribution metadata: the
    toolkit's optional extras but its test and lint tools, its dependencies' requirements without their
    extras), with :data:`_KNOWN_DEPENDENCIES`."""
    from importlib import metadata

    try:
        modules_of: dict[str, list[str]] = {}
        for module, dists in metadata.packages_distributions().items():
            for dist in dists:
                modules_of.setdefault(_canonical(dist), []).append(module)
        todo, seen = ["spmd"], set()
        while todo:
            name = todo.pop()
            if name in seen:
                continue
            seen.add(name)
            try:
                requires = metadata.requires(name) or []
            except metadata.PackageNotFoundError:  # an extra's package that is not installed
                continue
            for req in requires:
                extra = re.search(r"extra\s*==\s*[\"']([^\"']+)[\"']", req)
                if extra and (name != "spmd" or extra.group(1) in ("test", "lint")):
                    continue
                todo.append(_canonical(re.split(r"[\s\[<>=!~;(]", req.strip(), maxsplit=1)[0]))
    except Exception:  # noqa: BLE001  # unreadable metadata is never a reason to misreport an error
        return _KNOWN_DEPENDENCIES
    return _KNOWN_DEPENDENCIES | {m for dist in seen - {"spmd"} for m in modules_of.get(dist, [])}


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def frame_owner(filename: str) -> str:
    """``"toolkit"`` (meshes, spmd, trainers), ``"library"`` (the standard library, or a package the
    toolkit depends on) or ``"task"`` (anything else: the user's files, a task installed into
    site-packages, a library only the task uses)."""
    if filename.startswith("<frozen") or filename.startswith("<built-in"):
        return "library"
    path = os.path.abspath(filename)
    if path.startswith(_TOOLKIT + (_TRAINERS,)):
        return "toolkit"
    installed = _INSTALLED.search(path)
    if installed:
        top = installed.group(1)
        top = top[:-3] if top.endswith(".py") else top.split(".")[0]  # a module file, or foo.libs / foo-1.0.dist-info
        return "library" if top in dependencies() else "task"
    return "library" if path.startswith(_STDLIB) else "task"


def owner(exc: BaseException) -> str:
    """``"task"``, ``"toolkit"`` or ``"library"``: who wrote the innermost frame of ``exc``'s traceback
    that is not in a library (:func:`frame_owner`; ``"library"``: none is)."""
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        who = frame_owner(frame.filename)
        if who != "library":
            return who
    return "library"


def task_frame(exc: BaseException) -> str:
    """`` at FILE:LINE in FUNCTION`` of the innermost frame of ``exc``'s traceback that is the task's, or ""."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if frame_owner(f.filename) == "task"]
    return f" at {frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}" if frames else ""


def attribute(exc: BaseException, task_name: str, what: str, describe: str) -> BaseException:
    """The exception to raise in place of ``exc`` (see the module docstring)."""
    who = owner(exc)
    if who == "task" or isinstance(exc, ContractError):
        return TaskError(f"task {task_name!r}: {what} failed on the first batch {describe}: "
                         f"{type(exc).__name__}: {exc}. The contract: loss(model, batch, rngs) -> scalar or "
                         "(scalar, {name: scalar}); eval metrics (model, batch) -> one value per example; every "
                         "batch leaf has the batch as its leading dim")
    raised_here = os.path.abspath(traceback.extract_tb(exc.__traceback__)[-1].filename).startswith(_TOOLKIT + (_TRAINERS,))
    if who == "toolkit" and raised_here and isinstance(exc, ValueError):
        return exc  # the toolkit refuses this combination, and its message says why
    return InternalError(f"{what} of task {task_name!r} failed inside the toolkit: {type(exc).__name__}: {exc}. "
                         "This is a bug in spmd, not in the task")


def describe_batch(batch: Any) -> str:
    """``{'image': float32[64, 8, 8, 1], 'label': int32[64]}``: a batch's structure, shapes and dtypes."""
    leaves = jax.tree_util.tree_flatten_with_path(batch)[0]
    return "{" + ", ".join(f"{spmd.sharding.path_str(p) or '<root>'!r}: {np.dtype(x.dtype).name}{list(x.shape)}"
                           for p, x in leaves) + "}"


@contextlib.contextmanager
def first_batch(task_name: str, batch: Any, what: str) -> Iterator[None]:
    """Errors raised while tracing the task on its first batch say whose they are (:func:`attribute`)."""
    try:
        yield
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
        blamed = attribute(exc, task_name, what, describe_batch(batch))  # the task, a refusal, or a toolkit bug
        if blamed is exc:
            raise
        raise blamed from exc
