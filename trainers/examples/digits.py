"""An MLP-Mixer on the 8x8 handwritten digits, with BatchNorm and dropout: a whole user program.

    python -m trainers.examples.digits
    spmd-train trainers.examples.digits:task --simulate-devices 8

:class:`Mixer` is plain flax NNX with logical dims; everything below it is the user's program:
data, loss, metric, task and run. Its layout under ``fsdp_tp``: docs/models.md.
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import optax
from flax import nnx

import meshes
from trainers.checkpoint import CheckpointConfig
from trainers.config import Config, MeshConfig, RunConfig
from trainers.data import DataConfig
from trainers.loop import train
from trainers.lr import LRConfig
from trainers.optim import OptimizerConfig
from trainers.task import Task


def _dense(rngs: nnx.Rngs, d_in: int, d_out: int, dims: tuple, *, bias: bool = True) -> nnx.Linear:
    """``nnx.Linear`` whose kernel has logical dims ``dims`` (its bias ``dims[1:]``)."""
    return nnx.Linear(d_in, d_out, use_bias=bias, rngs=rngs,
                      kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), dims),
                      bias_init=nnx.with_partitioning(nnx.initializers.zeros, dims[1:]))


def _batch_norm(rngs: nnx.Rngs, d: int) -> nnx.BatchNorm:
    """BatchNorm over every dim but the last (``embed``): batch and tokens."""
    dims = {"out_sharding": ("embed",)}
    return nnx.BatchNorm(d, momentum=0.9, use_fast_variance=False, rngs=rngs,  # two-pass variance
                         scale_metadata=dims, bias_metadata=dims)


class MLP(nnx.Module):
    """``dropout(gelu(x W_in + b)) W_out`` over the last dim; ``dims`` = (that dim's name, hidden dim's name).

    No output bias: the output joins the residual stream, which only BatchNorms read, and they
    cancel any constant per channel (its gradient would be zero up to float noise).
    """

    def __init__(self, d: int, hidden: int, dims: tuple[str, str], dropout: float, *, rngs: nnx.Rngs):
        self.w_in = _dense(rngs, d, hidden, dims)
        self.w_out = _dense(rngs, hidden, d, dims[::-1], bias=False)
        self.dropout = nnx.Dropout(dropout, rngs=rngs)  # its own RNG stream, a model variable

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.w_out(self.dropout(jax.nn.gelu(self.w_in(x))))


class MixerBlock(nnx.Module):
    """``x += token_mlp(norm(x)^T)^T``; ``x += channel_mlp(norm(x))`` on ``x[B, L, D]``."""

    def __init__(self, n_tokens: int, d_model: int, d_tokens: int, d_channels: int, dropout: float, *, rngs: nnx.Rngs):
        self.token_norm = _batch_norm(rngs, d_model)
        self.token_mlp = MLP(n_tokens, d_tokens, ("length", "mlp"), dropout, rngs=rngs)
        self.channel_norm = _batch_norm(rngs, d_model)
        self.channel_mlp = MLP(d_model, d_channels, ("embed", "mlp"), dropout, rngs=rngs)

    def __call__(self, x_BLD: jax.Array) -> jax.Array:
        y_BDL = self.token_norm(x_BLD).swapaxes(1, 2)
        x_BLD = x_BLD + self.token_mlp(y_BDL).swapaxes(1, 2)
        return x_BLD + self.channel_mlp(self.channel_norm(x_BLD))


class Mixer(nnx.Module):
    """``Mixer(rngs=...)(image[B, H, W, C]) -> logits[B, n_classes]``; sizes are arguments (tests shrink them)."""

    def __init__(self, *, rngs: nnx.Rngs, image: int = 8, channels: int = 1, patch: int = 2, d_model: int = 64,
                 d_tokens: int = 64, d_channels: int = 128, n_blocks: int = 2, dropout: float = 0.1,
                 n_classes: int = 10):
        self.patch, n_tokens = patch, (image // patch) ** 2
        self.embed = _dense(rngs, patch * patch * channels, d_model, (None, "embed"), bias=False)
        self.blocks = nnx.List([MixerBlock(n_tokens, d_model, d_tokens, d_channels, dropout, rngs=rngs)
                                for _ in range(n_blocks)])
        self.norm = _batch_norm(rngs, d_model)
        self.head = _dense(rngs, d_model, n_classes, ("embed", None))

    def __call__(self, image_BHWC: jax.Array) -> jax.Array:
        b, h, w, c = image_BHWC.shape
        p = self.patch
        patches_BLP = (image_BHWC.reshape(b, h // p, p, w // p, p, c).transpose(0, 1, 3, 2, 4, 5)
                       .reshape(b, (h // p) * (w // p), p * p * c))
        x_BLD = self.embed(patches_BLP)
        for block in self.blocks:
            x_BLD = block(x_BLD)
        return self.head(self.norm(x_BLD).mean(axis=1))


# The user's program: data, loss, metric, task.
rows = np.loadtxt(Path(__file__).parent / "data" / "digits.csv.gz", delimiter=",", dtype=np.float32)
examples = [{"image": (r[:64] / 16).reshape(8, 8, 1), "label": np.int32(r[64])} for r in rows]


def loss(model, batch, rngs):  # dropout draws from the model's own RNG streams
    logits = model(batch["image"])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
    return ce, {"accuracy": (logits.argmax(-1) == batch["label"]).mean()}


task = Task(model=lambda rngs: Mixer(rngs=rngs), loss=loss, data=examples[:1541], eval_data=examples[1541:],
            eval_metrics={"accuracy": lambda model, batch: model(batch["image"]).argmax(-1) == batch["label"]},
            name="digits", config=Config(
                mesh=MeshConfig(axes="data=2,fsdp=2,tensor=2"), rules="fsdp_tp", data=DataConfig(global_batch=64),
                optimizer=OptimizerConfig(name="adamw", weight_decay=0.05, clip_norm=1.0),
                lr=LRConfig(kind="cosine", peak_lr=3e-3, warmup_steps=30),
                checkpoint=CheckpointConfig(every_steps=100),
                run=RunConfig(name="digits", steps=300, eval_every=50, eval_batches=-1, log_every=25)))

if __name__ == "__main__":
    meshes.simulate_cpu_devices_unless_accelerator(8)
    print(train(task.config, task).eval_metrics)
