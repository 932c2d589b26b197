"""The train state, created directly sharded (or abstractly: shapes and shardings, no memory).

    {"params": {...}, "model_state": {...}, "opt_state": (...), "step": int32[], "rng": uint32[2],
     "skipped": int32[], "bad_streak": int32[]}

Nothing is materialised whole on one device; ``abstract=True`` gives ``ShapeDtypeStruct`` leaves.
With an interleaved ``pipeline`` the block stacks are created in its chunk order (docs/pipelines.md).
See docs/training.md.
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
from meshes import axis_sizes
from spmd.pipeline import PipelineConfig
from spmd.sharding import abstract_module
from spmd.stack import reorder_stacks, stack_orders
from spmd.variables import ModelVars, PathRules, init_model

State = dict[str, Any]


@dataclasses.dataclass
class ShardedState:
    """A created state with everything needed to step, save and restore it."""

    model: ModelVars
    state: State
    shardings: State
    layer_orders: tuple = ()  # spmd.stack.stack_orders: stacks not in natural order (checkpoints convert them)

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
    pipeline: PipelineConfig | None = None,
) -> ShardedState:
    """Params, other model variables, optimizer state, counters and RNG, each created on its own shards.

    With a ``pipeline`` whose schedule reads a chunk order on this mesh's ``pipe`` axis (interleaved,
    V > 1) every ``spmd.Stack`` of the model is stored in that order (``Stack.reorder``), each
    natural layer with the values it has without it; ``layer_orders`` lists them for checkpoints."""
    order = pipeline.layer_order(axis_sizes(mesh).get("pipe", 1)) if pipeline is not None else None
    if order is not None and not order.natural:
        make_natural = make_model

        def make_model():
            return reorder_stacks(make_natural(), order)

    model = init_model(make_model, rules, mesh, path_rules=path_rules, abstract=abstract)
    opt_shardings = spmd.optimizer_shardings(tx, jax.eval_shape(tx.init, model.params), model.shardings["params"], mesh)
    rep = spmd.sharding.replicated(mesh)

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
    orders = stack_orders(abstract_module(make_model)) if order is not None and not order.natural else ()
    return ShardedState(model, state, shardings, orders)
