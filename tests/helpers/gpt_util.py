"""Shared pieces for the GPT layout tests: a tiny model, data, and one compiled step per layout."""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import optax
from flax import nnx

import meshes
import spmd
from spmd.models import GPT, GPTConfig, lm_loss

# scanned: the layout tests read the layer loop's collectives per layer (the unrolled form is compared
# with it, on sharded layouts too, in tests/spmd/test_stack_forms.py)
CFG = GPTConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=8, n_kv_heads=4, d_ff=128, scan_layers="scanned")
BATCH, LENGTH = 8, 16

# name -> (mesh sizes, rule preset)
LAYOUTS = {
    "single": ({}, "none"),
    "dp8": ({"data": 8}, "dp"),
    "fsdp8": ({"fsdp": 8}, "fsdp"),
    "dp2_tp4": ({"data": 2, "tensor": 4}, "dp_tp"),
    "dp2_fsdp2_tp2": ({"data": 2, "fsdp": 2, "tensor": 2}, "fsdp_tp"),
    "dp2_tp4_sp": ({"data": 2, "tensor": 4}, "dp_tp_sp"),
    "dp2_fsdp2_tp2_sp": ({"data": 2, "fsdp": 2, "tensor": 2}, "fsdp_tp_sp"),
    # context parallelism: the length over seq (ring K/V exchange, load-balanced chunks), with GQA (seq = 8:
    # tests/spmd/test_context.py, the attention alone)
    "fsdp2_seq4": ({"fsdp": 2, "seq": 4}, "fsdp"),
    "dp2_seq2_tp2": ({"data": 2, "seq": 2, "tensor": 2}, "dp_tp"),
    "seq2_tp4_sp": ({"seq": 2, "tensor": 4}, "dp_tp_sp"),
}


def gpt_config(sizes: dict[str, int], rules: str, *sets: str, model: GPTConfig = CFG):
    """The gpt-small recipe's tiny config with ``model`` on a mesh of ``sizes`` under ``rules``, a global batch
    of BATCH x LENGTH tokens, the spike and update checks off (``sets``: more overrides)."""
    from trainers.config import override
    from trainers.recipes import recipe

    axes = ",".join(f"{k}={v}" for k, v in sizes.items()) or "data=1"
    cfg = override(recipe("gpt-small", tiny=True), [
        f"mesh.axes={axes}", f"rules={rules}", "data.corpus=synthetic", f"data.global_batch={BATCH}", f"data.seq_len={LENGTH}",
        f"data.vocab_size={model.vocab_size}", "run.spike_factor=0", "run.max_update_ratio=0", "run.max_param_growth=0",
        *sets])
    return dataclasses.replace(cfg, model=model)


def gpt_task(model: GPTConfig = CFG, pipeline=None):
    """``model``'s GPT with the next-token loss as a ``trainers.Task`` (``pipeline``: an enabled
    ``spmd.pipeline.PipelineConfig`` its blocks run as); no data: the tests feed the steps batches."""
    from trainers.step import lm_loss_fn
    from trainers.task import Task

    return Task(model=lambda rngs: GPT(model, rngs=rngs), loss=lm_loss_fn(pipeline=pipeline), data=(),
                pipelined=pipeline is not None)


def make_model() -> GPT:
    return GPT(CFG, rngs=nnx.Rngs(0))


def batches(n: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        tokens = rng.integers(0, CFG.vocab_size, size=(BATCH, LENGTH + 1), dtype=np.int32)
        out.append({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]})
    return out


def mesh_for(name: str):
    sizes, _ = LAYOUTS[name]
    if name == "single":
        return meshes.single_device_mesh()
    return meshes.make_mesh(sizes)


TX = optax.adamw(1e-2, b1=0.9, b2=0.95, weight_decay=0.1)


class Layout:
    """Sharded params, optimizer state and a compiled train step for one layout."""

    def __init__(self, name: str):
        self.name = name
        self.mesh = mesh_for(name)
        self.rules = spmd.get_rules(LAYOUTS[name][1])
        self.graphdef, self.params, self.param_shardings = spmd.init_params(make_model, self.rules, self.mesh)
        abstract_opt = jax.eval_shape(TX.init, self.params)
        self.opt_shardings = spmd.optimizer_shardings(TX, abstract_opt, self.param_shardings, self.mesh)
        self.opt_state = jax.jit(TX.init, out_shardings=self.opt_shardings)(self.params)
        self.batch_sharding = spmd.batch_sharding(self.rules, self.mesh)
        graphdef, rules, mesh = self.graphdef, self.rules, self.mesh

        def loss_fn(params, batch):
            with spmd.use_rules(rules, mesh):
                logits = nnx.merge(graphdef, params)(batch["inputs"])
            return lm_loss(logits, batch["targets"])[0]

        def step(params, opt_state, batch):
            loss, grads = jax.value_and_grad(loss_fn)(params, batch)
            updates, opt_state = TX.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        batch_sh = {"inputs": self.batch_sharding, "targets": self.batch_sharding}
        self.step = jax.jit(
            step,
            in_shardings=(self.param_shardings, self.opt_shardings, batch_sh),
            out_shardings=(self.param_shardings, self.opt_shardings, spmd.sharding.replicated(self.mesh)),
        )
        self.batch_shardings = batch_sh

    def put(self, batch):
        return {k: jax.device_put(v, self.batch_shardings[k]) for k, v in batch.items()}

    def compiled(self):
        abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=self.batch_shardings[k]) for k, v in batches(1)[0].items()}
        return self.step.lower(self.params, self.opt_state, abstract).compile()

    def run(self, data):
        params, opt_state, losses = self.params, self.opt_state, []
        for batch in data:
            params, opt_state, loss = self.step(params, opt_state, self.put(batch))
            losses.append(float(loss))
        return losses, jax.tree.map(np.asarray, params)


@functools.cache
def layout(name: str) -> Layout:
    return Layout(name)


@functools.cache
def run(name: str, n_steps: int = 3, seed: int = 0):
    return layout(name).run(batches(n_steps, seed))


def rel_err(a, b) -> float:
    """Largest per-array norm-relative difference between two pytrees of arrays."""
    errs = jax.tree.map(lambda x, y: float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30)), a, b)
    return max(jax.tree.leaves(errs))

