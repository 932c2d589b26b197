"""A small task written the way a user writes one, for the CLI, dry-run and planner tests.

``spmd-train tests.helpers.byom_task:task`` trains it. An MLP classifier on deterministic random data
(the label is the argmax of a fixed projection, so it is learnable), with every kind of sharding
source the toolkit reads: an annotated kernel (``hidden``: ``W[D_fsdp, F_tensor]`` under
``fsdp_tp``), a path rule (``out/kernel`` gets dims ``(mlp, None)``), an unannotated kernel large
enough for the FSDP default (``mix``), and model variables that are not parameters (BatchNorm
statistics, the dropout RNG stream).
"""

from __future__ import annotations

import jax
import numpy as np
import optax
from flax import nnx

from trainers.config import Config, MeshConfig, RunConfig
from trainers.data import DataConfig
from trainers.lr import LRConfig
from trainers.task import Task

D_IN, N_CLASSES = 16, 4


class Classifier(nnx.Module):
    def __init__(self, hidden: int, *, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(D_IN, hidden, rngs=rngs,
                                 kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "mlp")))
        self.norm = nnx.BatchNorm(hidden, momentum=0.9, rngs=rngs)
        self.mix = nnx.Linear(hidden, hidden, rngs=rngs)  # no dims: the FSDP default decides
        self.dropout = nnx.Dropout(0.1, rngs=rngs)
        self.out = nnx.Linear(hidden, N_CLASSES, rngs=rngs)  # dims from the task's path rule

    def __call__(self, x_BD: jax.Array) -> jax.Array:
        h_BF = jax.nn.relu(self.norm(self.hidden(x_BD)))
        return self.out(self.dropout(jax.nn.relu(self.mix(h_BF))))


def examples(n: int, seed: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, D_IN)).astype(np.float32)
    labels = (x @ np.random.default_rng(1234).normal(size=(D_IN, N_CLASSES))).argmax(-1).astype(np.int32)
    return [{"x": x[i], "label": labels[i]} for i in range(n)]


def loss(model, batch, rngs):
    logits = model(batch["x"])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
    return ce, {"accuracy": (logits.argmax(-1) == batch["label"]).mean()}


def accuracy(model, batch):
    return model(batch["x"]).argmax(-1) == batch["label"]


def make_task(hidden: int = 64) -> Task:
    """The task with ``hidden`` units, its default config 8 devices as ``data=2 x fsdp=4``."""
    cfg = Config(mesh=MeshConfig(axes="data=2,fsdp=4"), rules="fsdp", data=DataConfig(global_batch=16),
                 lr=LRConfig(kind="constant", peak_lr=1e-2, warmup_steps=2),
                 run=RunConfig(name="byom", steps=20, eval_every=10, eval_batches=2, log_every=5))
    return Task(model=lambda rngs: Classifier(hidden, rngs=rngs), loss=loss, data=examples(256, 0),
                eval_data=examples(64, 1), eval_metrics={"accuracy": accuracy},
                path_rules=((r"^out/kernel$", ("mlp", None)),),
                config=cfg, name="byom")


task = make_task()
wide = make_task(hidden=100)  # 100 does not divide by tensor=8: the diagnostics' example
big = make_task(hidden=512)  # 1 MiB of f32 weights in one unannotated kernel: the planner's known answer
not_a_task = 42
