"""Hugging Face checkpoints import with transformers' logits, loss and greedy tokens, export bit-equal, and bad ones fail clearly."""

import json
import os
import shutil

import jax
import numpy as np
import pytest
from flax import nnx
from helpers.paths import REPO

import meshes
import spmd
from spmd.interchange import load_pretrained, pretrained_config, save_pretrained
from spmd.interchange.hf_config import gpt_config, read_config
from spmd.interchange.safetensors_io import SafetensorsFolder
from spmd.models import GPTConfig, generate

FIXTURES = os.path.join(REPO, "tests", "fixtures", "hf")
FAMILIES = ("llama", "mistral", "qwen2", "mixtral")
TOL = 1e-4
LAYOUTS = {"single": ({}, "none"), "dp2_fsdp2_tp2": ({"data": 2, "fsdp": 2, "tensor": 2}, "fsdp_tp"),
           "fsdp4_tp2": ({"fsdp": 4, "tensor": 2}, "fsdp_tp")}


def reference(family):
    return np.load(os.path.join(FIXTURES, family, "reference.npz"))


def mesh_of(layout):
    sizes, rules = LAYOUTS[layout]
    return (meshes.make_mesh(sizes) if sizes else meshes.single_device_mesh()), rules


def rel(a, b):
    return float(np.abs(np.asarray(a) - b).max() / np.abs(b).max())


def logits_and_loss(model, tokens, mesh, rules):
    with jax.set_mesh(mesh), spmd.use_rules(rules, mesh):
        logits = jax.jit(lambda m, x: m(x))(model, tokens)
        loss = jax.jit(lambda m, x: m.loss(x[:, :-1], x[:, 1:])[0])(model, tokens)
    return np.asarray(logits), float(loss)


def check_parity(family, layout):
    ref = reference(family)
    mesh, rules = mesh_of(layout)
    model = load_pretrained(os.path.join(FIXTURES, family), mesh, rules)
    reps = 1 if layout == "single" else 2  # the MoE's shard_map needs the batch to divide over data x fsdp
    logits, loss = logits_and_loss(model, np.tile(ref["tokens"], (reps, 1)), mesh, rules)
    assert rel(logits, np.tile(ref["logits"], (reps, 1, 1))) < TOL
    assert loss == pytest.approx(float(ref["loss"]), rel=TOL)


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_and_loss_equal_transformers_on_one_device(family):
    check_parity(family, "single")


def test_logits_equal_transformers_on_dp2_fsdp2_tp2():
    check_parity("qwen2", "dp2_fsdp2_tp2")  # biases and tied head sharded


@pytest.mark.parametrize("family, layout", [  # the sweep (the fast tier: qwen2 on dp2_fsdp2_tp2)
    pytest.param(f, layout, marks=pytest.mark.sweep)
    for f in FAMILIES for layout in ("dp2_fsdp2_tp2", "fsdp4_tp2")])
def test_logits_equal_transformers_sharded(family, layout):
    check_parity(family, layout)


def test_negative_control_without_llama3_rope_scaling():
    """The llama fixture's RoPE scaling matters: dropping it moves the logits far beyond the tolerance."""
    ref = reference("llama")
    model = load_pretrained(os.path.join(FIXTURES, "llama"))
    model.blocks.block.attn.rope_scaling = None
    logits, _ = logits_and_loss(model, ref["tokens"], *mesh_of("single"))
    assert rel(logits, ref["logits"]) > 100 * TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_import_then_export_is_bit_equal(family, tmp_path):
    mesh, rules = mesh_of("fsdp4_tp2")
    model = load_pretrained(os.path.join(FIXTURES, family), mesh, rules)
    files = save_pretrained(str(tmp_path), model.cfg, nnx.to_pure_dict(nnx.state(model, nnx.Param)),
                            max_shard_bytes=50_000)
    assert len(files) > 2 and os.path.isfile(tmp_path / "model.safetensors.index.json")  # sharded
    src, out = SafetensorsFolder(os.path.join(FIXTURES, family)), SafetensorsFolder(str(tmp_path))
    assert src.names == out.names
    for name in src.names:
        a, b = src.read(name), out.read(name)
        assert a.dtype == b.dtype and np.array_equal(a, b), name
    assert pretrained_config(str(tmp_path)) == pretrained_config(os.path.join(FIXTURES, family))


@pytest.mark.parametrize("loop", ["scan", "unrolled"])
@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_greedy_generation_equals_transformers(family, loop):
    """Both layer loops of decode (scanned stacked weights; per-layer buffers) give transformers' tokens."""
    ref = reference(family)
    model = load_pretrained(os.path.join(FIXTURES, family))
    np.testing.assert_array_equal(np.asarray(generate(model, ref["prompt"], 32, loop=loop)), ref["generated"])


@pytest.mark.parametrize("family", [pytest.param(f, marks=pytest.mark.sweep) for f in FAMILIES])
def test_generation_sharded_equals_transformers_and_sampling_is_layout_free(family):
    ref = reference(family)
    prompt = np.tile(ref["prompt"], (2, 1))
    samples = []
    for layout in ("single", "dp2_fsdp2_tp2"):
        mesh, rules = mesh_of(layout)
        model = load_pretrained(os.path.join(FIXTURES, family), mesh, rules)
        for loop in ("scan", "unrolled") if layout != "single" else ("scan",):  # both, one device: a fast test
            greedy = np.asarray(generate(model, prompt, 32, mesh=mesh, rules=rules, loop=loop))
            np.testing.assert_array_equal(greedy, np.tile(ref["generated"], (2, 1)))
        samples.append(np.asarray(generate(model, prompt, 16, 1.0, 8, 0.9, seed=7, mesh=mesh, rules=rules)))
    np.testing.assert_array_equal(samples[0], samples[1])
    assert not np.array_equal(samples[0][:, :16], greedy[:, :16])  # sampling is not greedy


