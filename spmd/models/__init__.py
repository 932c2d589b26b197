"""Reference models: single-device Flax NNX code whose parameters and activations carry logical dims."""

from spmd.models.flops import flops_per_step, flops_per_token, matmul_params, param_count
from spmd.models.gpt import GPT, Block, GPTConfig, lm_loss
from spmd.models.layers import Attention, GatedMLP, RMSNorm, param, rope
from spmd.models.mlp import MLP, mse_loss

__all__ = [
    "GPT", "Block", "GPTConfig", "lm_loss", "MLP", "mse_loss", "Attention", "GatedMLP", "RMSNorm", "param", "rope",
    "flops_per_step", "flops_per_token", "matmul_params", "param_count",
]
