"""The zero-bubble backward split into B (input gradient) and W (weight gradient) without recompute in W.

B recomputes its chunk layer by layer from the stashed input, keeping each layer's VJP residuals,
and runs the input-gradient chain back through the layers; it stashes, for W, the residuals the
weight gradients read (those computed from the activations; the ones computed from the weights
alone, the weights themselves or their casts, are rebuilt at W, not stored per microbatch) and each
layer's output gradient ``dy``. W rebuilds every layer's VJP from them and takes its weight
gradient alone: no forward, no input-gradient matmuls. Per microbatch: F 1 + B 2 + W 1 chunk
forwards, 1F1B's 4. See docs/pipelines.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax._src import core as jax_core
from jax._src.interpreters import partial_eval as pe

Layer = Callable[[list[jax.Array], jax.Array], jax.Array]  # (one layer's leaves, x[b, L, D]) -> y


class SplitBackward:
    """B and W of one chunk of ``Lc`` layers, ``layer(leaves_l, x)`` each (leaves without the layer dim).

    Built once per traced step from the abstract chunk leaves ``[Lc, ...]`` and input: traces one
    layer's VJP to find its residual leaves, which of them depend on the input (partial evaluation
    with the weights known), and which of those W reads (dead-code elimination of the weight
    gradient). :attr:`stash` is what a W-stash slot holds for one microbatch: those residuals
    stacked over the layers, then the per-layer output gradients ``dy[Lc, b, L, D]``."""

    def __init__(self, layer: Layer, chunk_leaves: list[Any], x: Any):
        self.layer = layer
        p_l = [jax.ShapeDtypeStruct(a.shape[1:], a.dtype) for a in chunk_leaves]
        x_aval = jax.ShapeDtypeStruct(x.shape, x.dtype)
        box: dict[str, Any] = {}

        def residuals(p_l, x):
            leaves, box["tree"] = jax.tree.flatten(jax.vjp(layer, p_l, x)[1])
            return leaves

        closed = jax.make_jaxpr(residuals)(p_l, x_aval)
        self.tree = box["tree"]
        avals = [v.aval for v in closed.jaxpr.outvars]
        n_p = len(p_l)
        known, _, from_x, _ = pe.partial_eval_jaxpr_nounits(closed, [False] * n_p + [True], instantiate=False)
        self.known = known  # the weights' leaves -> the residuals computed from them alone (then its own)
        self.from_x = [i for i, u in enumerate(from_x) if u]
        self.from_p = [i for i, u in enumerate(from_x) if not u]

        def weight_grad(leaves, dy):
            return jax.tree.unflatten(self.tree, leaves)(dy)[0]

        dy_aval = jax.ShapeDtypeStruct(x.shape, x.dtype)  # a layer maps [b, L, D] to [b, L, D]
        w_jaxpr = jax.make_jaxpr(weight_grad)([jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals], dy_aval)
        _, used = pe.dce_jaxpr(w_jaxpr.jaxpr, True, instantiate=True)
        self.for_w = [i for i in self.from_x if used[i]]  # x-dependent residuals W reads: stashed
        self.avals = avals
        Lc = chunk_leaves[0].shape[0]
        self.stash = [jax.ShapeDtypeStruct((Lc, *avals[i].shape), avals[i].dtype) for i in self.for_w]
        self.stash.append(jax.ShapeDtypeStruct((Lc, *x.shape), x.dtype))

    def _from_weights(self, p_l: list[jax.Array]) -> list[jax.Array]:
        outs = jax_core.eval_jaxpr(self.known.jaxpr, self.known.consts, *p_l)
        return outs[:len(self.from_p)]

    def _vjp(self, p_l: list[jax.Array], from_x: dict[int, jax.Array]) -> Any:
        leaves: list[Any] = [None] * len(self.avals)
        for i, a in zip(self.from_p, self._from_weights(p_l), strict=True):
            leaves[i] = a
        for i in self.from_x:  # the ones W does not read are never used there: zeros, dead code
            leaves[i] = from_x[i] if i in from_x else jnp.zeros(self.avals[i].shape, self.avals[i].dtype)
        return jax.tree.unflatten(self.tree, leaves)

    def bwd_input(self, chunk: list[jax.Array], x: jax.Array, dy: jax.Array) -> tuple[jax.Array, list[jax.Array]]:
        """B: ``(dx, stash values)`` from the chunk's leaves ``[Lc, ...]``, its input and output gradient."""
        def fwd(x, p_l):
            y, vjp = jax.vjp(self.layer, p_l, x)
            leaves = jax.tree.leaves(vjp)
            return y, [leaves[i] for i in self.from_x]

        _, res = jax.lax.scan(fwd, x, chunk)

        def bwd(g, a):  # g: this layer's output gradient
            p_l, res_l = a
            dx = self._vjp(p_l, dict(zip(self.from_x, res_l, strict=True)))(g)[1]  # the weight gradient: dead code
            return dx.astype(g.dtype), g

        dx, dys = jax.lax.scan(bwd, dy.astype(x.dtype), (chunk, res), reverse=True)
        return dx, [res[self.from_x.index(i)] for i in self.for_w] + [dys]

    def weight(self, chunk: list[jax.Array], stash: list[jax.Array]) -> list[jax.Array]:
        """W: the chunk's weight gradient ``[Lc, ...]`` from its leaves and one slot's stash values."""
        def one(_, a):
            p_l, res_l, dy = a
            return None, self._vjp(p_l, dict(zip(self.for_w, res_l, strict=True)))(dy)[0]  # dx: dead code

        return jax.lax.scan(one, None, (chunk, stash[:-1], stash[-1]))[1]
