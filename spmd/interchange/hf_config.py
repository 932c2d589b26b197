"""``config.json`` <-> ``GPTConfig``: the published layout (``rope_theta``, ``rope_scaling``, ``torch_dtype``)
and the newer one (``rope_parameters``, ``dtype``) are both read; the newer one is written.

What a checkpoint fixes (dims, heads, RoPE, norm epsilon, biases, tying, experts) is
:data:`ARCH_FIELDS`; a caller's ``GPTConfig`` may change every other field (compute dtype, remat,
attention implementation, ...). Anything the model cannot run is refused with the field and value.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from spmd.interchange.families import Family, family_for, family_of
from spmd.models.gpt import GPTConfig

ARCH_FIELDS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff", "rope_theta",
               "rope_scaling", "rope_factor", "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_length",
               "norm_eps", "qkv_bias", "tie_embeddings", "tied_head_scale", "max_length", "n_experts",
               "experts_per_token", "moe_every", "moe_d_ff", "router", "n_shared_experts")
DTYPES = ("float32", "bfloat16", "float16")


def read_config(path: str) -> dict[str, Any]:
    """The parsed ``config.json`` of the checkpoint folder ``path``."""
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        raise ValueError(f"{path!r} has no config.json: give a Hugging Face checkpoint folder "
                         "(config.json and *.safetensors)")
    try:
        with open(file) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{file} is not valid JSON: {e}") from None


def _rope(hf: dict[str, Any]) -> dict[str, Any]:
    """GPTConfig RoPE fields from ``rope_parameters`` (new) or ``rope_theta`` + ``rope_scaling`` (published)."""
    params = dict(hf.get("rope_parameters") or {})
    theta = params.get("rope_theta", hf.get("rope_theta", 10_000.0))
    scaling = params if params.get("rope_type", "default") != "default" else dict(hf.get("rope_scaling") or {})
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return {"rope_theta": float(theta)}
    if kind != "llama3":
        raise ValueError(f"config.json RoPE type {kind!r} is not supported; supported: 'default', 'llama3'")
    return {"rope_theta": float(theta), "rope_scaling": "llama3", "rope_factor": float(scaling["factor"]),
            "rope_low_freq_factor": float(scaling["low_freq_factor"]),
            "rope_high_freq_factor": float(scaling["high_freq_factor"]),
            "rope_original_length": int(scaling["original_max_position_embeddings"])}


def checkpoint_dtype(hf: dict[str, Any]) -> str:
    """The dtype the checkpoint's tensors were written in (``dtype`` or ``torch_dtype``; float32 if absent)."""
    dtype = hf.get("dtype", hf.get("torch_dtype")) or "float32"
    if dtype not in DTYPES:
        raise ValueError(f"config.json dtype {dtype!r} is not one of {DTYPES}")
    return dtype


def arch_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """The :data:`ARCH_FIELDS` of a ``GPTConfig`` that runs the checkpoint described by ``hf``."""
    family = family_of(hf)
    checkpoint_dtype(hf)
    for key, want in (("hidden_act", "silu"), ("attention_bias", family.qkv_bias), ("mlp_bias", False)):
        if key in hf and hf[key] != want and not (key == "attention_bias" and family.qkv_bias):
            raise ValueError(f"config.json {key}={hf[key]!r} is not supported for {family.model_type} (needs {want!r})")
    try:
        heads = int(hf["num_attention_heads"])
        window = hf.get("sliding_window") if hf.get("use_sliding_window", True) else None
        fields = dict(
            vocab_size=int(hf["vocab_size"]), d_model=int(hf["hidden_size"]), n_layers=int(hf["num_hidden_layers"]),
            n_heads=heads, n_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or hf["hidden_size"] // heads), d_ff=int(hf["intermediate_size"]),
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)), qkv_bias=family.qkv_bias,
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)), tied_head_scale=False,
            max_length=int(window or 0), **_rope(hf))
    except KeyError as e:
        raise ValueError(f"config.json has no {e.args[0]!r}, which a {family.model_type} checkpoint needs") from None
    if family.moe:
        fields.update(n_experts=int(hf["num_local_experts"]), experts_per_token=int(hf["num_experts_per_tok"]),
                      moe_every=1, moe_d_ff=fields["d_ff"], router="softmax", n_shared_experts=0)
    return fields


