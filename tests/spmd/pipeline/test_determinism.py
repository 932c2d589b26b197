"""A compiled step gives the same result on every call, also when its executable comes back from the compile cache.

Each case compiles a loss-and-gradient (or a whole train step), loads the executable back the way the
persistent compile cache does (``serialize`` / ``deserialize_and_load``) and calls it repeatedly: every
call must be bit-equal to the first, and equal to one device (1e-5). Programs that put collectives
inside loops and branches are covered: every pipeline schedule on ``data x pipe x tensor``,
``fsdp x pipe x tensor`` and ``data x pipe`` with GQA, the trainer step with accumulation and a
pipeline, context parallelism (both K/V exchanges) and MoE over ``expert``. Negative control: a
perturbed result is caught by the same comparison. (docs/pipelines.md says what went wrong once.)
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from flax import nnx
from helpers.accum_util import accum_step
from helpers.accum_util import reference as accum_reference
from helpers.gpt_util import rel_err
from helpers.hlo_checks import unanchored_collectives
from helpers.shared_init import gpt_params
from jax.experimental import serialize_executable

import meshes
import spmd
from spmd.models import GPTConfig
from spmd.pipeline import PipelineConfig

TOL = 1e-5
CFG = GPTConfig(vocab_size=64, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=64)
MOE = GPTConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, n_experts=4)
LENGTH = 16

DPT = (("data", 2), ("pipe", 2), ("tensor", 2))
FPT = (("fsdp", 2), ("pipe", 2), ("tensor", 2))
DP = (("data", 4), ("pipe", 2))
SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved": 2, "zb-h1": 1, "zb-h2": 1}  # schedule -> V
RULES = {DPT: "dp_tp", FPT: "fsdp_tp", DP: "dp"}


def loaded_back(lowered, *args):
    """``() -> lowered(*args)`` from the executable as the persistent compile cache hands it back: compiled,
    serialized and loaded. On a warm run the compile itself came from that cache, and such an executable
    does not serialize again (its kernels are not in the payload): then it is used as it is."""
    compiled = lowered.compile()
    loaded = serialize_executable.deserialize_and_load(*serialize_executable.serialize(compiled))
    try:
        jax.block_until_ready(loaded(*args))
    except jax.errors.JaxRuntimeError as e:
        if "not found" not in str(e):
            raise
        loaded = compiled
    return lambda: loaded(*args)


def repeat(fn, n: int) -> list:
    return [jax.tree.map(np.asarray, fn()) for _ in range(n)]


def assert_deterministic(outs: list, reference) -> None:
    """Every call bit-equal to the first, and the first equal to ``reference`` within TOL."""
    differ = [i for i, out in enumerate(outs[1:], 1)
              if not all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(outs[0])))]
    wrong = [i for i, out in enumerate(outs) if rel_err(out, reference) > TOL]
    assert not differ and not wrong, (f"{len(differ)} of {len(outs) - 1} calls differ from the first, "
                                      f"{len(wrong)} of {len(outs)} differ from one device by more than {TOL}")


@functools.cache
def gpt_grad(sizes: tuple = (), rules: str = "none", schedule: str = "none", m: int = 1, v: int = 1,
             cfg: GPTConfig = CFG, batch: int = 12):
    """``() -> (loss, grads)``: the GPT's loss and gradient on one fixed batch, from a loaded-back executable."""
    lowered, args = gpt_lowered(sizes, rules, schedule, m, v, cfg, batch)
    if not sizes:  # the one-device reference
        compiled = lowered.compile()
        return lambda: compiled(*args)
    return loaded_back(lowered, *args)


