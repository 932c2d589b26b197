"""A run starts from a Hugging Face folder (hf:PATH), exports what it trained, generates from it, and refuses bad checkpoints with exit 2."""

import json
import os
import shutil

import jax
import numpy as np
import pytest
from flax import nnx

import meshes
import spmd
from spmd.interchange import load_pretrained, save_pretrained
from spmd.interchange.safetensors_io import SafetensorsFolder
from spmd.models import GPT, GPTConfig
from trainers import load_model, override, recipe, train
from trainers.launch.cli import main as train_main
from trainers.launch.models import export_main, generate_main

CFG = GPTConfig(vocab_size=256, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, norm_eps=1e-5,
                tied_head_scale=False)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """A random Llama-shaped model with the byte vocab, written as a Hugging Face folder."""
    out = tmp_path_factory.mktemp("hf") / "llama"
    params = nnx.to_pure_dict(nnx.state(GPT(CFG, rngs=nnx.Rngs(3)), nnx.Param))
    save_pretrained(str(out), CFG, params)
    return out


def run_args(hf, run_dir, *extra):
    return ["gpt-small", "--tiny", "--steps", "3", "--run-dir", str(run_dir), "--mesh", "data=2,fsdp=2,tensor=2",
            "--rules", "fsdp_tp", "--set", f"checkpoint.init_from=hf:{hf}", *extra]


@pytest.fixture(scope="module")
def trained(hf_folder, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    cfg = override(recipe("gpt-small", tiny=True), [
        f"checkpoint.init_from=hf:{hf_folder}", f"run.run_dir={run_dir}", "run.steps=3", "lr.total_steps=0",
        "lr.warmup_steps=0", "mesh.axes=data=-1", "rules=dp", "checkpoint.every_steps=3", "run.eval_batches=0", "run.sample_every=3"])
    result = train(cfg)
    return run_dir, result


def test_run_starts_from_the_checkpoint_and_exports_what_it_trained(hf_folder, trained, tmp_path):
    run_dir, result = trained
    with open(run_dir / "config.json") as f:
        model_cfg = json.load(f)["model"]
    assert (model_cfg["d_model"], model_cfg["norm_eps"], model_cfg["d_ff"]) == (32, 1e-5, 64)  # from config.json
    start = load_pretrained(str(hf_folder))
    tokens = np.random.default_rng(0).integers(0, 256, (2, 16)).astype(np.int32)
    assert export_main([str(run_dir), "--to", "hf", str(tmp_path / "out")]) == 0
    exported = load_pretrained(str(tmp_path / "out"))
    mesh = meshes.make_mesh({"fsdp": 4, "tensor": 2})
    trained_model = load_model(str(run_dir), mesh, "fsdp_tp")
    with jax.set_mesh(mesh), spmd.use_rules("fsdp_tp", mesh):
        sharded = np.asarray(jax.jit(lambda m, x: m(x))(trained_model, tokens))
    ours, theirs, before = (np.asarray(jax.jit(lambda m, x: m(x))(m, tokens)) for m in (exported, exported, start))
    np.testing.assert_allclose(ours, sharded, rtol=0, atol=1e-4 * np.abs(sharded).max())
    assert np.abs(before - sharded).max() > 1e-3 * np.abs(sharded).max()  # training moved it
    # import -> export of the trained run's step is bit-stable: export it again from its own export
    save_pretrained(str(tmp_path / "again"), exported.cfg, nnx.to_pure_dict(nnx.state(exported, nnx.Param)))
    a, b = SafetensorsFolder(str(tmp_path / "out")), SafetensorsFolder(str(tmp_path / "again"))
    assert all(np.array_equal(a.read(n), b.read(n)) for n in a.names)


def test_generate_command_prints_text_and_ids(trained, capsys):
    run_dir, _ = trained
    events = b"".join(p.read_bytes() for p in (run_dir / "tensorboard").rglob("events.out.tfevents.*"))
    assert b"samples" in events and b"Once upon a time" in events  # run.sample_every: TensorBoard's text tab
    assert generate_main([str(run_dir / "checkpoints" / "3"), "--prompt", "1 2 3", "--ids", "--max-new-tokens", "5"]) == 0
    ids = [int(t) for t in capsys.readouterr().out.split()]
    assert len(ids) == 5 and all(0 <= t < 256 for t in ids)
    assert generate_main([str(run_dir), "--prompt", "def f(", "--max-new-tokens", "4", "--temperature", "0.7",
                          "--top-k", "5", "--seed", "1"]) == 0
    assert generate_main([str(run_dir / "nope"), "--prompt", "x"]) == 2
    assert "is not a run directory" in capsys.readouterr().err


def test_bad_checkpoints_exit_2_and_write_nothing(hf_folder, tmp_path, capsys):
    bad = tmp_path / "bad"
    shutil.copytree(hf_folder, bad)
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[:-100])
    cases = {
        "truncated": (run_args(bad, tmp_path / "r1"), "model.safetensors is truncated"),
        "contradiction": (run_args(hf_folder, tmp_path / "r2", "--set", "model.d_model=64"),
                          r"fixes these model settings: model.d_model=64 (the checkpoint has 32)"),
        "missing": (run_args(tmp_path / "nothing", tmp_path / "r3"), "is not a directory"),
    }
    for name, (argv, message) in cases.items():
        assert train_main(argv) == 2, name
        assert message in capsys.readouterr().err, name
        run_dir = argv[argv.index("--run-dir") + 1]
        assert not os.path.exists(run_dir) or not os.listdir(run_dir), name
    window = {**json.loads((hf_folder / "config.json").read_text()), "model_type": "mistral", "sliding_window": 8}
    (bad / "config.json").write_text(json.dumps(window))
    (bad / "model.safetensors").write_bytes(data)
    assert train_main(run_args(bad, tmp_path / "r5")) == 2  # the tiny recipe's seq_len 16 > the window
    assert "data.seq_len=16 exceeds the checkpoint's sliding window 8" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "r5") or not os.listdir(tmp_path / "r5")
    (bad / "config.json").write_text(json.dumps({**json.loads((hf_folder / "config.json").read_text()),
                                                  "model_type": "gpt_neox"}))
    (bad / "model.safetensors").write_bytes(data)
    assert train_main(run_args(bad, tmp_path / "r4")) == 2
    assert "model_type 'gpt_neox' is not a known family" in capsys.readouterr().err
    assert export_main([str(tmp_path / "nope"), "--to", "hf", str(tmp_path / "o")]) == 2
    assert not os.path.exists(tmp_path / "o")


