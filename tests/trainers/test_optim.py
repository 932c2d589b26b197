"""LR schedules, LR scaling, the decay mask and the optimizer chain."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from trainers.lr import SCHEDULE_KINDS, LRConfig, make_lr_schedule, scale_lr
from trainers.optim import (
    DEFAULT_NO_DECAY,
    OPTIMIZER_NAMES,
    OptimizerConfig,
    decay_mask,
    global_norm,
    key_path_str,
    make_optimizer,
)

PEAK, WARMUP, TOTAL, END_FRAC = 1e-3, 10, 110, 0.1
END = PEAK * END_FRAC
V, D, F = 8, 4, 6  # vocab, embed, mlp


def lr_at(cfg: LRConfig, step: int) -> float:
    return float(make_lr_schedule(cfg)(step))


def sched(kind: str, **kw) -> LRConfig:
    base = dict(kind=kind, peak_lr=PEAK, warmup_steps=WARMUP, total_steps=TOTAL, end_lr_fraction=END_FRAC)
    return LRConfig(**{**base, **kw})


def toy_params() -> dict:
    return {
        "embed": {"embedding": jnp.full((V, D), 0.5)},
        "layers": {"mlp": {"w_in": jnp.full((D, F), 0.5), "b_in": jnp.full((F,), 0.5)}, "norm": {"scale": jnp.ones((D,))}},
    }


# ---------------------------------------------------------------- schedules


@pytest.mark.parametrize("kind", SCHEDULE_KINDS)
def test_warmup_is_linear_from_zero_to_peak(kind):
    cfg = sched(kind)
    assert lr_at(cfg, 0) == 0.0
    assert lr_at(cfg, WARMUP // 2) == pytest.approx(PEAK / 2, rel=1e-6)
    assert lr_at(cfg, WARMUP) == pytest.approx(PEAK, rel=1e-6)


@pytest.mark.parametrize("kind, final", [("cosine", END), ("linear", END), ("wsd", END), ("constant", PEAK)])
def test_final_lr_and_hold_after_the_run(kind, final):
    cfg = sched(kind)
    assert lr_at(cfg, TOTAL) == pytest.approx(final, rel=1e-5)
    assert lr_at(cfg, TOTAL + 50) == pytest.approx(final, rel=1e-5)
    assert cfg.end_lr == pytest.approx(final)


@pytest.mark.parametrize("frac", [0.25, 0.5, 0.8])
def test_cosine_matches_the_formula(frac):
    decay = TOTAL - WARMUP
    step = WARMUP + int(frac * decay)
    t = (step - WARMUP) / decay
    expected = END + (PEAK - END) * 0.5 * (1.0 + math.cos(math.pi * t))
    assert lr_at(sched("cosine"), step) == pytest.approx(expected, rel=1e-5)
    # Cross-check against optax's fused schedule, whose decay_steps includes warmup.
    fused = optax.warmup_cosine_decay_schedule(0.0, PEAK, WARMUP, decay_steps=TOTAL, end_value=END)
    assert lr_at(sched("cosine"), step) == pytest.approx(float(fused(step)), rel=1e-5)
    # Negative control: the linear kind at the same step is a different number (except at t=0.5).
    if frac != 0.5:
        assert abs(lr_at(sched("linear"), step) - expected) > 1e-6


def test_linear_decay_midpoint_and_constant_plateau():
    mid = WARMUP + (TOTAL - WARMUP) // 2
    assert lr_at(sched("linear"), mid) == pytest.approx((PEAK + END) / 2, rel=1e-5)
    for step in (WARMUP, mid, TOTAL):
        assert lr_at(sched("constant"), step) == pytest.approx(PEAK, rel=1e-6)


def test_wsd_stable_then_linear_decay():
    cfg = sched("wsd", decay_fraction=0.2)  # decay over the last 22 of 110 steps
    start = TOTAL - cfg.decay_steps
    assert cfg.decay_steps == 22
    for step in (WARMUP, (WARMUP + start) // 2, start):
        assert lr_at(cfg, step) == pytest.approx(PEAK, rel=1e-6), step
    assert lr_at(cfg, start + 1) < PEAK  # decay has begun
    assert lr_at(cfg, start + 11) == pytest.approx((PEAK + END) / 2, rel=1e-5)


def test_no_warmup_starts_at_peak():
    assert lr_at(sched("cosine", warmup_steps=0), 0) == pytest.approx(PEAK)
    # Warmup fills the run: the peak comes at the last step, and step TOTAL is the end LR as always.
    assert lr_at(sched("cosine", warmup_steps=TOTAL), TOTAL - 1) == pytest.approx(PEAK * (TOTAL - 1) / TOTAL, rel=1e-6)
    assert lr_at(sched("cosine", warmup_steps=TOTAL), TOTAL) == pytest.approx(END, rel=1e-5)
    assert lr_at(sched("wsd", warmup_steps=0, decay_fraction=1.0), TOTAL // 2) == pytest.approx((PEAK + END) / 2, rel=1e-5)


def test_schedule_is_jittable_on_a_traced_step():
    schedule = make_lr_schedule(sched("wsd"))
    lrs = jax.jit(jax.vmap(schedule))(jnp.array([0, WARMUP, TOTAL]))
    np.testing.assert_allclose(np.asarray(lrs), [0.0, PEAK, END], rtol=1e-5)


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(kind="step"), "kind='step'.*valid kinds.*cosine"),
        (dict(peak_lr=0.0), "peak_lr=0.0"),
        (dict(peak_lr=float("nan")), "peak_lr=nan"),
        (dict(warmup_steps=-1), "warmup_steps=-1"),
        (dict(total_steps=-1, warmup_steps=0), "total_steps=-1"),
        (dict(warmup_steps=200), "warmup_steps=200 exceeds total_steps=110"),
        (dict(end_lr_fraction=1.5), r"end_lr_fraction=1.5.*\[0, 1\]"),
        (dict(kind="wsd", warmup_steps=100, decay_fraction=0.5), "decay_fraction=0.5"),
        (dict(total_steps=100.0), "total_steps=100.0"),
    ],
)
def test_schedule_config_rejects_bad_values(kw, message):
    with pytest.raises(ValueError, match=message):
        sched(kw.pop("kind", "cosine"), **kw)


def test_scale_lr_rules():
    assert scale_lr(0.1, 1024, 256) == pytest.approx(0.4)
    assert scale_lr(0.1, 1024, 256, rule="sqrt") == pytest.approx(0.2)
    assert scale_lr(0.1, 64, 256) == pytest.approx(0.025)
    assert scale_lr(0.1, 256, 256, rule="sqrt") == pytest.approx(0.1)
    with pytest.raises(ValueError, match="rule='cubic'.*linear.*sqrt"):
        scale_lr(0.1, 1024, 256, rule="cubic")
    with pytest.raises(ValueError, match="global_batch=0"):
        scale_lr(0.1, 0, 256)
    with pytest.raises(ValueError, match="base_lr=-0.1"):
        scale_lr(-0.1, 512, 256)


# ---------------------------------------------------------------- decay mask


def test_decay_mask_excludes_norms_biases_embeddings():
    mask = decay_mask(toy_params())
    assert mask == {
        "embed": {"embedding": False},
        "layers": {"mlp": {"w_in": True, "b_in": False}, "norm": {"scale": False}},
    }


def test_decay_mask_on_shape_dtype_structs_and_stacked_layers():
    sds = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
    params = {
        "token_embed": sds(V, D),
        "unembed": sds(D, V),
        "blocks": {"ln1_scale": sds(3, D), "attn": {"bias": sds(3, D), "kernel": sds(3, D, D)}},
        "step_scalar": sds(),
    }
    expected = {
        "token_embed": False,
        "unembed": True,
        "blocks": {"ln1_scale": False, "attn": {"bias": False, "kernel": True}},
        "step_scalar": False,
    }
    assert decay_mask(params) == expected
    # Negative control: without name patterns the stacked (layers, D) scale and bias are decayed.
    bare = decay_mask(params, patterns=())
    assert bare["blocks"] == {"ln1_scale": True, "attn": {"bias": True, "kernel": True}}
    assert bare["token_embed"] is True


def test_decay_mask_custom_patterns_and_key_paths():
    params = {"layers": [{"w": jnp.ones((2, 2))}, {"w": jnp.ones((2, 2))}]}
    assert decay_mask(params, patterns=(r"^layers/1/",)) == {"layers": [{"w": True}, {"w": False}]}
    paths = [key_path_str(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)]
    assert paths == ["layers/0/w", "layers/1/w"]
    with pytest.raises(ValueError, match=r"'\(unclosed'.*not a valid regex"):
        decay_mask(params, patterns=("(unclosed",))


# ---------------------------------------------------------------- optimizer chain


def one_step(tx, params, grads):
    state = tx.init(params)
    updates, _ = tx.update(grads, state, params)
    return updates


def test_clipping_bounds_the_update():
    params = {"w": jnp.zeros((2, 2)), "b": jnp.zeros((4,))}
    g = 100.0 / math.sqrt(8.0)  # 8 entries -> global norm 100
    grads = {"w": jnp.full((2, 2), g), "b": jnp.full((4,), g)}
    assert float(global_norm(grads)) == pytest.approx(100.0, rel=1e-6)
    plain = OptimizerConfig(name="sgd", momentum=0.0, weight_decay=0.0, clip_norm=None)
    clipped = dataclasses.replace(plain, clip_norm=1.0)
    assert float(global_norm(one_step(make_optimizer(clipped, 1.0), params, grads))) <= 1.0 + 1e-6
    # Negative control: the same step without clipping moves by the full gradient norm.
    assert float(global_norm(one_step(make_optimizer(plain, 1.0), params, grads))) == pytest.approx(100.0, rel=1e-6)


def test_adamw_decays_kernels_but_not_masked_params():
    params = toy_params()
    zero_grads = jax.tree.map(jnp.zeros_like, params)
    cfg = OptimizerConfig(name="adamw", weight_decay=0.1)
    new = optax.apply_updates(params, one_step(make_optimizer(cfg, 1e-2), params, zero_grads))
    # Decoupled decay: w -= lr * wd * w on the kernel only.
    np.testing.assert_allclose(new["layers"]["mlp"]["w_in"], 0.5 * (1 - 1e-2 * 0.1), rtol=1e-6)
    np.testing.assert_array_equal(new["layers"]["norm"]["scale"], params["layers"]["norm"]["scale"])
    np.testing.assert_array_equal(new["layers"]["mlp"]["b_in"], params["layers"]["mlp"]["b_in"])
    np.testing.assert_array_equal(new["embed"]["embedding"], params["embed"]["embedding"])
    # Negative control: with no patterns the embedding (2-D) is decayed too.
    everything = dataclasses.replace(cfg, no_decay=())
    new2 = optax.apply_updates(params, one_step(make_optimizer(everything, 1e-2), params, zero_grads))
    assert not np.allclose(new2["embed"]["embedding"], params["embed"]["embedding"])


@pytest.mark.parametrize("name", OPTIMIZER_NAMES)
def test_every_optimizer_makes_a_finite_descent_step(name):
    params = toy_params()
    grads = jax.tree.map(lambda p: jnp.full_like(p, 0.3), params)
    schedule = make_lr_schedule(LRConfig(kind="cosine", peak_lr=1e-2, warmup_steps=0, total_steps=10))
    tx = make_optimizer(OptimizerConfig(name=name, weight_decay=0.01), schedule)
    state = tx.init(params)
    updates, state = jax.jit(tx.update)(grads, state, params)
    new = optax.apply_updates(params, updates)
    for leaf in jax.tree.leaves(new):
        assert np.isfinite(np.asarray(leaf)).all()
    # A positive gradient must move every kernel down: the step descends.
    assert float(jnp.max(updates["layers"]["mlp"]["w_in"])) < 0.0
    assert float(global_norm(updates)) > 0.0


@pytest.mark.parametrize("name", OPTIMIZER_NAMES)
def test_optimizer_state_builds_abstractly(name):
    params = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), toy_params())
    tx = make_optimizer(OptimizerConfig(name=name), make_lr_schedule(LRConfig(), 1000))
    state = jax.eval_shape(tx.init, params)
    leaves = jax.tree.leaves(state)
    assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    if name == "adamw":
        adam_state = state[1][0]  # chain(clip, adamw) -> adamw = chain(scale_by_adam, ...)
        assert jax.tree.map(lambda x: x.shape, adam_state.mu) == jax.tree.map(lambda x: x.shape, params)


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(name="adam"), "name='adam'.*valid names.*adamw"),
        (dict(b2=1.0), r"b2=1.0.*\[0, 1\)"),
        (dict(eps=0.0), "eps=0.0"),
        (dict(weight_decay=-0.1), "weight_decay=-0.1"),
        (dict(momentum=1.2), "momentum=1.2"),
        (dict(clip_norm=0.0), "clip_norm=0.0.*None"),
        (dict(no_decay="embed"), "no_decay='embed'.*tuple of regex"),
        (dict(no_decay=("[bad",)), r"'\[bad'.*not a valid regex"),
    ],
)
def test_optimizer_config_rejects_bad_values(kw, message):
    with pytest.raises(ValueError, match=message):
        OptimizerConfig(**kw)


def test_make_optimizer_rejects_bad_schedule():
    with pytest.raises(ValueError, match="schedule=-1.0"):
        make_optimizer(OptimizerConfig(), -1.0)
    with pytest.raises(ValueError, match="schedule='fast'"):
        make_optimizer(OptimizerConfig(), "fast")


def test_default_patterns_are_the_config_default():
    assert OptimizerConfig().no_decay == DEFAULT_NO_DECAY
    assert OptimizerConfig(no_decay=["embed"]).no_decay == ("embed",)


def test_mask_and_chain_work_on_an_nnx_model_state():
    from flax import nnx

    class Tiny(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.embed = nnx.Embed(V, D, rngs=rngs)
            self.mlp = nnx.Linear(D, F, rngs=rngs)
            self.norm = nnx.RMSNorm(F, rngs=rngs)

    model = Tiny(nnx.Rngs(0))
    mask = {key_path_str(p): m for p, m in jax.tree_util.tree_leaves_with_path(decay_mask(nnx.state(model, nnx.Param)))}
    assert mask == {
        "embed/embedding/value": False,
        "mlp/bias/value": False,
        "mlp/kernel/value": True,
        "norm/scale/value": False,
    }
    before = {k: np.asarray(v[...]) for k, v in [("kernel", model.mlp.kernel), ("embedding", model.embed.embedding)]}
    opt = nnx.Optimizer(model, make_optimizer(OptimizerConfig(name="adamw"), 1e-2), wrt=nnx.Param)
    opt.update(model, jax.tree.map(jnp.zeros_like, nnx.state(model, nnx.Param)))
    np.testing.assert_allclose(model.mlp.kernel[...], before["kernel"] * (1 - 1e-2 * 0.1), rtol=1e-6)
    np.testing.assert_array_equal(model.embed.embedding[...], before["embedding"])


def test_schedule_length_defaults_to_the_run_length():
    """lr.total_steps 0 means run.steps: the run length is set in one place."""
    from trainers.config import Config, RunConfig, override

    follow = LRConfig(kind="linear", peak_lr=1.0, warmup_steps=0, end_lr_fraction=0.0)
    assert float(make_lr_schedule(follow, 10)(5)) == pytest.approx(0.5)
    assert float(make_lr_schedule(follow, 20)(5)) == pytest.approx(0.75)
    fixed = dataclasses.replace(follow, total_steps=20)
    assert float(make_lr_schedule(fixed, 10)(5)) == pytest.approx(0.75)  # an explicit length wins
    with pytest.raises(ValueError, match="lr.total_steps=0 means the run's length"):
        make_lr_schedule(follow)
    with pytest.raises(ValueError, match="warmup_steps=50 exceeds total_steps=10"):
        Config(lr=dataclasses.replace(follow, warmup_steps=50), run=RunConfig(steps=10))
    cfg = override(Config(), ["run.steps=40", "lr.warmup_steps=4"])
    assert cfg.lr.for_run(cfg.run.steps).total_steps == 40


def test_the_old_schedule_names_are_refused_naming_the_new_ones():
    import trainers.lr
    from trainers.config import Config, override

    with pytest.raises(ValueError, match="unknown config key 'schedule.peak_lr'; did you mean lr.peak_lr"):
        override(Config(), ["schedule.peak_lr=0.5"])
    assert not hasattr(Config(), "schedule") and Config().lr == LRConfig()
    assert not hasattr(trainers.lr, "ScheduleConfig") and not hasattr(trainers.lr, "make_schedule")
