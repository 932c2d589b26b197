"""A two-layer MLP with logical dims: the smallest model that still shows every layout.

``y = relu(x @ W_in[D, F] + b_in[F]) @ W_out[F, D] + b_out[D]``. Under TP, W_in is
column-parallel and W_out row-parallel (one all-reduce of the ``[B, D]`` output over ``tensor``);
under FSDP both weights are split along D.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from spmd.constraints import constrain
from spmd.models.layers import fan_in_init, param, weight


class MLP(nnx.Module):
    def __init__(self, d_model: int, d_ff: int, *, rngs: nnx.Rngs):
        self.w_in = param(rngs, fan_in_init(d_model), (d_model, d_ff), ("embed", "mlp"))
        self.b_in = param(rngs, nnx.initializers.zeros, (d_ff,), ("mlp",))
        self.w_out = param(rngs, fan_in_init(d_ff), (d_ff, d_model), ("mlp", "embed"))
        self.b_out = param(rngs, nnx.initializers.zeros, (d_model,), ("embed",))

    def __call__(self, x_BD: jax.Array) -> jax.Array:
        x_BD = constrain(x_BD, ("batch", "embed"))
        h_BF = constrain(jax.nn.relu(x_BD @ weight(self.w_in, x_BD.dtype) + weight(self.b_in, x_BD.dtype)), ("batch", "mlp"))
        return constrain(h_BF @ weight(self.w_out, h_BF.dtype) + weight(self.b_out, h_BF.dtype), ("batch", "embed"))


def mse_loss(y_BD: jax.Array, target_BD: jax.Array) -> jax.Array:
    return jnp.mean((y_BD.astype(jnp.float32) - target_BD.astype(jnp.float32)) ** 2)