# ---- bad checkpoints and configs: one clear message each -----------------------------------------

def copy_fixture(tmp_path, family="llama"):
    out = tmp_path / family
    shutil.copytree(os.path.join(FIXTURES, family), out)
    return out


def rewrite(folder, drop=None, change=None):
    from safetensors.numpy import save_file
    src = SafetensorsFolder(str(folder))
    tensors = {n: src.read(n) for n in src.names if n != drop}
    if change:
        tensors[change] = tensors[change][:-1]
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def test_bad_checkpoints_name_the_problem(tmp_path):
    folder = copy_fixture(tmp_path)
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="model.safetensors is truncated"):
        load_pretrained(str(folder))
    shutil.rmtree(folder)
    folder = copy_fixture(tmp_path)
    rewrite(folder, drop="model.layers.1.self_attn.v_proj.weight")
    with pytest.raises(ValueError, match=r"no tensor model.layers.1.self_attn.v_proj.weight \(shape \(16, 32\)"):
        load_pretrained(str(folder))
    shutil.rmtree(folder)
    folder = copy_fixture(tmp_path)
    rewrite(folder, change="model.layers.0.mlp.up_proj.weight")
    with pytest.raises(ValueError, match=r"up_proj.weight has shape \(63, 32\), the model config needs \(64, 32\)"):
        load_pretrained(str(folder))
    hf = read_config(str(folder))
    with pytest.raises(ValueError, match="model_type 'gpt_neox' is not a known family; known: llama, mistral"):
        gpt_config({**hf, "model_type": "gpt_neox"})
    shutil.rmtree(folder)
    folder = copy_fixture(tmp_path, "qwen2")  # tied: a stray lm_head is ignored, any other extra tensor is not
    src = SafetensorsFolder(str(folder))
    from safetensors.numpy import save_file
    save_file({n: src.read(n) for n in src.names} | {"model.extra.weight": np.zeros(3, np.float32)},
              str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"1 tensor\(s\) a qwen2 model of this config does not: model.extra.weight"):
        load_pretrained(str(folder))


def test_published_and_new_config_layouts_agree():
    new = read_config(os.path.join(FIXTURES, "llama"))
    rope = new["rope_parameters"]
    old = {k: v for k, v in new.items() if k not in ("rope_parameters", "dtype")}
    old.update(rope_theta=rope["rope_theta"], torch_dtype="float32",
               rope_scaling={k: v for k, v in rope.items() if k != "rope_theta"})
    assert gpt_config(old) == gpt_config(new)
    cfg = gpt_config(new)
    assert (cfg.rope_scaling, cfg.rope_original_length, cfg.norm_eps) == ("llama3", 32, 1e-5)
    qwen = read_config(os.path.join(FIXTURES, "qwen2"))
    assert gpt_config({**qwen, "sliding_window": 16}).max_length == 0  # use_sliding_window=false turns it off
    assert gpt_config(read_config(os.path.join(FIXTURES, "mistral"))).max_length == 64
    with pytest.raises(ValueError, match=r"model.d_model=64 \(the checkpoint has 32\)"):
        gpt_config(new, GPTConfig(d_model=64))
    assert gpt_config(new, GPTConfig(dtype="bfloat16", remat=True)).dtype == "bfloat16"  # compute settings pass
    with pytest.raises(ValueError, match="RoPE type 'yarn' is not supported"):
        gpt_config({**new, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}})


def test_sequences_past_the_sliding_window_are_refused():
    model = load_pretrained(os.path.join(FIXTURES, "mistral"))
    with pytest.raises(ValueError, match="sequence length 65 exceeds GPTConfig.max_length=64"):
        jax.eval_shape(lambda m: m(np.zeros((1, 65), np.int32)), model)
    with pytest.raises(ValueError, match=r"= 72 exceeds GPTConfig.max_length=64"):
        generate(model, np.zeros((1, 8), np.int32), 64)


def test_param_count_covers_the_imported_families():
    from spmd.models import param_count

    for family in FAMILIES:
        model = load_pretrained(os.path.join(FIXTURES, family))
        n = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
        assert param_count(model.cfg) == n, family


def test_bfloat16_checkpoints_round_trip_bit_equal(tmp_path):
    """A bf16 checkpoint (as most published ones) imports to f32 exactly and exports back bit-equal."""
    model = load_pretrained(os.path.join(FIXTURES, "llama"))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    save_pretrained(str(tmp_path / "bf16"), model.cfg, params, dtype="bfloat16")
    assert set(SafetensorsFolder(str(tmp_path / "bf16")).dtypes.values()) == {"BF16"}
    again = load_pretrained(str(tmp_path / "bf16"))
    save_pretrained(str(tmp_path / "again"), again.cfg, nnx.to_pure_dict(nnx.state(again, nnx.Param)), dtype="bfloat16")
    a, b = SafetensorsFolder(str(tmp_path / "bf16")), SafetensorsFolder(str(tmp_path / "again"))
    assert all(np.array_equal(a.read(n).view(np.uint16), b.read(n).view(np.uint16)) for n in a.names)
    with open(tmp_path / "bf16" / "config.json") as f:
        assert json.load(f)["dtype"] == "bfloat16"
