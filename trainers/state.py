"""The train state, created directly sharded (or abstractly: shapes and shardings, no memory).

The state is a plain pytree (a dict), so jit, orbax and optax all see the same structure::

    {"params": {...}, "model_state": {...}, "opt_state": (...), "step": int32[], "rng": uint32[2],
     "skipped": int32[], "bad_streak": int32[]}

``params`` are the model's ``nnx.Param`` variables; ``model_state`` holds every other variable
(batch statistics, RNG streams, user variables; RNG keys as key data) and is absent when the model
has none. ``params`` and ``opt_state`` are sharded by the rule set (optimizer moments like their
parameters), ``model_state`` by the same decisions (``spmd.variables``); the counters and RNG key
data are replicated. Nothing is ever materialised whole on one device: variables come from
``spmd.init_model`` (jit with ``out_shardings``), the optimizer state from
``jit(tx.init, out_shardings=...)``. ``abstract=True`` builds the same structure from
``ShapeDtypeStruct`` leaves: the target of a checkpoint restore and of the dry run's compile.
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
from spmd.variables import ModelVars, PathRules, init_model

State = dict[str, Any]


@dataclasses.dataclass
class Sharded:
    """A created state with everything needed to step, save and restore it."""

    model: ModelVars
    state: State
    shardings: State

    @property
    def graphdef(self) -> nnx.GraphDef:
        return self.model.graphdef

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
    path_rules: PathRules = (),
    abstract: bool = False,
) -> Sharded:
    """Params, other model variables, optimizer state, counters and RNG, each created on its own shards."""
    model = init_model(make_model, rules, mesh, path_rules=path_rules, abstract=abstract)
    opt_shardings = spmd.optimizer_shardings(tx, jax.eval_shape(tx.init, model.params), model.shardings["params"], mesh)
    rep = spmd.replicated(mesh)

    def counters():
        zero = jnp.zeros((), jnp.int32)
        return {"step": zero, "rng": jax.random.key_data(jax.random.key(seed)), "skipped": zero, "bad_streak": zero}

    if abstract:
        opt_state, extra = jax.eval_shape(tx.init, model.params), jax.eval_shape(counters)
    else:
        opt_state = jax.jit(tx.init, out_shardings=opt_shardings)(model.params)
        extra = jax.jit(counters, out_shardings=rep)()
    state = {"params": model.params, "opt_state": opt_state, **extra}
    shardings = {"params": model.shardings["params"], "opt_state": opt_shardings, **{k: rep for k in extra}}
    if jax.tree.leaves(model.other):
        state["model_state"], shardings["model_state"] = model.other, model.shardings["other"]
    return Sharded(model, state, shardings)