def contradictions(hf: dict[str, Any], settings: dict[str, Any]) -> list[str]:
    """``model.KEY=value (the checkpoint has ...)`` for each of ``settings`` (GPTConfig field -> value)
    in :data:`ARCH_FIELDS` that the checkpoint ``hf`` fixes to another value."""
    fields, default = arch_fields(hf), GPTConfig()
    return [f"model.{k}={v!r} (the checkpoint has {fields.get(k, getattr(default, k))!r})"
            for k, v in settings.items() if k in ARCH_FIELDS and v != fields.get(k, getattr(default, k))]


def gpt_config(hf: dict[str, Any], base: GPTConfig | None = None, *, strict: bool = True) -> GPTConfig:
    """A ``GPTConfig`` for the checkpoint ``hf``: its :data:`ARCH_FIELDS`, everything else from ``base``.

    ``strict``: a field of ``base`` in :data:`ARCH_FIELDS` that differs both from the default and
    from the checkpoint is an error naming it (a run cannot change the shapes it imports); else
    the checkpoint's value replaces it."""
    fields = arch_fields(hf)
    base = base or GPTConfig()
    default = GPTConfig()
    changed = {k: getattr(base, k) for k in ARCH_FIELDS if getattr(base, k) != getattr(default, k)}
    wrong = contradictions(hf, changed) if strict else []
    if wrong:
        raise ValueError(f"the checkpoint's config.json fixes these model settings: {', '.join(wrong)}; "
                         "leave them unset")
    extra = {}
    if family_of(hf).moe:  # Hugging Face adds its aux loss (k times ours) only with output_router_logits
        coef = float(hf.get("router_aux_loss_coef", 0.0)) if hf.get("output_router_logits") else 0.0
        extra = dict(aux_loss_weight=coef * fields["experts_per_token"], router_z_loss_weight=0.0, capacity_factor=0.0)
    return dataclasses.replace(base, **{**fields, **extra})


def to_hf_config(cfg: GPTConfig, dtype: str = "float32", family: Family | None = None) -> dict[str, Any]:
    """The ``config.json`` of ``cfg`` exported as ``family`` (default :func:`family_for`) in ``dtype``."""
    family = family or family_for(cfg)
    if cfg.n_experts and (cfg.moe_every != 1 or cfg.n_shared_experts or cfg.router != "softmax"):
        raise ValueError(f"only Mixtral-style MoE exports (moe_every=1, n_shared_experts=0, router='softmax'), got "
                         f"moe_every={cfg.moe_every}, n_shared_experts={cfg.n_shared_experts}, router={cfg.router!r}")
    if cfg.n_experts and cfg.qkv_bias:
        raise ValueError("a model with both experts and q/k/v biases has no Hugging Face family here")
    if dtype not in DTYPES:
        raise ValueError(f"export dtype {dtype!r} is not one of {DTYPES}")
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling == "llama3":
        rope.update(rope_type="llama3", factor=cfg.rope_factor, low_freq_factor=cfg.rope_low_freq_factor,
                    high_freq_factor=cfg.rope_high_freq_factor,
                    original_max_position_embeddings=cfg.rope_original_length)
    hf: dict[str, Any] = dict(
        architectures=[family.architecture], model_type=family.model_type, vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model, intermediate_size=cfg.expert_ff if cfg.n_experts else cfg.ff,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.k, hidden_act="silu", rms_norm_eps=cfg.norm_eps, rope_parameters=rope,
        # a scaled tied head is written as an untied lm_head (the scale folded in)
        tie_word_embeddings=cfg.tie_embeddings and not cfg.tied_head_scale,
        max_position_embeddings=cfg.max_length or 4096, dtype=dtype,
        sliding_window=cfg.max_length or None if family.model_type == "mistral" else None,
        bos_token_id=None, eos_token_id=None, pad_token_id=None, attention_dropout=0.0, use_cache=True)
    if family.model_type == "llama":
        hf.update(attention_bias=False, mlp_bias=False)
    if family.model_type == "qwen2":
        hf.update(use_sliding_window=False)
    if family.moe:
        hf.update(num_local_experts=cfg.n_experts, num_experts_per_tok=cfg.experts_per_token,
                  output_router_logits=False, router_aux_loss_coef=cfg.aux_loss_weight / cfg.experts_per_token)
    return hf
