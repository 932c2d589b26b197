"""Hugging Face safetensors straight into the sharded parameters, and back out.

:func:`load_params` builds every parameter with ``jax.make_array_from_callback``: each device's
shard is read from the files as the slices of the Hugging Face tensors it covers (a layer's
``q_proj`` rows for this device's heads, ...), so a process reads only what its devices hold
and never the whole model. Everything is checked first (:func:`plan`): a missing, extra or
misshapen tensor, or a non-float dtype, is one message naming the tensor and both shapes, before
anything is allocated on a device. :func:`hf_tensors` is the inverse, one parameter at a time.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import ml_dtypes
import numpy as np

from spmd.interchange.families import Family, Tensor, tensors_of
from spmd.interchange.safetensors_io import FLOAT_DTYPES, SafetensorsFolder
from spmd.models.gpt import GPTConfig

NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def _groups(theirs: str) -> list[list[str]]:
    """``"(h k) d"`` -> ``[["h", "k"], ["d"]]``."""
    return [g[1:-1].split() if g.startswith("(") else [g] for g in re.findall(r"\([^)]*\)|\w+", theirs)]


def _sizes(t: Tensor, shape: tuple[int, ...]) -> dict[str, int]:
    dims = t.ours.split()
    if len(dims) != len(shape):
        raise ValueError(f"parameter {t.path} of shape {shape} does not have the dims {t.ours!r} of its table row")
    return dict(zip(dims, shape))


def _picks(t: Tensor, ranges: Mapping[str, range]) -> Iterator[dict[str, int]]:
    src = t.source_dims()
    for values in itertools.product(*(ranges[d] for d in src)):
        yield dict(zip(src, values))


def _their_shape(t: Tensor, sizes: Mapping[str, int]) -> tuple[int, ...]:
    return tuple(math.prod(sizes[a] for a in g) for g in _groups(t.theirs))


def plan(folder: SafetensorsFolder, family: Family, cfg: GPTConfig, shapes: Mapping[str, tuple[int, ...]]) -> None:
    """Check ``folder`` against a ``cfg`` model whose parameters have ``shapes`` (path -> shape): every
    tensor present with the shape the model needs and a float dtype, no tensor left over. Raises
    one ValueError naming the tensor (or tensors) and both shapes."""
    used = set()
    rows = tensors_of(family, cfg)
    if {t.path for t in rows} != set(shapes):
        raise ValueError(f"the {family.model_type} table covers {sorted(t.path for t in rows)}, the model has "
                         f"parameters {sorted(shapes)}")
    for t in rows:
        sizes = _sizes(t, shapes[t.path])
        for d, names in t.choices:
            if sizes[d] != len(names):
                raise ValueError(f"parameter {t.path} dim {d} has size {sizes[d]}, its table row {len(names)} names")
        want = _their_shape(t, sizes)
        for picks in _picks(t, {d: range(sizes[d]) for d in t.source_dims()}):
            name = t.names(picks)
            used.add(name)
            if name not in folder.shapes:
                raise ValueError(f"the checkpoint has no tensor {name} (shape {want} for parameter {t.path} "
                                 f"of shape {shapes[t.path]})")
            if folder.shapes[name] != want:
                raise ValueError(f"tensor {name} has shape {folder.shapes[name]}, the model config needs {want} "
                                 f"(parameter {t.path} of shape {shapes[t.path]})")
            if folder.dtypes[name] not in FLOAT_DTYPES:
                raise ValueError(f"tensor {name} has dtype {folder.dtypes[name]}; parameters load from {FLOAT_DTYPES}")
    ignored = [re.compile(p) for p in family.ignored] + ([re.compile("lm_head.weight")] if cfg.tie_embeddings else [])
    extra = [n for n in folder.names if n not in used and not any(p.fullmatch(n) for p in ignored)]
    if extra:
        raise ValueError(f"the checkpoint has {len(extra)} tensor(s) a {family.model_type} model of this config "
                         f"does not: {', '.join(extra[:5])}{' ...' if len(extra) > 5 else ''} (shape "
                         f"{folder.shapes[extra[0]]})")


def read_block(folder: SafetensorsFolder, t: Tensor, sizes: Mapping[str, int], bounds: tuple[tuple[int, int], ...],
               dtype: Any) -> np.ndarray:
    """The block ``bounds`` (one ``(start, stop)`` per dim of ``ours``) of parameter ``t``, read from the
    Hugging Face tensors it covers: only the rows of each tensor that it needs (whole inner dims of a
    fused ``(h k)`` dim, then sliced)."""
    ours = t.ours.split()
    rng = dict(zip(ours, bounds))
    src = t.source_dims()
    groups = _groups(t.theirs)
    atoms = [a for g in groups for a in g]
    keep = [d for d in ours if d not in src]
    out = np.empty([b - a for a, b in bounds], dtype)
    for picks in _picks(t, {d: range(*rng[d]) for d in src}):
        index, shape, inner = [], [], []
        for g in groups:
            step = math.prod(sizes[a] for a in g[1:])
            index.append(slice(rng[g[0]][0] * step, rng[g[0]][1] * step))
            shape += [rng[g[0]][1] - rng[g[0]][0]] + [sizes[a] for a in g[1:]]
            inner += [slice(None)] + [slice(*rng[a]) for a in g[1:]]
        block = folder.read(t.names(picks), tuple(index)).reshape(shape)[tuple(inner)]
        block = block.transpose([atoms.index(d) for d in keep])
        out[tuple(picks[d] - rng[d][0] if d in src else slice(None) for d in ours)] = block
    return out


def load_params(folder: SafetensorsFolder, family: Family, cfg: GPTConfig, targets: Mapping[str, Any]) -> dict:
    """Parameters (path -> ``jax.Array``) for ``targets`` (path -> ``ShapeDtypeStruct`` with a sharding),
    each of this process's device shards read from ``folder``. Call :func:`plan` first.

    Devices holding the same block (replicated dims) share one read; each block goes to its devices
    and is dropped before the next is read, so host memory beyond the loaded shards is one block."""
    rows = {t.path: t for t in tensors_of(family, cfg)}
    out = {}
    for path, target in targets.items():
        t = rows[path]
        sizes = _sizes(t, target.shape)
        by_block: dict[tuple, list] = {}
        for device, index in target.sharding.addressable_devices_indices_map(target.shape).items():
            bounds = tuple(sl.indices(n)[:2] for sl, n in zip(index, target.shape))
            by_block.setdefault(bounds, []).append(device)
        shards = {}
        for bounds, devices in by_block.items():
            block = read_block(folder, t, sizes, bounds, target.dtype)
            shards.update({d: jax.device_put(block, d) for d in devices})
            del block
        arrays = [shards[d] for d in target.sharding.addressable_devices]
        out[path] = jax.make_array_from_single_device_arrays(target.shape, target.sharding, arrays)
    return out


def hf_tensors(family: Family, cfg: GPTConfig, params: Mapping[str, Any], dtype: str = "float32"
               ) -> Iterator[tuple[str, np.ndarray]]:
    """``(Hugging Face name, array in dtype)`` for every tensor of a ``cfg`` model with ``params`` (path ->
    array); one parameter is on the host at a time. A scaled tied head becomes ``lm_head.weight``."""
    np_dtype = NP_DTYPES[dtype]
    for t in tensors_of(family, cfg):
        host = np.asarray(jax.device_get(params[t.path]))
        sizes = _sizes(t, host.shape)
        src = t.source_dims()
        atoms = [a for g in _groups(t.theirs) for a in g]
        keep = [d for d in t.ours.split() if d not in src]
        for picks in _picks(t, {d: range(sizes[d]) for d in src}):
            block = host[tuple(picks[d] if d in src else slice(None) for d in t.ours.split())]
            block = block.transpose([keep.index(a) for a in atoms]).reshape(_their_shape(t, sizes))
            yield t.names(picks), block.astype(np_dtype)
        if t.path == "embed" and cfg.tie_embeddings and cfg.tied_head_scale:
            yield "lm_head.weight", (host * np.float32(cfg.d_model**-0.5)).astype(np_dtype)
