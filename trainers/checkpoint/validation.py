"""Checks around a checkpoint: what a save may hold, whether a step matches its restore target, and agreeing on failures across processes."""

from __future__ import annotations

import json
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from spmd.sharding import path_str

_MAX_MISMATCHES_SHOWN = 5
_MAX_REASON_CHARS = 300


def short(exc: BaseException) -> str:
    """``"Type: message"`` on one line, cut to a few hundred characters (a reason in a log or an error)."""
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    return text if len(text) <= _MAX_REASON_CHARS else text[:_MAX_REASON_CHARS] + "..."


def agree(reason: str | None) -> str | None:
    """A failure on any process is a failure on all (so every process takes the same branch)."""
    if jax.process_count() == 1:
        return reason
    failed = multihost_utils.process_allgather(np.asarray(reason is not None, dtype=np.int32))
    if reason is None and np.any(failed):
        bad = [i for i, f in enumerate(np.ravel(failed)) if f]
        return f"failed on process(es) {bad}"
    return reason


def check_data_state(data_state: Any) -> dict[str, Any]:
    """A copy of ``data_state`` (a JSON round trip), or ValueError."""
    if not isinstance(data_state, dict):
        raise ValueError(f"data_state must be a JSON-serialisable dict, got {type(data_state).__name__}")
    try:
        return json.loads(json.dumps(data_state))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"data_state must be JSON-serialisable: {exc}") from None


def standard_state(state: Any) -> Any:
    """``state`` if its leaves are what ``StandardSave`` takes (arrays, ints, floats), with numpy
    scalars made 0-d arrays as ``StandardSave`` stores them; else ValueError naming the leaf."""
    numpy_scalars = False
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        if isinstance(leaf, (jax.Array, np.ndarray, np.generic)):
            if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
                raise ValueError(
                    f"state{jax.tree_util.keystr(path)} is a typed PRNG key array ({leaf.dtype}); save "
                    "jax.random.key_data(key) and rebuild it with jax.random.wrap_key_data after restore"
                )
            numpy_scalars |= isinstance(leaf, np.generic)
        elif not isinstance(leaf, (int, float)):
            raise ValueError(f"state{jax.tree_util.keystr(path)} is a {type(leaf).__name__}; a checkpoint "
                             "holds arrays, ints and floats")
    return jax.tree.map(lambda x: np.asarray(x) if isinstance(x, np.generic) else x, state) if numpy_scalars else state


def check_abstract(abstract_state: Any) -> None:
    """ValueError unless ``abstract_state`` is a non-empty pytree of ``ShapeDtypeStruct`` with shardings."""
    leaves = jax.tree_util.tree_flatten_with_path(abstract_state)[0]
    if not leaves:
        raise ValueError("abstract_state has no leaves; pass a pytree of jax.ShapeDtypeStruct")
    for path, leaf in leaves:
        if not isinstance(leaf, jax.ShapeDtypeStruct) or leaf.sharding is None:
            raise ValueError(
                f"abstract_state{jax.tree_util.keystr(path)} must be jax.ShapeDtypeStruct(shape, dtype, sharding=...) "
                f"with a sharding, got {leaf!r}"
            )


def check_compatible(step: int, stored_tree: Any, abstract_state: Any) -> None:
    """Raise ValueError naming the first paths whose stored shape/dtype differ from the target."""
    stored = ocp.tree.to_flat_dict(stored_tree)
    expected = ocp.tree.to_flat_dict(ocp.tree.serialize_tree(abstract_state, keep_empty_nodes=True))

    def name(key: tuple[Any, ...]) -> str:
        return path_str(key, drop=()) or "<root>"

    problems = []
    for key in sorted(set(stored) | set(expected), key=name):
        if key not in stored:
            problems.append(f"{name(key)}: not in checkpoint, expected {_describe(expected[key])}")
        elif key not in expected:
            problems.append(f"{name(key)}: in checkpoint as {_describe(stored[key])}, not in target")
        elif _describe(stored[key]) != _describe(expected[key]):
            problems.append(f"{name(key)}: checkpoint {_describe(stored[key])} vs expected {_describe(expected[key])}")
    if problems:
        shown = "\n  ".join(problems[:_MAX_MISMATCHES_SHOWN])
        more = len(problems) - _MAX_MISMATCHES_SHOWN
        tail = f"\n  ... and {more} more" if more > 0 else ""
        raise ValueError(
            f"checkpoint step {step} does not match the restore target ({len(problems)} path(s)):\n  "
            f"{shown}{tail}\nThe model or optimizer config differs from the one that wrote this checkpoint."
        )


def _describe(leaf: Any) -> str:
    dtype = getattr(leaf, "dtype", None)
    return f"{tuple(getattr(leaf, 'shape', ()))} {np.dtype(dtype).name if dtype is not None else type(leaf).__name__}"
