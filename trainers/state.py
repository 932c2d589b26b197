"""The train state, created directly sharded.

The state is a plain pytree (a dict), so jit, orbax and optax all see the same structure::

    {"params": {...}, "opt_state": (...), "step": int32[], "rng": uint32[2],
     "skipped": int32[], "bad_streak": int32[]}

``params`` and ``opt_state`` are sharded by the rule set (optimizer moments like their
parameters); the counters and RNG key data are replicated. Nothing is ever materialised whole on
one device: params come from ``spmd.init_params`` (jit with ``out_shardings``), the optimizer
state from ``jit(tx.init, out_shardings=...)``.

Works for any NNX model whose ``nnx.Param`` variables carry logical dims (``out_sharding``
metadata, e.g. from ``nnx.with_partitioning`` or ``spmd.models.param``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

import spmd

State = dict[str, Any]


@dataclasses.dataclass
class Sharded:
    """A created state with everything needed to step, save and restore it."""

    graphdef: nnx.GraphDef
    state: State
    shardings: State

    @property
    def abstract(self) -> State:
        """Shape/dtype/sharding of every leaf: the target for restoring a checkpoint on this mesh."""
        return jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), self.state, self.shardings
        )


def create_state(
    make_model: Callable[[], nnx.Module],
    tx: optax.GradientTransformation,
    rules: spmd.Rules | str,
    mesh: Mesh,
    *,
    seed: int = 0,
) -> Sharded:
    """Params, optimizer state, counters and RNG, each created on its own shards."""
    graphdef, params, param_shardings = spmd.init_params(make_model, rules, mesh)
    abstract_opt = jax.eval_shape(tx.init, params)
    opt_shardings = spmd.optimizer_shardings(tx, abstract_opt, param_shardings, mesh)
    opt_state = jax.jit(tx.init, out_shardings=opt_shardings)(params)
    rep = spmd.replicated(mesh)

    def counters():
        zero = jnp.zeros((), jnp.int32)
        return {"step": zero, "rng": jax.random.key_data(jax.random.key(seed)), "skipped": zero, "bad_streak": zero}

    extra = jax.jit(counters, out_shardings=rep)()
    state = {"params": params, "opt_state": opt_state, **extra}
    shardings = {"params": param_shardings, "opt_state": opt_shardings, **{k: rep for k in extra}}
    return Sharded(graphdef, state, shardings)
