"""Train steps with gradient accumulation on the tiny GPT, one compile per (layout, k, fsdp_gather).

SGD at lr 1 without clipping: the update is the gradient itself, so params after one step
compare the gradients (Adam would amplify float noise in near-zero gradients).
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import optax

import meshes
from helpers.gpt_util import CFG, LAYOUTS, LENGTH, gpt_config, gpt_task
from spmd.hlo import collectives
from trainers.setup import build

ROWS = 32  # global batch: 4 microbatches of 8 rows, one row per device at 8-way data parallelism
TX = optax.sgd(1.0)
PIPELINE = ("pipeline.schedule=1f1b", "pipeline.microbatches=2")  # the GPT's blocks run as a 1F1B pipeline
PIPELINED = {"dp4_pipe2": ({"data": 4, "pipe": 2}, "dp"), "dp2_pipe2_tp2": ({"data": 2, "pipe": 2, "tensor": 2}, "dp_tp")}


def tokens(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, CFG.vocab_size, size=(ROWS, LENGTH + 1), dtype=np.int32)


class AccumStep:
    """The state, jitted step and compiled HLO collectives of one (layout, k, fsdp_gather): the run's own
    step (:func:`trainers.setup.build`), the spike and update checks off."""

    def __init__(self, name: str, k: int, fsdp_gather: str):
        sizes, rules = PIPELINED.get(name) or LAYOUTS[name]
        self.mesh = meshes.single_device_mesh() if name == "single" else meshes.make_mesh(sizes)
        cfg = gpt_config(sizes, rules, f"data.global_batch={ROWS}", f"run.grad_accum={k}", f"run.fsdp_gather={fsdp_gather}",
                         *(PIPELINE if name in PIPELINED else ()))
        task = gpt_task(pipeline=cfg.pipeline if name in PIPELINED else None)
        run = build(cfg, task, self.mesh, tx=TX, donate=False)
        self.state, self.step, self.batch_sharding = run.stepped.state, run.train_step, run.batch_sharding

    def batch(self, seed: int = 0) -> dict:
        t = tokens(seed)
        return {"inputs": jax.device_put(t[:, :-1], self.batch_sharding),
                "targets": jax.device_put(t[:, 1:], self.batch_sharding)}

    @functools.cached_property
    def compiled(self):
        return self.step.lower(self.state, self.batch()).compile()

    @functools.cached_property
    def ops(self) -> list:
        return collectives(self.compiled, self.mesh)

    def run(self, seed: int = 0) -> tuple[dict, dict]:
        """Params after one step and the step's metrics, as numpy."""
        state, metrics = self.compiled(self.state, self.batch(seed))  # one compile per step
        return jax.tree.map(np.asarray, state.params), jax.tree.map(np.asarray, metrics)


@functools.cache
def accum_step(name: str, k: int, fsdp_gather: str = "per_microbatch") -> AccumStep:
    return AccumStep(name, k, fsdp_gather)


@functools.cache
def reference(seed: int = 0) -> tuple[dict, dict]:
    """One device, the whole batch at once."""
    return accum_step("single", 1).run(seed)
