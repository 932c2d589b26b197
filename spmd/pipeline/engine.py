"""Running a stack of blocks as a pipeline over the ``pipe`` mesh axis, with ``shard_map``.

:func:`run_schedule` splits the stacked layers ``W[L_pipe, ...]`` into chunks, one or more per
stage, and runs the schedule: ``gpipe`` by autodiff through one scan, the others from a
:class:`Schedule` table with a recomputing backward (split into B and W for the zero-bubble ones),
whose ``ppermute`` s carry only the activations the table sends (:mod:`spmd.pipeline.sends`).
See docs/pipelines.md.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from spmd.manual import manual_batch_axes, manual_length_axes, with_inner_rules
from spmd.pipeline.layout import ParamLayout, param_layout
from spmd.pipeline.order import NATURAL, LayerOrder, order_of
from spmd.pipeline.schedules import Schedule
from spmd.pipeline.sends import gpipe_sends, send_plan
from spmd.pipeline.split import SplitBackward
from spmd.pipeline.tables import (
    _FIRST,
    _GSLOT,
    _KIND,
    _M,
    _V,
    _WSLOT,
    _XSLOT,
    _arrivals,
    _build_tables,
    _receive,
    _sender,
)
from spmd.rules import Rules

StageFn = Callable[[Any, jax.Array], jax.Array]  # (chunk params [Lc, ...], x[b, L, D]) -> y
HeadFn = Callable[[Any, jax.Array, jax.Array], tuple[jax.Array, dict]]  # (head params, y, targets) -> (loss, aux)

def _with_slot(branch: Callable, slot: Callable, c: dict) -> tuple:
    """``branch(c)`` with ``c["slot"]``: the W-stash slot's new values, set by B, else ``slot()``, unchanged."""
    c, y, dx = branch(c)
    return ({**c, "slot": slot()} if "slot" not in c else c), y, dx


def _tree_zeros(tree: Any) -> Any:
    return jax.tree.map(jnp.zeros_like, tree)


def _add(a: Any, b: Any) -> Any:
    return jax.tree.map(jnp.add, a, b)


def _gpipe_local(stage_fn: StageFn, head_fn: HeadFn, S: int, M: int, axis: str, remat: bool,
                 layout: ParamLayout, trees: tuple[Any, Any], x_dtype: Any):
    """Per-device GPipe forward: scans over M + S - 1 ticks, each run of ticks sending over the stage pairs
    that carry a microbatch (``sends.gpipe_sends``); autodiff gives the backward. Takes the flattened stage
    and head leaves (``trees``: their treedefs) and gathers them once before the loop; autodiff turns that
    all-gather into the one reduce-scatter of the gradients. Loss and aux come out per device (the caller
    averages them over the manual batch axes); the ``shard_map``'s transpose sums the other parameter
    cotangents over those axes once, at its boundary."""
    stage = jax.checkpoint(stage_fn, prevent_cse=False) if remat else stage_fn

    def run(p_leaves, h_leaves, x_MbLD, tg_MbL):
        s, x_MbLD = jax.lax.axis_index(axis), x_MbLD.astype(x_dtype)
        params = jax.tree.unflatten(trees[0], layout.gather(p_leaves, layout.stage_plans, layout.stage_dtypes))
        head = jax.tree.unflatten(trees[1], layout.gather(h_leaves, layout.head_plans))

        def tick(pairs):
            def one(recv, t):
                y = stage(params, jnp.where(s == 0, x_MbLD[jnp.clip(t, 0, M - 1)], recv))
                return (jax.lax.ppermute(y, axis, list(pairs)) if pairs else jnp.zeros_like(y)), y
            return one

        recv, ys = jnp.zeros_like(x_MbLD[0]), []
        for first, end, pairs in gpipe_sends(S, M):
            recv, y = jax.lax.scan(tick(pairs), recv, jnp.arange(first, end))
            ys.append(y)
        outs = jnp.concatenate(ys)[S - 1:]

        def head_all(outs):
            losses, auxs = jax.lax.map(lambda a: head_fn(head, *a), (outs, tg_MbL))
            return losses.mean(), jax.tree.map(jnp.mean, auxs)

        shape = jax.eval_shape(head_all, outs)
        loss, aux = jax.lax.cond(s == S - 1, head_all, lambda o: _tree_zeros(shape), outs)
        # per device, averaged over the batch axes outside: a pmean here would transpose into a psum of a
        # constant, free to run before the loop's permutes on some devices and after them on others
        return loss[None], jax.tree.map(lambda a: a[None], aux)

    return run


