"""A stack of identical blocks, stored with a leading ``layers`` dim and run as a scan.

    Stack(lambda rngs: Block(..., rngs=rngs), n_layers, rngs=rngs)

Parameters are ``W[layers, D, F]``; one block is traced once whatever the depth; ``remat`` names what
each block keeps (:mod:`spmd.remat`). See docs/memory.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from spmd import remat as remat_lib


class Stack(nnx.Module):
    """n identical blocks; ``stack(x, *args)`` applies them in order: ``x = block_i(x, *args)``."""

    def __init__(self, make_block: Callable[[nnx.Rngs], nnx.Module], n: int, *, rngs: nnx.Rngs,
                 remat: bool | str = False):
        if n < 1:
            raise ValueError(f"a stack needs at least one block, got n={n}")
        keys = jax.random.split(rngs.params(), n)

        @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def create(key):
            return make_block(nnx.Rngs(params=key))

        self.block = create(keys)
        self.n, self.remat = n, remat_lib.resolve(remat)  # a policy name (spmd.remat)

    def split(self) -> tuple[Callable[..., jax.Array], nnx.State]:
        """``(apply, state)``: ``state`` holds the stacked params ``[layers, ...]``;
        ``apply(state_slice, x, *args)`` runs the blocks of any slice of it along ``layers``, in
        order (what a pipeline stage runs on its chunk of layers)."""
        graphdef, state = nnx.split(self.block)
        remat = self.remat

        def apply(layers_state: nnx.State, x: jax.Array, *args: Any) -> jax.Array:
            def body(carry, layer_state):
                return nnx.merge(graphdef, layer_state)(carry, *args), None

            return jax.lax.scan(remat_lib.wrap(body, remat), x, layers_state)[0]

        return apply, state

    def __call__(self, x: jax.Array, *args: Any) -> jax.Array:
        """Scan the blocks over ``x``; variables the blocks update (batch statistics, RNG counts) are
        carried out of the scan and written back, one slice per layer. A block may return ``(x, aux)``
        (``aux`` a pytree of arrays, e.g. MoE losses): the stack then returns ``(y, aux summed over layers)``."""
        graphdef, params, rest = nnx.split(self.block, nnx.Param, ...)

        def body(carry, layer):
            block = nnx.merge(graphdef, *layer)
            out = block(carry, *args)
            y, aux = out if isinstance(out, tuple) else (out, None)
            return y, (nnx.state(block, nnx.Not(nnx.Param)), aux)

        y, (rest, aux) = jax.lax.scan(remat_lib.wrap(body, self.remat), x, (params, rest))
        nnx.update(self.block, rest)
        return y if aux is None else (y, jax.tree.map(lambda a: a.sum(0), aux))
