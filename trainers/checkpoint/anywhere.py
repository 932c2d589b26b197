"""Load a checkpoint's params on any machine, with any device count (one CPU device included), in one call.

    step, params = load_params("runs/gpt-small")          # on this process's first device
    step, params = load_params("runs/gpt-small", sharding=NamedSharding(mesh, P()))

The target is built from the step's stored metadata (shapes, dtypes), so neither the model nor the
mesh that wrote it is needed; every leaf lands whole on ``sharding``. See docs/checkpoints.md.
"""

from __future__ import annotations

import os
from typing import Any

import jax

from trainers.checkpoint.checkpointer import Checkpointer, NoUsableCheckpointError
from trainers.checkpoint.config import CheckpointConfig


def _directory(path: str | os.PathLike[str]) -> str:
    """A run directory's ``checkpoints/`` folder, or ``path`` itself when it holds the steps."""
    text = os.fspath(path)
    nested = os.path.join(text, "checkpoints")
    return nested if "://" not in text and os.path.isdir(nested) else text


def load_params(path: str | os.PathLike[str], *, step: int | None = None,
                sharding: jax.sharding.Sharding | None = None) -> tuple[int, Any]:
    """``(step, params)``: the params of checkpoint ``step`` (default: the newest valid one) of a run
    directory or checkpoint directory, as arrays on ``sharding`` (default: this process's first
    device). Raises ValueError for a missing directory or step, NoUsableCheckpointError when none reads."""
    sharding = sharding or jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    with Checkpointer(_directory(path), CheckpointConfig(), read_only=True) as ck:
        steps = ck.valid_steps()
        if step is None and not steps:
            raise NoUsableCheckpointError(f"no valid checkpoint step in {ck.directory} (steps on disk: {ck.all_steps()})")
        chosen = steps[-1] if step is None else step
        reason, stored = ck._invalid_reason(chosen) if chosen in ck.all_steps() else (None, None)
        if stored is None or "params" not in stored:
            raise ValueError(f"step {chosen!r} of {ck.directory} holds no readable params "
                             f"({reason or 'not a step here'}); valid steps: {steps}")
        target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype, sharding=sharding), stored["params"])
        return ck.restore_params(target, step=chosen)