def _table_local(stage_fn: StageFn, head_fn: HeadFn, schedule: Schedule, axis: str, train: bool,
                 layout: ParamLayout, trees: tuple[Any, Any], n_batch: int = 1):
    """Per-device table-driven engine; returns (loss, aux) and, when ``train``, the gradients.

    Takes the flattened stage leaves in chunk order (device s's block: its chunks ``s, s+S, ...``,
    or ``s, 2S-1-s`` in a V) and the head leaves (``trees``: their treedefs) and gathers the ones a
    manual batch axis shards once, before the tick loop. Each tick sends only what the table sends:
    one ``ppermute`` per channel over the pairs of :func:`spmd.pipeline.sends.send_plan`, none on a
    tick without sends; an output whose next chunk is on the same stage is handed over locally.
    With manual batch axes (``n_batch`` devices along them) each device sees its own rows: the loss
    cotangent is ``1/(M*n_batch)``, gradients stay local partial sums at gathered size through every tick and are reduced
    (:meth:`ParamLayout.reduce`) once after the schedule; loss and aux are averaged over them.

    Backward ops recompute their chunk from the stashed input. A schedule with W ops splits them
    (:class:`spmd.pipeline.split.SplitBackward`): B recomputes the chunk layer by layer (``stage_fn``
    on one-layer slices) keeping each layer's VJP residuals and runs only the backward equations the
    input gradient needs; it sends that gradient upstream and keeps, in a W-stash slot, the values
    the remaining weight-gradient equations read (activation residuals, intermediate gradients),
    not the weights. W runs those equations alone: no recompute, no input-gradient matmuls; the
    weight gradient is added to the accumulator.
    """
    batch_axes = layout.batch_axes
    M, V = schedule.n_microbatches, schedule.n_virtual
    table_np, n_x, n_g, n_w = _build_tables(schedule)
    plan = send_plan(schedule)
    send_branches, send_idx = plan.branches()
    arrivals = _arrivals(table_np)
    send = _sender(send_branches, axis, arrivals)

    def stage(leaves, x):
        return stage_fn(jax.tree.unflatten(trees[0], leaves), x)

    def layer(leaves_l, x):  # one layer: the chunk's leaves sliced at one index of their [Lc] dim
        return stage([a[None] for a in leaves_l], x)

    def run(p_leaves, h_leaves, x_MbLD, tg_MbL):
        s = jax.lax.axis_index(axis)
        params = [a.reshape(V, a.shape[0] // V, *a.shape[1:]) for a in layout.gather(p_leaves, layout.stage_plans, layout.stage_dtypes)]
        head = jax.tree.unflatten(trees[1], layout.gather(h_leaves, layout.head_plans))
        table = jnp.asarray(table_np)
        zx = jnp.zeros_like(x_MbLD[0])
        aux_shape = jax.eval_shape(lambda: head_fn(head, zx, tg_MbL[0])[1])
        carry = {
            "stash": jnp.zeros((n_x, *zx.shape), zx.dtype), "gbuf": jnp.zeros((n_g, *zx.shape), zx.dtype),
            "recv": {channel: zx for channel, _, _ in arrivals}, "loss": jnp.zeros((), jnp.float32), "aux": _tree_zeros(aux_shape),
        }
        if train:
            carry.update(pgrad=_tree_zeros(params), hgrad=_tree_zeros(head), dx=jnp.zeros_like(x_MbLD))
        if train and n_w:  # per W slot: what W reads of B's backward, stacked over the chunk's layers
            split = SplitBackward(layer, [a[0] for a in params], zx)
            carry["wstash"] = [jnp.zeros((n_w, *a.shape), a.dtype) for a in split.stash]

        def chunk(v):
            return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, v, keepdims=False), params)

        def tick(c, xs):
            row_all, k_send = xs
            row = jax.lax.dynamic_index_in_dim(row_all, s, keepdims=False)
            kind, m, v, first = row[_KIND], row[_M], row[_V], row[_FIRST]
            xs, gs, ws = (jnp.maximum(row[i], 0) for i in (_XSLOT, _GSLOT, _WSLOT))
            c = _receive(dict(c), row, arrivals)
            x_in = jnp.where(first == 1, x_MbLD[m], c["stash"][xs])
            wstash = c.pop("wstash", None)

            def idle(c):
                return c, zx, zx

            def fwd(c):
                return c, stage(chunk(v), x_in), zx

            def fwd_last(c):
                y = stage(chunk(v), x_in)
                c = dict(c)
                if train:
                    loss, vjp, aux = jax.vjp(lambda h, y: head_fn(h, y, tg_MbL[m]), head, y, has_aux=True)
                    dh, dy = vjp(jnp.full_like(loss, 1.0 / (M * n_batch)))
                    c["hgrad"] = _add(c["hgrad"], dh)
                    c["gbuf"] = c["gbuf"].at[gs].set(dy.astype(zx.dtype))
                else:
                    loss, aux = head_fn(head, y, tg_MbL[m])
                c["loss"] = c["loss"] + loss / M
                c["aux"] = jax.tree.map(lambda a, b: a + b / M, c["aux"], aux)
                return c, zx, zx

            def bwd(c):
                _, vjp = jax.vjp(stage, chunk(v), x_in)
                dp, dx = vjp(c["gbuf"][gs])
                c = dict(c)
                c["pgrad"] = jax.tree.map(lambda acc, g: acc.at[v].add(g), c["pgrad"], dp)
                c["dx"] = c["dx"].at[m].add(jnp.where(first == 1, dx, 0))
                return c, zx, jnp.where(first == 1, 0, dx)

            def bwd_input(c):  # B: recompute the chunk keeping each layer's residuals, input gradient only
                dx, vals = split.bwd_input(chunk(v), x_in, c["gbuf"][gs])
                c = dict(c)
                c["slot"] = vals
                c["dx"] = c["dx"].at[m].add(jnp.where(first == 1, dx, 0))
                return c, zx, jnp.where(first == 1, 0, dx)

            def weight(c):  # W: the weight gradient from what B stashed, no recompute
                dp = split.weight(chunk(v), [buf[ws] for buf in wstash])
                c = dict(c)
                c["pgrad"] = jax.tree.map(lambda acc, g: acc.at[v].add(g), c["pgrad"], dp)
                return c, zx, zx

            if not train:
                branches = [idle, fwd, fwd_last]
            else:
                branches = [idle, fwd, fwd_last, bwd_input, weight] if n_w else [idle, fwd, fwd_last, bwd]
            if wstash is not None:  # the W-stash is written outside the switch: only B's slot comes out of it
                branches = [functools.partial(_with_slot, b, lambda: [buf[ws] for buf in wstash]) for b in branches]
            c, y, dx = jax.lax.switch(jnp.minimum(kind, len(branches) - 1), branches, c)
            if wstash is not None:
                c["wstash"] = [buf.at[ws].set(a) for buf, a in zip(wstash, c.pop("slot"), strict=True)]
            c["recv"] = send(k_send, y + dx)  # one of them is zero
            return c, None

        c, _ = jax.lax.scan(tick, carry, (table, jnp.asarray(send_idx)))
        mean = (lambda a: jax.lax.pmean(a, batch_axes)) if batch_axes else (lambda a: a)
        out = (mean(c["loss"])[None], jax.tree.map(lambda a: mean(a)[None], c["aux"]))
        if not train:
            return out
        # the one gradient reduction over the batch axes per step (dx stays per-device: its rows)
        pgrad = [a.reshape(a.shape[0] * a.shape[1], *a.shape[2:]) for a in c["pgrad"]]
        pgrad = layout.reduce(pgrad, layout.stage_plans, layout.stage_specs)
        hgrad = layout.reduce(jax.tree.leaves(c["hgrad"]), layout.head_plans, layout.head_specs)
        return out, (pgrad, [a[None] for a in hgrad], c["dx"][None])

    return run