def test_print_config_shows_the_checkpoints_model(hf_folder, capsys):
    assert train_main(["gpt-small", "--print-config", "--set", f"checkpoint.init_from=hf:{hf_folder}"]) == 0
    model = json.loads(capsys.readouterr().out)["model"]
    assert (model["d_model"], model["n_kv_heads"], model["norm_eps"], model["tied_head_scale"]) == (32, 2, 1e-5, False)


def test_generate_command_uses_the_folders_tokenizer(tmp_path, capsys):
    """hf:PATH with a tokenizer.json: the prompt is encoded and the continuation decoded with it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.trainers import BpeTrainer

    (tmp_path / "text.txt").write_text("def main():\n    return 1\n" * 50)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train([str(tmp_path / "text.txt")], BpeTrainer(vocab_size=300, show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    cfg = GPTConfig(vocab_size=tok.get_vocab_size(), d_model=32, n_layers=1, n_heads=4, d_ff=64, tied_head_scale=False)
    save_pretrained(str(tmp_path / "hf"), cfg, nnx.to_pure_dict(nnx.state(GPT(cfg, rngs=nnx.Rngs(0)), nnx.Param)))
    tok.save(str(tmp_path / "hf" / "tokenizer.json"))
    prompt_ids = " ".join(map(str, tok.encode("def main").ids))
    assert generate_main([f"hf:{tmp_path / 'hf'}", "--prompt", prompt_ids, "--max-new-tokens", "6", "--ids"]) == 0
    ids = [int(t) for t in capsys.readouterr().out.split()]
    assert generate_main([f"hf:{tmp_path / 'hf'}", "--prompt", "def main", "--max-new-tokens", "6"]) == 0
    assert capsys.readouterr().out.rstrip("\n") == tok.decode(ids)