def gpt_lowered(sizes: tuple, rules: str, schedule: str, m: int, v: int, cfg: GPTConfig, batch: int):
    """(the lowered loss-and-gradient, its arguments)."""
    mesh = meshes.make_mesh(dict(sizes)) if sizes else meshes.single_device_mesh()
    rules_ = spmd.get_rules(rules)
    pipeline = PipelineConfig(schedule, m, v) if schedule != "none" else None
    graphdef, params, shardings = gpt_params(cfg, rules_, mesh)  # one init per cfg, placed on the mesh

    def loss(params, x, y):
        with spmd.use_rules(rules_, mesh):
            return nnx.merge(graphdef, params).loss(x, y, pipeline=pipeline)[0]

    bs = spmd.batch_sharding(rules_, mesh)
    t = np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, LENGTH + 1)).astype(np.int32)
    x, y = jax.device_put(t[:, :-1], bs), jax.device_put(t[:, 1:], bs)
    return jax.jit(jax.value_and_grad(loss), in_shardings=(shardings, bs, bs)).lower(params, x, y), (params, x, y)


def test_the_unanchored_collective_check_finds_one():
    """A collective on constants alone (what GPipe's loss mean over data became in the backward; the trainer
    test of a user stack model as a pipeline checks its step has none, tests/trainers/test_task.py)."""
    control = ("HloModule m\n\nENTRY %main.1 () -> f32[] {\n  %constant.1 = f32[] constant(1)\n"
               "  ROOT %x = f32[] all-reduce(%constant.1), replica_groups={}, to_apply=%add\n}\n")
    assert len(unanchored_collectives(control)) == 1
    lowered, _ = gpt_lowered(DP, RULES[DP], "gpipe", 2, 1, CFG, 8)
    assert not unanchored_collectives(lowered.compile().as_text())


# data x pipe x tensor: interleaved in the slow tier (1F1B: the trainer step's test below), the other
# schedules and layouts in the sweep
TIERED = ("interleaved",)
SLOW_CASES = [pytest.param(DPT, schedule, 4, marks=pytest.mark.slow if schedule in TIERED else pytest.mark.sweep,
                           id=f"{RULES[DPT]}-{schedule}-M4") for schedule in SCHEDULES]
SWEEP_CASES = [pytest.param(sizes, s, 4, marks=pytest.mark.sweep, id=f"{RULES[sizes]}-{s}-M4")
               for sizes, schedules in ((FPT, ("1f1b", "interleaved", "zb-h2")), (DP, ("gpipe", "1f1b", "zb-h1")))
               for s in schedules]


@pytest.mark.parametrize("sizes, schedule, m", SLOW_CASES + SWEEP_CASES)
def test_every_schedule_and_layout_is_deterministic(sizes, schedule, m):
    v = SCHEDULES[schedule]
    outs = repeat(gpt_grad(sizes, RULES[sizes], schedule, m * v if v > 1 else m, v, batch=4 * m * v), 20)
    assert_deterministic(outs, repeat(gpt_grad(batch=4 * m * v), 1)[0])


@pytest.mark.slow
@pytest.mark.parametrize("name", [pytest.param("dp4_pipe2", marks=pytest.mark.sweep), "dp2_pipe2_tp2"])
def test_trainer_step_with_accumulation_and_a_pipeline_is_deterministic(name):
    step = accum_step(name, 2)
    batch = step.batch()
    run = loaded_back(step.step.lower(step.state, batch), step.state, batch)
    outs = repeat(lambda: run()[0].params, 10)
    assert_deterministic(outs, accum_reference()[0])


@pytest.mark.slow
@pytest.mark.parametrize("exchange", [pytest.param(x, marks=pytest.mark.sweep) for x in ("ring", "allgather")])
def test_context_parallelism_is_deterministic(exchange):
    cfg = GPTConfig(**{**CFG.__dict__, "context_exchange": exchange})
    outs = repeat(gpt_grad((("data", 2), ("seq", 2), ("tensor", 2)), "dp_tp", cfg=cfg, batch=4), 20)
    assert_deterministic(outs, repeat(gpt_grad(cfg=cfg, batch=4), 1)[0])


@pytest.mark.slow
def test_moe_over_expert_is_deterministic():
    outs = repeat(gpt_grad((("fsdp", 2), ("expert", 2), ("tensor", 2)), "fsdp_tp_ep", cfg=MOE, batch=8), 20)
    assert_deterministic(outs, repeat(gpt_grad(cfg=MOE, batch=8), 1)[0])