def run_schedule(
    stage_fn: StageFn,
    head_fn: HeadFn,
    stage_params: Any,
    head_params: Any,
    x_MbLD: jax.Array,
    targets_MbL: jax.Array,
    *,
    schedule: Schedule,
    mesh: Mesh,
    rules: Rules | None = None,
    remat: bool = False,
    axis: str = "pipe",
    layer_order: LayerOrder | None = None, compute_dtype: Any = None,
) -> tuple[jax.Array, dict]:
    """Mean over microbatches of ``head_fn(head, blocks(x[m]), targets[m])``, run as a pipeline.

    ``stage_params`` leaves are ``[L, ...]`` (L divisible by S*V) in ``layer_order`` (None: the order
    in the variables' metadata, natural for plain arrays); ``stage_fn(params[Lc, ...], x)`` applies
    Lc consecutive layers. The table engine reads the chunk order ``LayerOrder(S, V, placement)`` in place;
    another order is converted to it on every call, an all-to-all of ``(S-1)/S`` of the stack over
    ``pipe`` (and its gradients back). Differentiable w.r.t. ``stage_params``, ``head_params`` and
    ``x_MbLD``, gradients in the params' order. ``rules``: the rule set the model's constraints
    follow (None: plain code), re-targeted inside the ``shard_map``. ``compute_dtype``: the table engine's
    FSDP gathers of stage weight matrices move in it (``spmd.pipeline.layout.gather_dtypes``)."""
    S, M, V = schedule.n_stages, schedule.n_microbatches, schedule.n_virtual
    schedule.validate()  # every table the engine runs: each op once, every dependency met
    if axis not in mesh.shape or mesh.shape[axis] != S:
        raise ValueError(f"schedule has S={S} stages but mesh axis {axis!r} has size {dict(mesh.shape).get(axis)}; "
                         f"they must be equal")
    if x_MbLD.shape[0] != M or targets_MbL.shape[0] != M:
        raise ValueError(f"inputs have {x_MbLD.shape[0]} microbatches, schedule expects M={M}")
    for a in jax.tree.leaves(stage_params):
        if a.shape[0] % (S * V):
            raise ValueError(f"{a.shape[0]} layers do not split into S*V = {S}*{V} = {S * V} equal chunks")
    order = order_of(stage_params) if layer_order is None else layer_order
    chunks = LayerOrder(S, V, schedule.placement)  # what the engine reads: device s's chunks (s, s+S, ... or s, 2S-1-s)
    pip = P(axis)
    bax = manual_batch_axes(mesh, rules, x_MbLD.shape[1], axis)
    lax_ = manual_length_axes(mesh, rules, axis)  # context parallelism: each device its shard of the length
    layout = param_layout(stage_params, head_params, rules, mesh, axis, (*bax, *lax_), compute_dtype)
    if layout is None:  # a parameter layout the manual axes cannot express: keep fsdp automatic
        bax = manual_batch_axes(mesh, rules, x_MbLD.shape[1], axis, shard_params=False)
        layout = param_layout(stage_params, head_params, rules, mesh, axis, (*bax, *lax_), compute_dtype)
    manual = layout.batch_axes  # the axes a device's share of the loss and gradients is a partial over
    n_batch = int(np.prod([mesh.shape[a] for a in manual], dtype=int))
    sm: dict[str, Any] = dict(mesh=mesh, axis_names={axis, *manual}, check_vma=False)
    inner = functools.partial(with_inner_rules, mesh=mesh, rules=rules, axis=axis, batch_axes=manual)
    rows = P(None, bax or None, lax_ or None)  # x[M, B/M, L, ...]: rows over the batch axes, length over seq
    p_leaves, p_def = jax.tree.flatten(stage_params)
    h_leaves, h_def = jax.tree.flatten(head_params)
    trees = (p_def, h_def)
    p_specs, h_specs = list(layout.stage_specs), list(layout.head_specs)
    in_specs = (p_specs, h_specs, rows, rows)

    if schedule.name == "gpipe":
        local = _gpipe_local(stage_fn, head_fn, S, M, axis, remat, layout, trees, x_MbLD.dtype)
        # a narrow x enters in f32 (cast inside): autodiff sums its cotangent over pipe, which XLA:CPU aborts on in bf16
        if mesh.devices.flat[0].platform == "cpu" and x_MbLD.dtype.itemsize < 4:
            x_MbLD = x_MbLD.astype(jnp.float32)
        per_device = P((axis, *manual))  # [S * n_batch]: stage-major
        gpipe_run = jax.shard_map(inner(local), in_specs=in_specs, out_specs=(per_device, per_device), **sm)
        loss, aux = gpipe_run(order.convert(p_leaves, NATURAL), h_leaves, x_MbLD, targets_MbL)
        return jax.tree.map(lambda a: a.reshape(S, n_batch).sum(0).mean(), (loss, aux))

    table = functools.partial(_table_local, stage_fn, head_fn, axis=axis, layout=layout, trees=trees, n_batch=n_batch)
    grad_specs = (p_specs, [P(axis, *spec) for spec in h_specs], P(axis, None, bax or None, lax_ or None))
    train_run = jax.shard_map(inner(table(schedule, train=True)), in_specs=in_specs,
                              out_specs=((pip, pip), grad_specs), **sm)
    eval_run = jax.shard_map(inner(table(schedule.forward_only(), train=False)), in_specs=in_specs,
                             out_specs=(pip, pip), **sm)

    def reduce(out):
        loss, aux = out
        return loss.sum(), jax.tree.map(lambda a: a.sum(), aux)

    @jax.custom_vjp
    def run(params, head, x, tg):
        return reduce(eval_run(order.convert(params, chunks), head, x, tg))

    def run_fwd(params, head, x, tg):
        out, (pgrad, hgrad, dx) = train_run(order.convert(params, chunks), head, x, tg)
        grads = (chunks.convert(pgrad, order), [a.sum(0) for a in hgrad], dx.sum(0))
        return reduce(out), grads

    def run_bwd(grads, cts):
        g = cts[0]
        return (*jax.tree.map(lambda a: (a * g).astype(a.dtype), grads), None)

    run.defvjp(run_fwd, run_bwd)
    return run(p_leaves, h_leaves, x_MbLD, targets_MbL)
