"""LoRA against PEFT on the tiny llama fixture: forward, every adapter gradient, PEFT loading our export, our
import of PEFT's adapter, and merging (fixtures: tests/fixtures/peft/make_fixtures.py, peft not needed here)."""

from __future__ import annotations

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from spmd.interchange import load_pretrained
from spmd.models.lora import LoRASpec
from trainers import lora

HERE = os.path.dirname(os.path.abspath(__file__))
FIX = os.path.join(HERE, "..", "fixtures", "peft")
BASE = os.path.join(HERE, "..", "fixtures", "hf", "llama")
TOL = 1e-5


def assert_logits(ours, theirs) -> None:
    """Logits equal to TOL of the largest one: two f32 programs (torch, XLA) sum in their own orders. Our
    export's logits against PEFT's: 1.26e-5 apart at most (3.0e-6 of the largest) on jax 0.12, 6.6e-6 on 0.10."""
    theirs = np.asarray(theirs)
    np.testing.assert_allclose(np.asarray(ours), theirs, atol=TOL * np.abs(theirs).max(), rtol=0)


@functools.cache
def reference() -> dict:
    return dict(np.load(os.path.join(FIX, "reference.npz")))


def adapted_model(peft: str | None = None):
    """The tiny llama with rank-4 alpha-8 adapters on every projection (PEFT's from ``peft`` if given)."""
    model = lora.load_adapted(BASE, LoRASpec(4, 8.0), peft=peft)
    return model, nnx.to_pure_dict(nnx.state(model, nnx.Param))


def with_params(model, params):
    graphdef, _ = nnx.split(model)
    return nnx.merge(graphdef, params)


@nnx.jit
def logits_of(model, tokens):
    return model(tokens)


def loss_of(model, tokens):
    return model.loss(tokens[:, :-1], tokens[:, 1:])[0]


def test_forward_and_adapter_gradients_equal_peft():
    model, params = adapted_model(os.path.join(FIX, "theirs"))
    ref = reference()
    tokens = jnp.asarray(ref["tokens"], jnp.int32)
    assert_logits(logits_of(model, tokens), ref["logits"])
    base, adapters = lora.split(params)

    def loss(adapters):
        return loss_of(with_params(model, lora.combine(base, adapters)), tokens)

    value, grads = jax.jit(jax.value_and_grad(loss))(adapters)
    np.testing.assert_allclose(value, ref["loss"], atol=TOL, rtol=0)
    ours = lora.peft_tensors(grads)
    theirs = {k[len("grad/"):]: v for k, v in ref.items() if k.startswith("grad/")}
    assert set(ours) == set(theirs) and len(ours) == 2 * 7 * 2
    for name, g in theirs.items():
        assert np.abs(g).max() > 1e-3, name  # no trivially zero gradient
        np.testing.assert_allclose(ours[name], g, atol=TOL, rtol=0, err_msg=name)
    # negative control: the adapters matter (without them the logits are far from PEFT's)
    plain = load_pretrained(BASE)
    assert np.abs(np.asarray(logits_of(plain, tokens)) - ref["logits"]).max() > 1e-2


def test_peft_loads_our_export(tmp_path):
    from tests.fixtures.peft.make_fixtures import our_adapters

    model, params = adapted_model()
    base, adapters = lora.split(params)
    params = lora.combine(base, our_adapters(adapters))
    lora.save_peft(str(tmp_path), model.lora, params)
    # what we write now is what PEFT loaded when the fixtures were made
    ours, committed = load_file(tmp_path / lora.ADAPTER_WEIGHTS), load_file(os.path.join(FIX, "ours", lora.ADAPTER_WEIGHTS))
    assert set(ours) == set(committed)
    for k in ours:
        np.testing.assert_array_equal(ours[k], committed[k], err_msg=k)
    with open(tmp_path / lora.ADAPTER_CONFIG) as f, open(os.path.join(FIX, "ours", lora.ADAPTER_CONFIG)) as g:
        assert json.load(f) == json.load(g)
    tokens = jnp.asarray(reference()["tokens"], jnp.int32)
    logits = logits_of(with_params(model, params), tokens)
    assert_logits(logits, reference()["ours_logits"])
    # our import of our export is the identity
    back, _ = adapted_model(str(tmp_path))
    np.testing.assert_allclose(logits_of(back, tokens), logits, atol=0, rtol=0)


def test_merged_weights_compute_the_adapted_model():
    model, params = adapted_model(os.path.join(FIX, "theirs"))
    tokens = jnp.asarray(reference()["tokens"], jnp.int32)
    plain = load_pretrained(BASE)
    merged = with_params(plain, lora.merged(params, model.lora))
    assert_logits(logits_of(merged, tokens), reference()["logits"])


def test_bad_peft_settings_are_named(tmp_path):
    with open(os.path.join(FIX, "theirs", lora.ADAPTER_CONFIG)) as f:
        cfg = json.load(f)
    (tmp_path / lora.ADAPTER_CONFIG).write_text(json.dumps({**cfg, "use_dora": True}))
    with pytest.raises(ValueError, match="use_dora"):
        lora.read_peft_config(str(tmp_path))
    with pytest.raises(ValueError, match="no adapter_model.safetensors"):
        lora.peft_dir(f"peft:{tmp_path}")
