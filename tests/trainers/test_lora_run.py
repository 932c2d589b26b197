"""A LoRA run (lora.rank >= 1) from a Hugging Face folder: the base stays frozen with no optimizer state, every
layout equals one device, a resume onto another mesh is exact, and the run exports as PEFT's adapter and as
merged weights that compute what it trained."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

import meshes
import spmd
from spmd.interchange import load_pretrained, save_pretrained
from spmd.models import GPT, GPTConfig
from trainers import load_model, lora, override, recipe, train
from trainers.launch.models import export_main

CFG = GPTConfig(vocab_size=256, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, norm_eps=1e-5,
                tied_head_scale=False)
TOL = 1e-5


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf") / "llama"
    save_pretrained(str(out), CFG, nnx.to_pure_dict(nnx.state(GPT(CFG, rngs=nnx.Rngs(3)), nnx.Param)))
    return out


def lora_run(hf, run_dir, mesh, *extra, steps=3):
    cfg = override(recipe("gpt-small", tiny=True), [
        f"checkpoint.init_from=hf:{hf}", f"run.run_dir={run_dir}", f"run.steps={steps}", "lr.total_steps=10",
        "lr.warmup_steps=0", "lr.peak_lr=0.01", f"mesh.axes={mesh}", "rules=fsdp_tp", "checkpoint.every_steps=1000",
        "checkpoint.async_save=false", "run.eval_batches=0", "run.progress=false", "run.tensorboard=false",
        "lora.rank=4", "lora.alpha=8", *extra])
    sizes = dict(kv.split("=") for kv in mesh.split(","))
    devices = jax.devices()[:1] if mesh == "data=1" else None
    return train(cfg, mesh=meshes.make_mesh({k: int(v) for k, v in sizes.items()}, devices=devices), keep_state=True)


@pytest.fixture(scope="module")
def one_device(hf_folder, tmp_path_factory):
    return lora_run(hf_folder, tmp_path_factory.mktemp("one"), "data=1")


@pytest.fixture(scope="module")
def other_alpha(hf_folder, tmp_path_factory):
    """Negative control for the layouts: the one-device run with another alpha (2 steps), shared by every layout."""
    return lora_run(hf_folder, tmp_path_factory.mktemp("alpha"), "data=1", "lora.alpha=9", steps=2)


def flat(tree):
    return {spmd.sharding.path_str(p, drop=()): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def test_the_base_is_frozen_and_has_no_optimizer_state(hf_folder, one_device):
    start = flat(nnx.to_pure_dict(nnx.state(load_pretrained(str(hf_folder)), nnx.Param)))
    params = flat(one_device.state.params)
    adapters = [k for k in params if "_proj/" in k]
    assert len(adapters) == 7 * 2
    for k, v in start.items():
        np.testing.assert_array_equal(params[k], v, err_msg=k)  # not one bit of the base moved
    assert all(np.abs(params[k]).max() > 0 for k in adapters if k.endswith("/b"))  # B left zero: the adapters trained
    n_adapter, n_all = lora.count(one_device.state.params)
    opt = sum(x.size for x in jax.tree.leaves(one_device.state.opt_state))
    assert n_adapter * 2 <= opt <= n_adapter * 2 + 16  # AdamW's two moments of the adapters, and counters
    assert opt < 0.5 * n_all  # negative control on the count: the full model's moments would be 2 x n_all


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [pytest.param(m, marks=pytest.mark.sweep) for m in ("data=2,fsdp=2,tensor=2", "fsdp=4,tensor=2")])
def test_layouts_equal_one_device(hf_folder, one_device, other_alpha, tmp_path, mesh):
    result = lora_run(hf_folder, tmp_path, mesh)
    assert result.losses == pytest.approx(one_device.losses, abs=TOL, rel=0)
    ours, ref = flat(result.state.params), flat(one_device.state.params)
    for k in ref:
        np.testing.assert_allclose(ours[k], ref[k], atol=TOL, rtol=0, err_msg=k)
    # negative control: another alpha is caught at this tolerance
    assert abs(other_alpha.losses[2] - one_device.losses[2]) > 100 * TOL


@pytest.mark.sweep
def test_resume_onto_another_mesh_is_exact(hf_folder, tmp_path):
    first = lora_run(hf_folder, tmp_path, "data=2,fsdp=2,tensor=2", steps=2)
    resumed = lora_run(hf_folder, tmp_path, "fsdp=4,tensor=2", steps=3)
    assert resumed.start_step == 2
    straight = lora_run(hf_folder, tmp_path / "straight", "data=2,fsdp=2,tensor=2", steps=3)
    assert first.losses == {k: straight.losses[k] for k in first.losses}
    assert resumed.losses[3] == pytest.approx(straight.losses[3], abs=TOL, rel=0)
    # the restored state is the saved one, bit for bit, on the other mesh
    mesh = meshes.make_mesh({"fsdp": 4, "tensor": 2})
    saved, restored = flat(first.state.params), flat(nnx.to_pure_dict(nnx.state(load_model(f"{tmp_path}/2", mesh, "fsdp_tp"), nnx.Param)))
    for k in saved:
        np.testing.assert_array_equal(restored[k], saved[k], err_msg=k)


def test_exports_as_peft_and_as_merged_weights(hf_folder, one_device, tmp_path):
    run_dir = one_device.run_dir
    assert export_main([run_dir, "--to", "peft", str(tmp_path / "peft")]) == 0
    assert export_main([run_dir, "--to", "hf", str(tmp_path / "hf")]) == 0
    tokens = np.random.default_rng(0).integers(0, 256, (2, 16)).astype(np.int32)
    logits = jax.jit(lambda m, x: m(x))
    trained = np.asarray(logits(load_model(run_dir, meshes.single_device_mesh(), "none"), tokens))
    merged = np.asarray(logits(load_pretrained(str(tmp_path / "hf")), tokens))
    adapted = np.asarray(logits(lora.load_adapted(str(hf_folder), peft=str(tmp_path / "peft")), tokens))
    base = np.asarray(logits(load_pretrained(str(hf_folder)), tokens))
    np.testing.assert_allclose(merged, trained, atol=TOL, rtol=0)
    np.testing.assert_allclose(adapted, trained, atol=TOL, rtol=0)
    via_load_model = np.asarray(logits(load_model(f"hf:{hf_folder}", peft=str(tmp_path / "peft")), tokens))
    np.testing.assert_array_equal(via_load_model, adapted)
    with pytest.raises(ValueError, match="give the source as hf:PATH"):
        load_model(run_dir, peft=str(tmp_path / "peft"))
    assert np.abs(base - trained).max() > 1e-3  # negative control: the adapters changed the model


def test_a_run_starts_from_a_peft_adapter(hf_folder, one_device, tmp_path):
    export_main([one_device.run_dir, "--to", "peft", str(tmp_path / "peft")])
    result = lora_run(hf_folder, tmp_path / "run", "data=1", f"lora.init_from=peft:{tmp_path / 'peft'}",
                      "lora.rank=1", steps=1)
    ours, theirs = flat(result.state.params), flat(one_device.state.params)
    for k in theirs:
        if "_proj/" not in k:
            np.testing.assert_array_equal(ours[k], theirs[k], err_msg=k)  # the same frozen base
    assert result.losses[1] != pytest.approx(one_device.losses[1], abs=1e-3)  # not the fresh start's first loss


# ------------------------------------------------------------------------------------ dropout (lora.dropout)
def test_dropout_is_on_the_adapter_input_with_the_mask_of_its_key():
    """The adapter's gradient with dropout p equals a hand-computed one on the same mask (drawn here, not by the
    adapter), about a fraction p of the input is dropped; off in eval mode (as created) it is the plain update."""
    from spmd.models.lora import Adapter, LoRASpec

    p, shape = 0.3, (2, 16, 8)
    adapter = Adapter(LoRASpec(4, 8.0, dropout=p), (8,), ("embed",), (6,), ("mlp",), rngs=nnx.Rngs(0))
    adapter.b.set_value(jax.random.normal(jax.random.key(1), (4, 6)))
    key = jax.random.key_data(jax.random.key(7))
    adapter.key.set_value(key)
    x = jax.random.normal(jax.random.key(2), shape)
    w = jax.random.normal(jax.random.key(3), (2, 16, 6))

    graphdef, state = nnx.split(adapter)

    def ours(a, b, train):
        m = nnx.merge(graphdef, state, copy=True)
        m.a.set_value(a)
        m.b.set_value(b)
        m.deterministic = not train
        return (m(x, lambda v: v.get_value()) * w).sum()

    keep = np.stack([jax.random.bernoulli(jax.random.fold_in(jax.random.wrap_key_data(key), row), 1 - p, shape[1:])
                     for row in range(shape[0])])  # row b's mask over [L, in] from fold_in(key, b)
    assert abs(1 - keep.mean() - p) < 0.05

    def reference(a, b, mask):
        return ((x * mask) @ a @ b * 2.0 * w).sum()  # scale = alpha / rank = 2

    a0, b0 = adapter.a.get_value(), adapter.b.get_value()
    got = jax.grad(ours, argnums=(0, 1))(a0, b0, True)
    want = jax.grad(reference, argnums=(0, 1))(a0, b0, keep / (1 - p))
    for g, r in zip(got, want):  # f32 sums in two orders: their rounding scales with the largest entries
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6 * np.abs(r).max())
    plain = jax.grad(ours, argnums=(0, 1))(a0, b0, False)
    np.testing.assert_allclose(plain[1], jax.grad(reference, argnums=1)(a0, b0, 1.0), rtol=1e-5, atol=1e-6)
    assert np.abs(np.asarray(plain[1]) - np.asarray(got[1])).max() > 1e-2  # negative control: the mask matters


def test_dropout_trains_only_and_is_deterministic_for_a_key():
    """A GPT with ``lora.dropout=0.5`` through the run's LoRA loss: in train mode its loss and adapter gradients
    differ from p=0's on the same weights and are bit-equal for the same key on every call (the compiled
    function reused); another key draws other masks; in eval mode it is p=0's; PEFT's config carries it."""
    from spmd.models.lora import LoRASpec
    from trainers.step import lm_loss_fn

    cfg = GPTConfig(vocab_size=64, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=32)
    loss_fn = lora.frozen_base_loss(lm_loss_fn())
    tokens = np.random.default_rng(0).integers(0, 64, (2, 9)).astype(np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}

    def model_of(p):
        model = GPT(cfg, rngs=nnx.Rngs(0), lora=LoRASpec(4, 8.0, dropout=p))
        for path, var in nnx.iter_graph(model):
            if path and path[-1] == "b":
                var.set_value(0.1 * jax.random.normal(jax.random.key(len(path)), var.get_value().shape))
        return nnx.split(model)

    def step(graphdef, state, key, train):
        params, rest = nnx.split_state(state, nnx.Param, ...)

        def loss(params, rest):
            model = nnx.merge(graphdef, params, rest, copy=True)
            model.train() if train else model.eval()
            out = loss_fn(model, batch, nnx.Rngs(key))
            return out[0] if isinstance(out, tuple) else out

        return jax.value_and_grad(loss)(params, rest)

    step = jax.jit(step, static_argnums=(0, 3))
    (g0, s0), (g5, s5) = model_of(0.0), model_of(0.5)
    assert jax.tree.all(jax.tree.map(np.array_equal, nnx.state(s0, nnx.Param), nnx.state(s5, nnx.Param)))
    key, other = jax.random.key(1), jax.random.key(2)
    plain, drop, again, moved = step(g0, s0, key, True), step(g5, s5, key, True), step(g5, s5, key, True), \
        step(g5, s5, other, True)
    assert abs(float(drop[0]) - float(plain[0])) > 1e-4
    assert float(again[0]) == float(drop[0]) and jax.tree.all(jax.tree.map(np.array_equal, again[1], drop[1]))
    assert float(moved[0]) != float(drop[0])
    np.testing.assert_allclose(step(g5, s5, key, False)[0], plain[0], rtol=1e-6)  # eval mode: p=0's computation
    assert lora.peft_config(LoRASpec(4, 8.0, dropout=0.5))["lora_dropout"] == 0.5
    with pytest.raises(ValueError, match=r"lora.dropout=1.0 must be a number in \[0, 1\)"):
        lora.LoRAConfig(rank=4, dropout=1.0)
