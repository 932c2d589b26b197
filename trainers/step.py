"""The pure, jitted train and eval steps.

``train_step(state, batch) -> (state, metrics)`` is one ``jax.jit`` with explicit in/out
shardings and the state donated (updated in place, no second copy). Inside it:

1. **Gradient accumulation** over ``k`` microbatches with ``lax.scan``. The global batch
   ``x[B_batch, L]`` is regrouped as ``[k, B/k, L]`` so that every device keeps its own rows (row
   ``i`` of microbatch ``j`` is global row ``i*k + j``: no data moves), and the accumulator is
   constrained to the parameters' shardings (sharded like the params, not a replicated buffer as
   ``optax.MultiSteps`` keeps). The mean of k microbatch gradients equals the full-batch gradient.
2. **Mixed precision**: parameters and optimizer state stay f32; the model casts weights to its
   compute dtype at use (bf16 on accelerators), so gradients arrive in f32.
3. **Pre-clip global gradient norm** is computed for logging; clipping itself is the first link
   of the optimizer chain.
4. **Guard** (``trainers.guard``): if the loss or the gradient norm is not finite, or (when the
   state carries a ``"guard"`` window and ``spike_factor > 0``) either spikes above
   ``spike_factor x`` its running median, parameters and optimizer state are left unchanged (one
   ``lax.cond`` around the update), ``skipped`` and ``bad_streak`` count it, and the window only
   takes accepted values. The loop applies the run's policy (skip, rollback, stop) on the host.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

import spmd
from spmd.models import lm_loss
from spmd.pipeline import PipelineConfig
from trainers import guard
from trainers.optim import global_norm
from trainers.state import Sharded, State

Batch = dict[str, jax.Array]
LossFn = Callable[[nnx.Module, Batch], tuple[jax.Array, dict[str, jax.Array]]]


def lm_loss_fn(z_loss: float = 0.0, pipeline: PipelineConfig | None = None) -> LossFn:
    """Next-token loss of a language model: ``model(batch["inputs"])`` vs ``batch["targets"]``;
    with an enabled ``pipeline`` config, ``model.loss(..., pipeline=pipeline)`` runs the blocks as a
    pipeline over the ``pipe`` axis."""

    def loss_fn(model: nnx.Module, batch: Batch):
        if pipeline is not None and pipeline.enabled:
            return model.loss(batch["inputs"], batch["targets"], z_loss=z_loss, pipeline=pipeline)
        return lm_loss(model(batch["inputs"]), batch["targets"], z_loss=z_loss)

    return loss_fn


def _microbatches(x: jax.Array, k: int) -> jax.Array:
    """``[B, ...] -> [k, B/k, ...]`` with microbatch j = rows j, j+k, j+2k, ... (local to each device)."""
    x = x.reshape(x.shape[0] // k, k, *x.shape[1:]).swapaxes(0, 1)
    return spmd.constrain(x, (None, "batch") + (None,) * (x.ndim - 2))


def make_train_step(
    sharded: Sharded,
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
) -> Callable[[State, Batch], tuple[State, dict[str, jax.Array]]]:
    """The jitted train step for this state, mesh and rule set.

    ``spike_factor > 0`` needs a ``"guard"`` window in the state (``trainers.guard.init_state``);
    with a window, the metrics also carry ``ok``, ``loss_spike``, ``grad_norm_spike`` and the medians.
    """
    guard.validate("skip", spike_factor, 1)
    if spike_factor > 0 and "guard" not in sharded.state:
        raise ValueError(f"spike_factor={spike_factor} needs a 'guard' window in the state (trainers.guard.init_state); "
                         f"state keys: {sorted(sharded.state)}")
    graphdef, param_shardings = sharded.graphdef, sharded.shardings["params"]
    loss_fn = loss_fn or lm_loss_fn()
    rules = spmd.get_rules(rules)

    def loss_of(params, batch):
        model = nnx.merge(graphdef, params)
        loss, aux = loss_fn(model, batch)
        return loss, aux

    grad_fn = jax.value_and_grad(loss_of, has_aux=True)

    def step(state: State, batch: Batch):
        params = state["params"]
        with spmd.use_rules(rules, mesh):
            if grad_accum == 1:
                (loss, aux), grads = grad_fn(params, batch)
            else:
                micro = jax.tree.map(lambda x: _microbatches(x, grad_accum), batch)

                def body(acc, mb):
                    (l, aux), g = grad_fn(params, mb)
                    acc = jax.tree.map(jnp.add, acc, g)
                    return jax.lax.with_sharding_constraint(acc, param_shardings), (l, aux)

                zeros = jax.lax.with_sharding_constraint(jax.tree.map(jnp.zeros_like, params), param_shardings)
                grads, (losses, auxs) = jax.lax.scan(body, zeros, micro)
                grads = jax.tree.map(lambda g: g / grad_accum, grads)
                loss, aux = losses.mean(), jax.tree.map(jnp.mean, auxs)
        grad_norm = global_norm(grads)
        flags = guard.check(state["guard"], loss, grad_norm, spike_factor) if "guard" in state else None
        ok = flags["ok"] if flags is not None else jnp.isfinite(loss) & jnp.isfinite(grad_norm)

        def update(grads, opt_state, params):
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        # one cond, not a jnp.where per leaf: a per-leaf select keeps both old and new moments alive
        # and makes XLA copy the donated optimizer state every step
        new_params, opt_state = jax.lax.cond(ok, update, lambda g, o, p: (p, o), grads, state["opt_state"], params)
        key = jax.random.wrap_key_data(state["rng"])
        new_state = {
            "params": new_params,
            "opt_state": opt_state,
            "step": state["step"] + 1,
            "rng": jax.random.key_data(jax.random.split(key)[0]),
            "skipped": state["skipped"] + (~ok).astype(jnp.int32),
            "bad_streak": jnp.where(ok, 0, state["bad_streak"] + 1),
        }
        metrics = {"loss": loss, "grad_norm": grad_norm, "finite": ok, **aux}
        if flags is not None:
            new_state["guard"] = guard.update(state["guard"], loss, grad_norm, ok)
            metrics.update(flags)
        if schedule is not None:
            metrics["lr"] = schedule(state["step"])
        return new_state, metrics

    batch_shardings = {"inputs": batch_sharding, "targets": batch_sharding}
    return jax.jit(
        step,
        in_shardings=(sharded.shardings, batch_shardings),
        out_shardings=(sharded.shardings, spmd.replicated(mesh)),
        donate_argnums=(0,) if donate else (),
    )


def make_eval_step(
    sharded: Sharded, rules: spmd.Rules | str, mesh: Mesh, batch_sharding: NamedSharding, *, loss_fn: LossFn | None = None
) -> Callable[[dict[str, Any], Batch], jax.Array]:
    """``eval_step(params, batch) -> mean loss`` (cross-entropy only, no z-loss)."""
    graphdef = sharded.graphdef
    loss_fn = loss_fn or lm_loss_fn()
    rules = spmd.get_rules(rules)

    def step(params, batch):
        with spmd.use_rules(rules, mesh):
            loss, aux = loss_fn(nnx.merge(graphdef, params), batch)
        return aux.get("ce", loss)

    return jax.jit(
        step,
        in_shardings=(sharded.shardings["params"], {"inputs": batch_sharding, "targets": batch_sharding}),
        out_shardings=spmd.replicated(mesh),
    )
