"""The zero-bubble backward split into B (input gradient) and W (weight gradient), W without recompute.

B recomputes its chunk layer by layer from the stashed input keeping each layer's VJP residuals,
then runs the layers' backward with only the equations the input gradient needs; W runs the rest,
the weight-gradient equations, per layer from what B stashed in a W-stash slot: the values those
equations read that B computed or kept (residuals computed from the activations, intermediate
gradients). Residuals computed from the weights alone (the weights, their casts) are rebuilt at W,
not stored per microbatch. Per microbatch: F 1 + B 2 + W 1 chunk forwards, 1F1B's 4. A layer
under ``jax.checkpoint`` keeps its recompute in both B and W (its stash: what its policy saves).
See docs/pipelines.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import Literal, Var

from meshes import compat

Layer = Callable[[list[jax.Array], jax.Array], jax.Array]  # (one layer's leaves, x[b, L, D]) -> y
_CALLS = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr", "remat2": "jaxpr",
          "custom_jvp_call": "call_jaxpr"}


def _inline(jaxpr: Any, consts: Sequence[Any], *args: Any) -> list[Any]:
    """``eval_jaxpr`` inlining calls and one-trip scans: traced, the equations come out flat."""
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))

    def read(v: Any) -> Any:
        return v.val if isinstance(v, Literal) else env[v]

    for eqn in jaxpr.eqns:
        vals, name, params = [read(v) for v in eqn.invars], eqn.primitive.name, eqn.params
        if name == "scan" and params["length"] == 1:
            body = params["jaxpr"]
            nc, nk = compat.scan_consts_carry(params, vals)
            outs = _inline(body.jaxpr, body.consts, *vals[:nc + nk], *(x[0] for x in vals[nc + nk:]))
            outs = [*outs[:nk], *(y[None] for y in outs[nk:])]
        elif name in _CALLS:
            sub = params[_CALLS[name]]
            outs = _inline(sub.jaxpr, sub.consts, *vals) if hasattr(sub, "consts") else _inline(sub, (), *vals)
        else:
            ans = eqn.primitive.bind(*vals, **eqn.primitive.get_bind_params(params))
            outs = ans if eqn.primitive.multiple_results else [ans]
        env.update(zip(eqn.outvars, outs, strict=True))
    return [read(v) for v in jaxpr.outvars]


def _needed(eqns: list[Any], outs: Sequence[Any]) -> set[int]:
    """Indices of the equations the vars ``outs`` depend on."""
    want = {v for v in outs if isinstance(v, Var)}
    idx = set()
    for i in reversed(range(len(eqns))):
        if any(o in want for o in eqns[i].outvars):
            idx.add(i)
            want.update(v for v in eqns[i].invars if isinstance(v, Var))
    return idx


def _run(eqns: list[Any], env: dict[Any, Any], outs: Sequence[Any]) -> list[Any]:
    env = dict(env)
    read = lambda v: v.val if isinstance(v, Literal) else env[v]  # noqa: E731
    for eqn in eqns:
        ans = eqn.primitive.bind(*map(read, eqn.invars), **eqn.primitive.get_bind_params(eqn.params))
        env.update(zip(eqn.outvars, ans if eqn.primitive.multiple_results else [ans], strict=True))
    return [read(v) for v in outs]


class SplitBackward:
    """B and W of one chunk of ``Lc`` layers, ``layer(leaves_l, x)`` each (leaves without the layer dim).

    Built once per traced step from the abstract chunk leaves ``[Lc, ...]`` and input: traces one
    layer's VJP, finds which residuals depend on the input (partial evaluation with the weights
    known), flattens the layer's backward (calls and one-trip scans inlined) and splits its
    equations into those the input gradient needs (B) and the rest of the weight gradient's (W).
    :attr:`stash`: what a W-stash slot holds for one microbatch, each value W reads from B stacked
    over the layers."""

    def __init__(self, layer: Layer, chunk_leaves: Sequence[Any], x: Any):
        self.layer = layer
        p_l = [jax.ShapeDtypeStruct(a.shape[1:], a.dtype) for a in chunk_leaves]
        x_aval = jax.ShapeDtypeStruct(x.shape, x.dtype)
        box: dict[str, Any] = {}

        def residuals(p_l, x):
            leaves, box["tree"] = jax.tree.flatten(jax.vjp(layer, p_l, x)[1])
            return leaves

        closed = jax.make_jaxpr(residuals)(p_l, x_aval)
        tree, n_p = box["tree"], len(p_l)
        avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in closed.jaxpr.outvars]
        known, from_x = compat.partial_eval_jaxpr(closed, [False] * n_p + [True])
        self.known = known  # the layer's leaves -> the residuals computed from them alone (then its own)
        self.from_x = [i for i, u in enumerate(from_x) if u]
        self.from_p = [i for i, u in enumerate(from_x) if not u]

        def backward(leaves, dy):
            return jax.tree.unflatten(tree, leaves)(dy)

        bwd = jax.make_jaxpr(backward)(avals, x_aval)
        flat = jax.make_jaxpr(lambda *a: _inline(bwd.jaxpr, bwd.consts, *a))(*avals, x_aval)
        jaxpr, eqns = flat.jaxpr, flat.jaxpr.eqns
        self.invars, self.consts = jaxpr.invars, dict(zip(jaxpr.constvars, flat.consts, strict=True))
        self.dp_out, self.dx_out = jaxpr.outvars[:n_p], jaxpr.outvars[n_p]
        in_b = _needed(eqns, [self.dx_out])
        w_only = sorted(_needed(eqns, self.dp_out) - in_b)
        self.b_eqns = [eqns[i] for i in sorted(in_b)]
        self.w_eqns = [eqns[i] for i in w_only]
        made = {o for e in self.w_eqns for o in e.outvars}
        skip = made | set(self.consts) | {jaxpr.invars[i] for i in self.from_p}
        reads = [v for e in self.w_eqns for v in e.invars] + list(self.dp_out)
        self.boundary = list(dict.fromkeys(v for v in reads if isinstance(v, Var) and v not in skip))
        read_b = {v for e in self.b_eqns for v in e.invars if isinstance(v, Var)} | set(self.boundary)
        read_b |= {self.dx_out} if isinstance(self.dx_out, Var) else set()
        self.kept = [i for i in self.from_x if jaxpr.invars[i] in read_b]  # what B's forward keeps
        self.n_leaves = len(avals)
        Lc = chunk_leaves[0].shape[0]
        shaped: list[Any] = [v.aval for v in self.boundary]
        self.stash = [jax.ShapeDtypeStruct((Lc, *a.shape), a.dtype) for a in shaped]

    def _env(self, p_l: list[jax.Array]) -> dict[Any, Any]:
        """The consts and the residuals computed from the layer's leaves alone."""
        outs = compat.eval_jaxpr(self.known.jaxpr, self.known.consts, *p_l)
        return {**self.consts, **{self.invars[i]: a for i, a in zip(self.from_p, outs, strict=False)}}

    def bwd_input(self, chunk: list[jax.Array], x: jax.Array, dy: jax.Array) -> tuple[jax.Array, list[jax.Array]]:
        """B: ``(dx, stash values)`` from the chunk's leaves ``[Lc, ...]``, its input and output gradient."""
        def fwd(x, p_l):
            y, vjp = jax.vjp(self.layer, p_l, x)
            leaves = jax.tree.leaves(vjp)
            if len(leaves) != self.n_leaves:
                raise ValueError(f"the layer's VJP has {len(leaves)} residuals here, {self.n_leaves} when traced alone")
            return y, [leaves[i] for i in self.kept]

        # the last layer outside the loop: its output is not needed, so its last matmuls are dropped
        x, res = jax.lax.scan(fwd, x, [a[:-1] for a in chunk])
        last = fwd(x, [a[-1] for a in chunk])[1]
        res = [jnp.concatenate([r, a[None]]) for r, a in zip(res, last, strict=True)]

        def bwd(g, a):  # g: this layer's output gradient
            p_l, res_l = a
            env = {**self._env(p_l), **{self.invars[i]: r for i, r in zip(self.kept, res_l, strict=True)},
                   self.invars[-1]: g}
            outs = _run(self.b_eqns, env, [self.dx_out, *self.boundary])
            return outs[0].astype(g.dtype), outs[1:]

        dx, vals = jax.lax.scan(bwd, dy.astype(x.dtype), (chunk, res), reverse=True)
        return dx, vals

    def weight(self, chunk: list[jax.Array], stash: list[jax.Array]) -> list[jax.Array]:
        """W: the chunk's weight gradient ``[Lc, ...]`` from its leaves and one slot's stash values."""
        def one(_, a):
            p_l, vals = a
            env = {**self._env(p_l), **dict(zip(self.boundary, vals, strict=True))}
            dp = _run(self.w_eqns, env, self.dp_out)
            return None, [jnp.broadcast_to(g, p.shape).astype(p.dtype) for g, p in zip(dp, p_l, strict=True)]

        return jax.lax.scan(one, None, (chunk, stash))[1]
