"""Hugging Face safetensors straight into the sharded parameters, and back out.

:func:`read_tensors` builds every parameter with ``jax.make_array_from_callback``: each device's
shard is read from the files as the slices of the Hugging Face tensors it covers (a layer's
``q_proj`` rows for this device's heads, ...), so a process reads only what its devices hold
and never the whole model. Everything is checked first (:func:`plan`): a missing, extra or
misshapen tensor, or a non-float dtype, is one message naming the tensor and both shapes, before
anything is allocated on a device; a NaN or Inf is refused as its slice is read (:func:`check_finite`:
the tensor, its file and the first bad value), before it reaches a device. :func:`hf_tensors` is the
inverse, one parameter at a time.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Iterator, Mapping, Sequence
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


def _picks(t: Tensor, ranges: Mapping[str, Sequence[int]]) -> Iterator[dict[str, int]]:
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


def fill_blocks(folder: SafetensorsFolder, t: Tensor, sizes: Mapping[str, int],
                blocks: dict[tuple[tuple[int, int], ...], np.ndarray]) -> None:
    """Fill ``blocks`` (bounds: one ``(start, stop)`` per dim of ``ours`` -> array) of parameter ``t`` from the
    Hugging Face tensors they cover. Each tensor is read once, as the range of its first dim that the
    blocks need (whole rows: a row's bytes are contiguous), then cut into every block that uses it."""
    ours = t.ours.split()
    src = t.source_dims()
    groups = _groups(t.theirs)
    atoms = [a for g in groups for a in g]
    keep = [d for d in ours if d not in src]
    first, step = groups[0][0], math.prod(sizes[a] for a in groups[0][1:])
    bounds_of = {b: dict(zip(ours, b)) for b in blocks}
    needed = {d: sorted({i for b in bounds_of.values() for i in range(*b[d])}) for d in src}
    for picks in _picks(t, needed):
        using = [b for b, r in bounds_of.items() if all(r[d][0] <= picks[d] < r[d][1] for d in src)]
        lo, hi = min(bounds_of[b][first][0] for b in using), max(bounds_of[b][first][1] for b in using)
        data = folder.read(t.names(picks), (slice(lo * step, hi * step),))
        check_finite(data, t.names(picks), folder.file_of(t.names(picks)), first_row=lo * step)
        data = data.reshape([hi - lo] + [sizes[a] for a in atoms[1:]])
        for b in using:
            r = bounds_of[b]
            cut = data[tuple(slice(r[a][0] - lo, r[a][1] - lo) if a == first else slice(*r[a]) for a in atoms)]
            _assign(blocks[b][tuple(picks[d] - r[d][0] if d in src else slice(None) for d in ours)],
                    cut.transpose([atoms.index(d) for d in keep]))
        del data


def check_finite(data: np.ndarray, name: str, file: str, *, first_row: int = 0, chunk: int = 1 << 22) -> None:
    """ValueError when ``data`` (rows ``first_row...`` of tensor ``name`` of ``file``) holds a NaN or an Inf:
    names the tensor, the file, how many values and the first one (its index in the whole tensor).
    Scanned in pieces of ``chunk`` values, so it needs no second copy of the tensor."""
    flat = data.reshape(-1)
    for start in range(0, flat.size, chunk):
        finite = np.isfinite(flat[start:start + chunk])
        if finite.all():
            continue
        first = start + int(np.argmin(finite))
        bad = int(np.count_nonzero(~np.isfinite(flat)))
        index = np.unravel_index(first, data.shape) if data.ndim else ()
        where = (first_row + int(index[0]), *(int(i) for i in index[1:])) if data.ndim else ()
        raise ValueError(f"tensor {name} in {file} holds {bad:,} non-finite value(s) of the {flat.size:,} read "
                         f"(first at index {list(where)}: {flat[first]}); weights must be finite numbers: a NaN or "
                         f"Inf weight makes every loss NaN. The checkpoint is damaged or was saved from a diverged "
                         f"run: load another one")


def _assign(dst: np.ndarray, src: np.ndarray, chunk: int = 1 << 18) -> None:
    """``dst[...] = src`` in pieces of about ``chunk`` elements along the longest dim: a transposing copy
    that stays in cache (3x faster than one numpy assignment of a transposed 16 MiB tensor)."""
    if src.size <= chunk or src.ndim == 0:
        dst[...] = src
        return
    axis = int(np.argmax(src.shape))
    step = max(1, chunk * src.shape[axis] // src.size)
    for i in range(0, src.shape[axis], step):
        piece = (slice(None),) * axis + (slice(i, i + step),)
        dst[piece] = src[piece]


def read_tensors(folder: SafetensorsFolder, family: Family, cfg: GPTConfig, targets: Mapping[str, Any]) -> dict:
    """Parameters (path -> ``jax.Array``) for ``targets`` (path -> ``ShapeDtypeStruct`` with a sharding),
    each of this process's device shards read from ``folder``. Call :func:`plan` first.

    One parameter at a time: its distinct blocks on this process's devices (replicated dims share
    one) are filled tensor by tensor (:func:`fill_blocks`), put on their devices and dropped, so host
    memory beyond the loaded shards is this process's share of one parameter plus one tensor."""
    rows = {t.path: t for t in tensors_of(family, cfg)}
    out = {}
    for path, target in targets.items():
        by_block: dict[tuple, list] = {}
        for device, index in target.sharding.addressable_devices_indices_map(target.shape).items():
            bounds = tuple(sl.indices(n)[:2] for sl, n in zip(index, target.shape))
            by_block.setdefault(bounds, []).append(device)
        blocks = {b: np.empty([hi - lo for lo, hi in b], target.dtype) for b in by_block}
        fill_blocks(folder, rows[path], _sizes(rows[path], target.shape), blocks)
        shards = {d: jax.device_put(blocks[b], d) for b, devices in by_block.items() for d in devices}
        del blocks
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
