"""Who an error raised while tracing a task belongs to: the user's task, a refusal of the toolkit, or a toolkit bug.

The loop traces the task's model and loss on the first batch. An exception there is reported by where
it was raised (:func:`attribute`): in the task's own code (a contract violation: :class:`TaskError`,
exit 2 from the CLI), as a ``ValueError`` raised by the toolkit itself (a refusal with its own message:
unchanged, exit 2), or inside jax / flax / optax while the toolkit was calling them (a bug in the
toolkit: :class:`InternalError`, exit 1, the original traceback chained).
"""

from __future__ import annotations

import contextlib
import os
import traceback
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

import meshes
import spmd

_TOOLKIT = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in (meshes, spmd))
_TRAINERS = os.path.dirname(os.path.abspath(__file__)) + os.sep
_LIBRARIES = (os.sep + "site-packages" + os.sep, os.sep + "dist-packages" + os.sep,
              os.path.dirname(os.__file__) + os.sep)  # installed packages and the standard library


class TaskError(ValueError):
    """The task's model, loss or metrics failed on the first batch (a contract violation)."""


class InternalError(RuntimeError):
    """An error inside the toolkit's own code path: a bug, whatever the task."""


def owner(exc: BaseException) -> str:
    """``"task"``, ``"toolkit"`` or ``"library"``: who wrote the innermost frame of ``exc``'s traceback
    that is not in an installed library or the standard library (``"library"``: none is)."""
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        path = os.path.abspath(frame.filename)
        if path.startswith(_TOOLKIT + (_TRAINERS,)):
            return "toolkit"
        if not any(part in path or path.startswith(part) for part in _LIBRARIES):
            return "task"
    return "library"


def attribute(exc: BaseException, task_name: str, what: str, describe: str) -> BaseException:
    """The exception to raise in place of ``exc`` (see the module docstring)."""
    who = owner(exc)
    if who == "task":
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
