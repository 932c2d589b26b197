"""Reference models: single-device Flax NNX code whose parameters and activations carry logical dims."""

from spmd.models.context import balanced_positions, context_attend
from spmd.models.counts import flops_per_step, flops_per_token, param_count
from spmd.models.decode import generate
from spmd.models.gpt import GPT, GPTConfig
from spmd.models.layers import param
from spmd.models.loss import lm_loss
from spmd.models.mlp import MLP, mse_loss
from spmd.models.moe import MoE

__all__ = [
    "GPT", "GPTConfig", "MLP", "MoE", "balanced_positions", "context_attend", "flops_per_step", "flops_per_token",
    "generate", "lm_loss", "mse_loss", "param", "param_count",
]
