"""The train state, a typed pytree created directly sharded (or abstractly: shapes and shardings).

    TrainState(params={...}, opt_state=(...), step=int32[], rng=uint32[2], skipped=int32[],
               bad_streak=int32[], model_state={...} | None, guard=window | None)

Checkpoints hold it as a plain dict of its set fields (:meth:`TrainState.as_dict`), readable by
orbax alone. Nothing is materialised whole on one device; ``abstract=True`` gives ``ShapeDtypeStruct`` leaves.
With an interleaved ``pipeline`` the block stacks are created in its chunk order (docs/pipelines.md).
See docs/training.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct
from jax.sharding import Mesh

import spmd
from meshes import axis_sizes
from spmd.pipeline import LayerOrder, PipelineConfig
from spmd.sharding import abstract_module
from spmd.stack import reorder_stacks, stack_orders
from spmd.variables import ModelVars, PathRules, init_model


@struct.dataclass
class TrainState:
    """What a train step carries. ``model_state``: model variables that are not parameters (batch
    statistics, RNG streams), None for a model with none; ``guard``: the guard's window
    (:mod:`trainers.faults.guard`), None outside the step; ``outer_params`` / ``outer_opt_state``:
    local SGD's synchronised params and outer optimizer state (:mod:`trainers.local_sgd`).
    Read by attribute; :meth:`as_dict` / :meth:`from_dict` convert to and from the plain dict checkpoints hold."""

    params: Any
    opt_state: Any = None
    step: Any = None
    rng: Any = None
    skipped: Any = None
    bad_streak: Any = None
    model_state: Any = None
    guard: Any = None
    outer_params: Any = None
    outer_opt_state: Any = None

    if TYPE_CHECKING:  # struct.dataclass adds ``replace`` (dataclasses.replace) at runtime; declared for the type checker only

        def replace(self, **changes: Any) -> TrainState: ...

    def as_dict(self) -> dict[str, Any]:
        """The set fields, by name: the form checkpoints hold."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TrainState:
        """The state of a dict of fields (a checkpoint's tree); a key that is no field is refused."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"a train state has no fields {unknown}; its fields: {sorted(names)}")
        return cls(**d)


@dataclasses.dataclass
class ShardedState:
    """A created state with everything needed to step, save and restore it."""

    model: ModelVars
    state: TrainState
    shardings: TrainState  # the sharding of every leaf of ``state``, in the same structure
    layer_orders: tuple = ()  # spmd.stack.stack_orders: stacks not in natural order (checkpoints convert them)

    @property
    def graphdef(self) -> nnx.GraphDef:
        return self.model.graphdef

    @property
    def abstract(self) -> TrainState:
        """Shape/dtype/sharding of every leaf: the target for restoring a checkpoint on this mesh."""
        return jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), self.state, self.shardings
        )


def sharded_state(
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
    natural layer with the values it has without it, bit for bit: the model is created in natural order
    on its natural shards, then moved (:func:`_chunk_ordered`); ``layer_orders`` lists them for checkpoints."""
    order = pipeline.layer_order(axis_sizes(mesh).get("pipe", 1)) if pipeline is not None else None
    if order is not None and not order.natural:
        make_natural = make_model

        def make_model():
            return reorder_stacks(make_natural(), order)

        model = _chunk_ordered(make_natural, make_model, order, rules, mesh, path_rules=path_rules, abstract=abstract)
    else:
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
    stateful = bool(jax.tree.leaves(model.other))
    state = TrainState(model.params, opt_state, **extra, model_state=model.other if stateful else None)
    shardings = TrainState(model.shardings["params"], opt_shardings, **{k: rep for k in extra},
                           model_state=model.shardings["other"] if stateful else None)
    orders = stack_orders(abstract_module(make_model)) if order is not None and not order.natural else ()
    return ShardedState(model, state, shardings, orders)


def _chunk_ordered(make_natural: Callable[[], nnx.Module], make_ordered: Callable[[], nnx.Module], order: LayerOrder,
                   rules: spmd.Rules | str, mesh: Mesh, *, path_rules: PathRules, abstract: bool) -> ModelVars:
    """``make_ordered()``'s variables (``make_natural()``'s with every Stack in ``order``): created in natural order on their
    natural shards, then permuted in a jit of its own (data movement only; the natural arrays donated).
    Created in the chunk order's sharding at once, each device would compute the random init of layers it
    does not keep, which XLA may fuse and round differently (1 ulp at ``--xla_backend_optimization_level=0``):
    an interleaved pipeline would start from other numbers than one device."""
    ordered = init_model(make_ordered, rules, mesh, path_rules=path_rules, abstract=True)
    if abstract:
        return ordered
    natural = init_model(make_natural, rules, mesh, path_rules=path_rules)

    def permute(params: Any, other: Any) -> tuple[Any, Any]:
        return ordered.split(reorder_stacks(natural.merge(params, other), order))

    params, other = jax.jit(permute, out_shardings=(ordered.shardings["params"], ordered.shardings["other"]),
                            donate_argnums=(0, 1))(natural.params, natural.other)
    return dataclasses.replace(ordered, params=params, other=other)
