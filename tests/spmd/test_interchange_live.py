"""Live against transformers (skipped without torch): a model trained 5 steps from a transformers Llama, exported, gives transformers the same logits."""


import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: the live transformers comparison is skipped "
                                            "(the committed fixtures in tests/fixtures/hf cover the fast tests)")
transformers = pytest.importorskip("transformers", reason="transformers is not installed: live comparison skipped")

from spmd.interchange import load_pretrained  # noqa: E402
from trainers import load_model, override, recipe, train  # noqa: E402

pytestmark = pytest.mark.slow


def hf_logits(folder, tokens):
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()


def test_train_five_steps_export_and_transformers_agree(tmp_path):
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_parameters={
                                       "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 32})
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "llama")
    tokens = np.random.default_rng(0).integers(0, 256, (2, 16))
    before = load_pretrained(str(tmp_path / "llama"))
    np.testing.assert_allclose(np.asarray(jax.jit(lambda m, x: m(x))(before, tokens)),
                               hf_logits(tmp_path / "llama", tokens), rtol=0, atol=1e-4)
    run = override(recipe("gpt-small", tiny=True), [
        f"checkpoint.init_from=hf:{tmp_path / 'llama'}", f"run.run_dir={tmp_path / 'run'}", "run.steps=5",
        "lr.total_steps=0", "lr.warmup_steps=0", "mesh.axes=data=2,fsdp=2,tensor=2", "rules=fsdp_tp",
        "checkpoint.every_steps=5", "run.eval_every=1000"])
    train(run)
    from trainers.launch.models import export_main

    assert export_main([str(tmp_path / "run"), "--to", "hf", str(tmp_path / "out")]) == 0
    ours = np.asarray(jax.jit(lambda m, x: m(x))(load_model(str(tmp_path / "run")), tokens))
    theirs = hf_logits(tmp_path / "out", tokens)
    assert np.abs(ours - theirs).max() <= 1e-4 * np.abs(theirs).max()
    assert np.abs(ours - hf_logits(tmp_path / "llama", tokens)).max() > 1e-3  # the 5 steps changed the model
    tokenized = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").generate(
        torch.tensor(tokens[:, :8]), do_sample=False, max_new_tokens=16, attention_mask=torch.ones((2, 8), dtype=torch.long))
    from spmd.models import generate

    np.testing.assert_array_equal(np.asarray(generate(load_model(f"hf:{tmp_path / 'out'}"), tokens[:, :8], 16)),
                                  tokenized[:, 8:].numpy())
