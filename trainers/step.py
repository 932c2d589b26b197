"""The pure, jitted train and eval steps, for any model, loss and batch structure.

``train_step(state, batch) -> (state, metrics)``: explicit shardings, state donated, gradient
accumulation (reduced once per step: :mod:`trainers.accumulate`), the pre-clip gradient norm and the guard. ``eval_step(state, batch, mask) -> sums``
over the real rows. See docs/training.md.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

import spmd
from spmd.models import lm_loss
from spmd.models.packed import PACKED_KEYS
from spmd.pipeline import PipelineConfig
from trainers import accumulate
from trainers.blame import ContractError
from trainers.checks.config import check_fsdp_gather
from trainers.faults import guard
from trainers.optim import global_norm
from trainers.state import ShardedState, TrainState

Batch = Any  # a pytree of arrays with a leading batch dim
LossFn = Callable[[nnx.Module, Batch, nnx.Rngs], "jax.Array | tuple[jax.Array, dict[str, jax.Array]]"]
MetricFn = Callable[[nnx.Module, Batch], jax.Array]
log = logging.getLogger(__name__)
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # jax._src.dispatch.BACKEND_COMPILE_EVENT
_trimming: list[bool] = []


def trim_heap_after_compiles() -> None:
    """After every XLA compile in this process, hand the heap the compiler freed back to the OS (glibc's
    ``malloc_trim``; elsewhere nothing). The compiler's scratch is freed on the compiling thread's arena, which
    the devices' threads do not reuse: kept, it sat under every later step's peak RSS (about 100 MiB of
    gpt-small's step on 8 CPU devices). Registered once; a trim takes about a millisecond."""
    if _trimming:
        return
    _trimming.append(True)
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return

    def after(event: str, duration_secs: float, **_: str | int) -> None:
        if event == _COMPILE_EVENT:
            trim(0)

    jax.monitoring.register_event_duration_secs_listener(after)


def lm_loss_fn(z_loss: float = 0.0, pipeline: PipelineConfig | None = None) -> LossFn:
    """Next-token loss of a language model: ``model.loss(inputs, targets, z_loss=, pipeline=)`` when the
    model has one (``spmd.models.GPT``: chunked cross-entropy, and the blocks run as a pipeline over
    the ``pipe`` axis under an enabled ``pipeline`` config), else ``lm_loss(model(inputs), targets)``."""

    def loss_fn(model: nnx.Module, batch: Batch, rngs: nnx.Rngs | None = None):
        packed = {k: batch[k] for k in PACKED_KEYS if k in batch}  # packed documents, loss weights
        if hasattr(model, "loss"):
            return model.loss(batch["inputs"], batch["targets"], z_loss=z_loss, pipeline=pipeline, **packed)
        loss, aux = lm_loss(model(batch["inputs"]), batch["targets"], z_loss=z_loss, weights=packed.get("weights"))
        if "weights" in packed:  # as GPT.loss: eval divides by the mean weight
            aux = {**aux, "loss_weight": jnp.mean(packed["weights"].astype(jnp.float32))}
        return loss, aux

    loss_fn.pipelined = pipeline is not None and pipeline.enabled  # type: ignore[attr-defined]  # runs its own shard_map
    loss_fn.weighted = True  # type: ignore[attr-defined]  # mean(weights * ce), aux loss_weight: eval folds its mask in
    return loss_fn


def normalize_weights(batch: Batch) -> Batch:
    """``batch["weights"]`` (per-token loss weights ``[B, L]``, if any) scaled to sum to ``B x L`` over the
    global batch, so that every mean of ``weights * ce`` over equal shares of it (microbatches, devices,
    processes) averages to ``sum(weights * ce) / sum(weights)``: the mean over weighted tokens."""
    if not isinstance(batch, Mapping) or "weights" not in batch:
        return batch
    w = batch["weights"].astype(jnp.float32)
    total = jnp.sum(w)
    # no weight at all: every weight stays 0, so the loss is 0 with loss_weight 0 (w.size / tiny would be inf, 0 x inf NaN)
    return {**batch, "weights": w * jnp.where(total > 0, w.size / jnp.where(total > 0, total, 1.0), 0.0)}


def loss_and_metrics(out: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
    """A loss function's result as ``(scalar loss, {name: scalar})``, or a clear error."""
    if isinstance(out, tuple):
        if len(out) != 2 or not isinstance(out[1], Mapping):
            raise ContractError(f"the loss function returned a tuple of {len(out)} items "
                                f"({', '.join(type(x).__name__ for x in out)}); return a scalar loss or (loss, dict of metrics)")
        loss, metrics = out
    else:
        loss, metrics = out, {}
    if not hasattr(loss, "shape") or loss.shape != () or not jnp.issubdtype(loss.dtype, jnp.floating):
        raise ContractError(f"the loss function must return a float scalar loss, got {type(loss).__name__} of shape "
                            f"{getattr(loss, 'shape', None)} and dtype {getattr(loss, 'dtype', None)} (take a mean over the batch)")
    for name, value in metrics.items():
        if not isinstance(name, str) or jnp.shape(value) != ():
            raise ContractError(f"loss metric {name!r} has shape {jnp.shape(value)}; metrics must be scalars keyed by str")
    return loss, dict(metrics)


def train_step_fn(
    sharded: ShardedState,
    tx: optax.GradientTransformation,
    rules: spmd.Rules | str,
    mesh: Mesh,
    batch_sharding: NamedSharding,
    *,
    schedule: optax.Schedule | None = None,
    grad_accum: int = 1,
    loss_fn: LossFn | None = None,
    donate: bool = True,
    spike_factor: float = 0.0,
    fsdp_gather: str = "per_microbatch",
    jit: bool = True,
    max_update_ratio: float = 0.0,
    max_param_growth: float = 0.0,
) -> Callable[[TrainState, Batch], tuple[TrainState, dict[str, jax.Array]]]:
    """The jitted train step for this state, mesh and rule set (``jit=False``: the pure function, for
    callers that transform it first, e.g. :mod:`trainers.local_sgd` maps it over replica groups).

    ``grad_accum`` > 1 splits the batch into that many microbatches whose gradients are reduced once
    per step; ``fsdp_gather`` ("per_microbatch" | "per_step") says when weights sharded over ``fsdp``
    are gathered (:mod:`trainers.accumulate`).

    ``spike_factor > 0`` needs a guard window in the state (``trainers.faults.guard.init_state``);
    with a window, the metrics also carry ``ok``, ``loss_spike``, ``grad_norm_spike`` and the medians.
    ``max_update_ratio`` / ``max_param_growth`` > 0 check the proposed update before it is applied
    (:func:`trainers.faults.guard.check_update`: one more fused pass over grads, moments and params).
    """
    guard.validate("skip", spike_factor, 1)
    check_fsdp_gather(fsdp_gather)
    trim_heap_after_compiles()
    if spike_factor > 0 and sharded.state.guard is None:
        raise ValueError(f"spike_factor={spike_factor} needs a guard window in the state (trainers.faults.guard.add_window); "
                         f"state fields: {sorted(sharded.state.as_dict())}")
    model_vars, param_shardings = sharded.model, sharded.shardings.params
    loss_fn = loss_fn or lm_loss_fn()
    pipelined = getattr(loss_fn, "pipelined", False)
    rules = spmd.get_rules(rules)

    def loss_of(params, other, batch, key):
        model = model_vars.merge(params, other)
        model.train()
        # the Rngs are made here, inside the differentiated function: a loss may draw from them
        loss, metrics = loss_and_metrics(loss_fn(model, batch, nnx.Rngs(key)))
        return loss, (metrics, model_vars.split(model)[1])

    grad_fn = jax.value_and_grad(loss_of, has_aux=True)

    def step(state: TrainState, batch: Batch):
        params, other = state.params, state.model_state if state.model_state is not None else {}
        key, step_key = jax.random.split(jax.random.wrap_key_data(state.rng))
        batch = normalize_weights(batch)
        with spmd.use_rules(rules, mesh):
            axes = accumulate.reduction_axes(mesh, rules, batch, grad_accum, fsdp_gather)
            why = None if grad_accum == 1 else _loop_under_gspmd(model_vars, params, other, pipelined, loss_fn,
                                                                 _layer_axes(mesh, rules), axes)
            note = accumulate.per_microbatch_note(mesh, rules, jax.tree.leaves(batch)[0].shape[0], grad_accum,
                                                  fsdp_gather, why)
            if note:  # at trace time: once per compiled step
                log.warning("%s", note)
            if grad_accum == 1:
                (loss, (aux, new_other)), grads = grad_fn(params, other, batch, step_key)
            elif axes and why is None:
                # one reduction per step (trainers/accumulate.py)
                nests = _nests_region(model_vars, params, other, _layer_axes(mesh, rules), axes)
                grads, loss, aux = accumulate.accumulate(grad_fn, params, batch, step_key, grad_accum=grad_accum,
                                                         mesh=mesh, rules=rules, param_shardings=param_shardings,
                                                         axes=axes, checked=not nests)
                new_other = other
            else:  # batch statistics, RNG streams, a pipeline or a layer with its own shard_map (MoE): the loop
                # under GSPMD reduces every microbatch
                grads, new_other, loss, aux = accumulate.accumulate_gspmd(grad_fn, params, other, batch, step_key,
                                                                          grad_accum=grad_accum,
                                                                          param_shardings=param_shardings)
        grad_norm = global_norm(grads)
        flags = guard.check(state.guard, loss, grad_norm, spike_factor) if state.guard is not None else None
        ok = flags["ok"] if flags is not None else jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        if max_update_ratio > 0 or max_param_growth > 0:  # the update, measured before it is applied
            proposed, _ = tx.update(grads, state.opt_state, params)
            param_norm, update_norm = global_norm(params), global_norm(proposed)
            update_flags = guard.check_update(state.guard, update_norm, param_norm, param_norm + update_norm,
                                              max_update_ratio, max_param_growth)  # |p + u| <= |p| + |u|
            ok = ok & ~update_flags["update_ratio_high"] & ~update_flags["param_norm_high"]
            flags = {**(flags or {}), **update_flags, "ok": ok}

        def update(grads, opt_state, params, other, new_other):
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, new_other

        # one cond, not a jnp.where per leaf: a per-leaf select keeps both old and new moments alive
        # and makes XLA copy the donated optimizer state every step
        new_params, opt_state, new_other = jax.lax.cond(
            ok, update, lambda g, o, p, other, _: (p, o, other), grads, state.opt_state, params, other, new_other)
        window = state.guard
        if flags is not None and window is not None:
            window = guard.update(window, loss, grad_norm, ok, flags.get("param_norm"))
        new_state = state.replace(
            params=new_params, opt_state=opt_state, step=state.step + 1, rng=jax.random.key_data(key),
            skipped=state.skipped + (~ok).astype(jnp.int32), bad_streak=jnp.where(ok, 0, state.bad_streak + 1),
            model_state=new_other if state.model_state is not None else None, guard=window)
        metrics = {"loss": loss, "grad_norm": grad_norm, "finite": ok, **aux}
        if flags is not None:
            metrics.update(flags)
        if schedule is not None:
            metrics["lr"] = schedule(state.step)
        return new_state, metrics

    if not jit:
        return step
    return jax.jit(
        step,
        in_shardings=(sharded.shardings, batch_sharding),
        out_shardings=(sharded.shardings, spmd.sharding.replicated(mesh)),
        donate_argnums=(0,) if donate else (),
    )


def accumulation_note(sharded: ShardedState, rules: spmd.Rules | str, mesh: Mesh, rows: int, *, grad_accum: int,
                      fsdp_gather: str = "per_microbatch", loss_fn: LossFn | None = None) -> str | None:
    """What the train step logs (at trace time) when its gradient accumulation over a batch of ``rows``
    cannot reduce once per step, naming the rows, axes and reason; None when it can."""
    state, rules = sharded.abstract, spmd.get_rules(rules)
    axes = accumulate.reduction_axes(mesh, rules, jax.ShapeDtypeStruct((rows,), jnp.int32), grad_accum, fsdp_gather)
    why = _loop_under_gspmd(sharded.model, state.params, state.model_state or {},
                            getattr(loss_fn, "pipelined", False), loss_fn, _layer_axes(mesh, rules), axes)
    return accumulate.per_microbatch_note(mesh, rules, rows, grad_accum, fsdp_gather, why)


def _layer_axes(mesh: Mesh, rules: spmd.Rules) -> tuple[str, ...]:
    """The axes (size > 1) a layer with its own ``shard_map`` runs manual over: those of ``batch`` and ``length``."""
    spec = rules.spec(("batch", "length"), kind="activations", mesh_sizes=dict(mesh.shape))
    return tuple(a for entry in spec for a in spmd.rules.axes_of(entry))


def _loop_under_gspmd(model_vars: Any, params: Any, other: Any, pipelined: bool, loss_fn: Any = None,
                      layer_axes: tuple[str, ...] = (), axes: tuple[str, ...] = ()) -> str | None:
    """Why the accumulation loop must stay under GSPMD (None: it need not). A loss says so itself with a
    ``manual_unsafe`` attribute naming why (e.g. the DPO loss)."""
    if getattr(loss_fn, "manual_unsafe", None):
        return str(loss_fn.manual_unsafe)
    if jax.tree.leaves(other):
        return "the model carries state besides its parameters (batch statistics, RNG streams)"
    if pipelined:
        return "the loss runs a pipeline (its own shard_map over the batch axes)"
    return None


def _nests_region(model_vars: Any, params: Any, other: Any, layer_axes: tuple[str, ...], axes: tuple[str, ...]) -> bool:
    """Whether a layer's own ``shard_map`` opens nested in the loop's region manual over ``axes``: context
    attention's over ``seq`` (in ``layer_axes``), or one over ``layer_axes`` (MoE) some of which are automatic
    there. Both regions then run with unchecked typing: checked, the residuals of the layer scan's
    linearization would name the loop's axes in the nested region, which Shardy refuses."""
    context = "seq" in layer_axes
    return context or any(a not in axes for a in layer_axes) and _opens_manual_region(model_vars, params, other)


def _opens_manual_region(model_vars: Any, params: Any, other: Any) -> bool:
    """Whether a module of the model runs its own ``shard_map`` (class attribute ``opens_manual_region``,
    e.g. :class:`spmd.models.MoE`): nested inside the accumulation loop's manual region it needs both
    unchecked (:func:`_nests_region`); in a region manual over all its axes it runs without one."""
    return any(getattr(node, "opens_manual_region", False) for _, node in nnx.iter_graph(model_vars.merge(params, other)))


def eval_view(state: TrainState) -> TrainState:
    """What the eval step reads of the train state (or of its shardings): params and the other model
    variables, every other field None."""
    return TrainState(state.params, model_state=state.model_state)


def eval_step_fn(
    sharded: ShardedState, rules: spmd.Rules | str, mesh: Mesh, batch_sharding: NamedSharding, *,
    loss_fn: LossFn | None = None, metrics: Mapping[str, MetricFn] | None = None,
) -> Callable[[TrainState, Batch, jax.Array], dict[str, jax.Array]]:
    """``eval_step(eval_view(state), batch, mask, padded=False) -> sums`` (see the module docstring).

    The loss and its metrics come out as sums over rows of per-row means, padding rows (mask 0)
    weighing nothing. A loss that honours ``batch["weights"]`` (``loss_fn.weighted``, e.g.
    :func:`lm_loss_fn`, pipelined or not) runs once on the whole batch with the mask folded into the
    weights; its ``loss_weight`` metric is what the loop divides by (:func:`trainers.data.packing.per_token`).
    Any other loss, with ``padded=True`` (a batch whose mask has zeros), runs on one real row at a time;
    a second program, compiled for the padded batch.

    ``metrics`` maps a name to ``fn(model, batch) -> per-example values [B]`` (e.g. accuracy as
    ``argmax == label``); they are summed over real rows here and averaged over all eval rows of
    all batches and processes by the loop (:func:`trainers.loop.evaluate`).
    """
    model_vars = sharded.model
    loss_fn = loss_fn or lm_loss_fn()
    metrics = dict(metrics or {})
    rules = spmd.get_rules(rules)
    weighted = getattr(loss_fn, "weighted", False)

    def step(view, batch, mask_B, padded=False):
        with spmd.use_rules(rules, mesh):
            model = model_vars.merge(view.params, view.model_state if view.model_state is not None else {})
            model.eval()
            count = jnp.sum(mask_B)
            if weighted and isinstance(batch, Mapping) and ("weights" in batch or padded):
                out = _weighted_sums(loss_fn, model, batch, mask_B)
            elif padded and not getattr(loss_fn, "pipelined", False):  # each row's loss alone: padding weighs nothing
                out = _per_row_sums(loss_fn, model, batch, mask_B)
            else:
                loss, aux = loss_and_metrics(loss_fn(model, batch, nnx.Rngs(0)))
                out = {"loss": loss * count, **{k: v * count for k, v in aux.items()}}
            out["count"] = count
            for name, fn in metrics.items():
                values = jnp.asarray(fn(model, batch))
                if values.shape != mask_B.shape:
                    raise ContractError(f"eval metric {name!r} returned shape {values.shape}; it must return one value "
                                        f"per example, shape {mask_B.shape} (e.g. (logits.argmax(-1) == labels))")
                out[name] = jnp.sum(values.astype(jnp.float32) * mask_B)
        return out

    jitted = jax.jit(step, in_shardings=(eval_view(sharded.shardings), batch_sharding, batch_sharding),
                     out_shardings=spmd.sharding.replicated(mesh), static_argnums=3)

    def eval_step(view: TrainState, batch: Batch, mask_B: jax.Array, padded: bool = False):
        if weighted and isinstance(batch, Mapping) and "weights" in batch:
            padded = False  # the mask is folded into the weights either way: one program
        return jitted(view, batch, mask_B, padded)

    eval_step.lower = jitted.lower  # type: ignore[attr-defined]
    return eval_step


def _weighted_sums(loss_fn: LossFn, model: nnx.Module, batch: Batch, mask_B: jax.Array) -> dict[str, jax.Array]:
    """The sums of :func:`_per_row_sums` in one call of a loss that honours ``batch["weights"]`` (its
    loss ``mean(weights * ce)``): the mask is folded into the weights (all 1 when the batch has none),
    so padding rows weigh nothing, and every mean over the ``B`` rows times ``B`` is the sum over rows
    of per-row means. A batch without weights keeps its keys: its ``loss_weight`` (``count / B``) is dropped."""
    rows = mask_B.shape[0]
    given = "weights" in batch
    w_BL = batch["weights"].astype(jnp.float32) if given else jnp.ones(batch["targets"].shape, jnp.float32)
    w_BL = w_BL * mask_B.astype(jnp.float32).reshape((rows,) + (1,) * (w_BL.ndim - 1))
    loss, aux = loss_and_metrics(loss_fn(model, {**batch, "weights": w_BL}, nnx.Rngs(0)))
    if not given:
        aux.pop("loss_weight", None)
    return {"loss": loss * rows, **{k: v * rows for k, v in aux.items()}}


def _per_row_sums(loss_fn: LossFn, model: nnx.Module, batch: Batch, mask_B: jax.Array) -> dict[str, jax.Array]:
    """``{"loss": sum over real rows of the loss of that row alone, name: the same for each loss metric}``:
    the loss runs on one row at a time (``lax.map``), so rows that only pad the batch (mask 0) weigh nothing."""
    def one(row):
        return loss_and_metrics(loss_fn(model, jax.tree.map(lambda a: a[None], row), nnx.Rngs(0)))

    losses_B, aux_B = jax.lax.map(one, batch)
    return {"loss": jnp.sum(losses_B * mask_B), **{k: jnp.sum(v * mask_B) for k, v in aux_B.items()}}
