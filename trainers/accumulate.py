"""Gradient accumulation over k microbatches with one gradient reduction per step.

The loop runs inside a ``shard_map`` manual over the batch axes: each device sums its own
microbatch gradients, ``G{U_data}``, and one sum after the loop reduces them. ``fsdp_gather``
picks what happens to weights sharded over ``fsdp``: ``"per_microbatch"`` (ZeRO-3: ``fsdp``
stays automatic, ``W[D_fsdp]`` gathered and ``G`` reduce-scattered every microbatch) or
``"per_step"`` (``W[D_fsdp] -> W[D]`` gathered once before the loop, ``G[D]{U_fsdp} -> G[D_fsdp]``
reduce-scattered once after it: full-size weights and accumulator per device). See docs/training.md.

A loss that gathers in the loop's manual region (which the XLA of jax 0.12 aborts partitioning) is
found before compiling and runs the loop under GSPMD instead (:func:`manual_gathers`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from meshes import axis_sizes
from spmd import collectives
from spmd.manual import manual_batch_axes, param_axes, with_inner_rules
from spmd.pipeline.config import split_microbatches
from spmd.rules import Rules, axes_of

log = logging.getLogger(__name__)

# jax versions whose XLA aborts partitioning a gather or scatter inside a partly manual region
# Off: on jax 0.12 the search also counts gathers that XLA partitions fine (a loss's own target lookup) and
# then needlessly reduces every microbatch; the built-in models' lookup no longer aborts (spmd.models.embedding).
GATHER_ABORTS = False
GATHERS = ("gather", "scatter", "scatter-add", "scatter_add", "scatter-mul", "scatter_mul", "scatter-min",
           "scatter_min", "scatter-max", "scatter_max")


def reduction_axes(mesh: Mesh, rules: Rules, batch: Any, grad_accum: int, fsdp_gather: str) -> tuple[str, ...]:
    """The batch axes the loop runs manual over: those the rules split ``batch`` over (size > 1, rows
    per microbatch dividing), less the axes that shard parameters under ``"per_microbatch"``; none on
    a mesh with Explicit axes (the loop then stays under GSPMD)."""
    if any(t == AxisType.Explicit for t in mesh.axis_types):
        return ()
    rows = jax.tree.leaves(batch)[0].shape[0] // grad_accum
    return manual_batch_axes(mesh, rules, rows, axis="", shard_params=fsdp_gather == "per_step")


def per_microbatch_note(mesh: Mesh, rules: Rules, rows: int, grad_accum: int, fsdp_gather: str,
                        why: str | None = None) -> str | None:
    """Why the loop cannot reduce once per step over the batch axes it could (None when it does, or
    nothing is reduced): ``why`` (a reason the caller found, e.g. batch statistics), a mesh with
    Explicit axes, or a microbatch of ``rows / grad_accum`` rows that does not
    divide over the batch axes; names the rows, the axes and their sizes."""
    if grad_accum <= 1:
        return None
    sizes = axis_sizes(mesh)
    skip = set() if fsdp_gather == "per_step" else param_axes(rules)  # per_microbatch over fsdp by design
    wanted = [a for a in axes_of(dict(rules.activations).get("batch")) if sizes.get(a, 1) > 1 and a not in skip]
    manual = reduction_axes(mesh, rules, jax.ShapeDtypeStruct((rows,), jnp.int32), grad_accum, fsdp_gather)
    missing = [a for a in wanted if why or a not in manual]
    if not missing:
        return None
    micro, n = rows // grad_accum, math.prod(sizes[a] for a in wanted)
    where = " x ".join(f"{a}={sizes[a]}" for a in missing)
    if why is None and any(t == AxisType.Explicit for t in mesh.axis_types):
        why = "the mesh has Explicit axes"
    elif why is None:
        why = (f"a microbatch of {micro} rows ({rows} rows / grad_accum={grad_accum}) does not divide over the batch "
               f"axes {' x '.join(f'{a}={sizes[a]}' for a in wanted)}; a batch of rows a multiple of {n * grad_accum} "
               f"reduces once")
    return f"gradient accumulation reduces the gradients over {where} every microbatch ({grad_accum} per step), not once per step: {why}"


def without_axes(sharding: NamedSharding, axes: tuple[str, ...]) -> NamedSharding:
    """``sharding`` with ``axes`` dropped from every dim: ``W[D_fsdp, F_tensor] -> W[D, F_tensor]``."""
    entries = [tuple(a for a in axes_of(e) if a not in axes) or None for e in sharding.spec]
    return NamedSharding(sharding.mesh, P(*(e[0] if e and len(e) == 1 else e for e in entries)))


def accumulate(grad_fn: Callable, params: Any, batch: Any, key: jax.Array, *, grad_accum: int, mesh: Mesh,
               rules: Rules, param_shardings: Any, axes: tuple[str, ...], checked: bool = True):
    """``(grads, loss, aux)``: the mean over ``grad_accum`` microbatches of ``grad_fn(params, {}, mb, key_j)``
    (``(loss, (aux, other)), grads``), reduced once over ``axes``, which are manual in the loop.

    A parameter sharded over a manual axis (``W[D_fsdp]``) is all-gathered before the loop, by
    GSPMD, once. In the loop each device accumulates ``G{U_axes}`` (its rows only); the loop's output
    stacks those partial sums as ``G[n_axes, ...]`` and one sum over that dim, constrained to the
    parameter shardings, reduces them: a reduce-scatter over gathered axes, an all-reduce over the
    rest. Each device's loss is the mean over its rows; loss and aux are averaged over ``axes``
    (rows split evenly: the global mean). Random draws of the loss use ``key_j`` folded with the
    device's index over ``axes``: independent per device, not the single-device draws. ``checked=False``:
    the region's typing unchecked, for a layer's region nested in it (``spmd.models.moe``).
    """
    n = math.prod(axis_sizes(mesh)[a] for a in axes)
    micro = jax.tree.map(lambda x: split_microbatches(x, grad_accum), batch)  # [k, B/k, ...], rows stay put
    batch_spec = jax.tree.map(lambda x: P(None, axes), micro)

    def local(params, micro, key):
        # differentiate a per-device (varying) copy: its gradient stays a local partial sum, where the
        # gradient of an invariant input would be psum-ed at every microbatch (unchecked: always local)
        if checked:
            params = jax.tree.map(lambda x: jax.lax.pcast(x, axes, to="varying"), params)
        device_key = jax.random.fold_in(key, jax.lax.axis_index(axes))

        def body(acc, xs):
            mb, j = xs
            (loss, (aux, _)), g = grad_fn(params, {}, mb, jax.random.fold_in(device_key, j))
            return jax.tree.map(jnp.add, acc, g), (loss, aux)

        acc, (losses, auxs) = jax.lax.scan(body, jax.tree.map(jnp.zeros_like, params), (micro, jnp.arange(grad_accum)))
        loss, aux = collectives.pmean(losses.mean(), axes), jax.tree.map(lambda a: collectives.pmean(a.mean(), axes), auxs)
        return jax.tree.map(lambda g: g[None], acc), loss, aux  # G[1, ...]{U_axes}: one row per device

    inner = with_inner_rules(local, mesh, rules, axes[0], axes)  # constraints name automatic axes only
    loop = jax.shard_map(inner, mesh=mesh, in_specs=(P(), batch_spec, P()), out_specs=(P(axes), P(), P()),
                         axis_names=frozenset(axes), check_vma=checked)
    found = manual_gathers(loop, params, micro, key) if GATHER_ABORTS else {}
    if found:  # at trace time: once per compiled step
        log.warning("gradient accumulation reduces the gradients every microbatch, not once per step: the loss "
                    "runs %s inside the loop's region manual over %s, and the XLA of jax %s aborts the process while "
                    "partitioning those (jax 0.10 compiles them); the loop runs under GSPMD instead", _counted(found),
                    " x ".join(axes), jax.__version__)
        grads, _, loss, aux = accumulate_gspmd(grad_fn, params, {}, batch, key, grad_accum=grad_accum,
                                               param_shardings=param_shardings)
        return grads, loss, aux
    gathered = jax.tree.map(lambda s: without_axes(s, axes), param_shardings)
    params = jax.lax.with_sharding_constraint(params, gathered)  # W[D_fsdp] -> W[D]: once per step
    partial, loss, aux = loop(params, micro, key)
    grads = jax.tree.map(lambda g: g.sum(0) / (grad_accum * n), partial)  # the one reduction
    return jax.lax.with_sharding_constraint(grads, param_shardings), loss, aux


def manual_gathers(loop: Callable, *args: Any) -> dict[str, int]:
    """``{primitive: count}`` of the gathers and scatters that ``loop`` (a function of ``args`` calling a
    ``shard_map``) runs in its manual region, outside any ``shard_map`` nested in it (a region of its
    own, as :func:`spmd.models.embedding.lookup` opens): traced, never compiled."""
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)
    found: dict[str, int] = {}

    def walk(jaxpr: Any, inside: bool) -> None:
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            if name == "shard_map" and inside:
                continue
            if inside and name in GATHERS:
                found[name] = found.get(name, 0) + 1
            for value in eqn.params.values():
                for sub in value if isinstance(value, (tuple, list)) else (value,):
                    sub = getattr(sub, "jaxpr", sub)
                    if hasattr(sub, "eqns"):
                        walk(sub, inside or name == "shard_map")

    walk(jax.make_jaxpr(loop)(*shapes).jaxpr, False)
    return found


def _counted(found: dict[str, int]) -> str:
    return ", ".join(f"{n} {name}{'s' if n > 1 else ''}" for name, n in sorted(found.items()))


def accumulate_gspmd(grad_fn: Callable, params: Any, other: Any, batch: Any, key: jax.Array, *, grad_accum: int,
                     param_shardings: Any):
    """``(grads, other, loss, aux)`` by a loop under GSPMD: the accumulator is constrained to the
    parameter shardings, so every reduction runs once per microbatch; batch statistics and random
    draws are exactly the single-device ones. For models with non-parameter state and pipelines."""
    micro = jax.tree.map(lambda x: split_microbatches(x, grad_accum), batch)

    def body(carry, xs):
        acc, other = carry
        mb, j = xs
        (loss, (aux, other)), g = grad_fn(params, other, mb, jax.random.fold_in(key, j))
        acc = jax.tree.map(jnp.add, acc, g)
        return (jax.lax.with_sharding_constraint(acc, param_shardings), other), (loss, aux)

    zeros = jax.lax.with_sharding_constraint(jax.tree.map(jnp.zeros_like, params), param_shardings)
    (grads, other), (losses, auxs) = jax.lax.scan(body, (zeros, other), (micro, jnp.arange(grad_accum)))
    return jax.tree.map(lambda g: g / grad_accum, grads), other, losses.mean(), jax.tree.map(jnp.mean, auxs)
