"""Hugging Face model families as data: config fields and tensor names -> ``GPTConfig`` and parameter paths.

A :class:`Family` is a table of :class:`Tensor` rows; each row says which Hugging Face tensor(s)
make one parameter and how the dims move: ``ours="l d h k"`` from ``theirs="(h k) d"`` means the
parameter ``w_q[layers, D, H, K]`` stacks, over layers, the tensor ``q_proj.weight[(H K), D]``
transposed. A dim of ``ours`` absent from ``theirs`` picks the tensor: ``l`` (layer) and ``e``
(expert) fill ``{l}`` / ``{e}`` in the name, a dim listed in ``choices`` fills its name (``w_kv``'s
``c`` in ``{c}_proj``: k, then v). Both RoPE layouts are rotate-half (pairs ``(i, i + K/2)``), so no
row permutes q or k. Adding a family is a new table (:data:`FAMILIES`), not new loading code.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from spmd.models.gpt import GPTConfig


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One parameter (``path``, dims ``ours``) made of the Hugging Face tensor(s) ``name`` (dims ``theirs``)."""

    path: str
    name: str
    ours: str
    theirs: str
    choices: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def source_dims(self) -> list[str]:
        """Dims of ``ours`` that pick a tensor rather than index into one (``l``, ``e``, choice dims)."""
        inside = set(re.findall(r"\w+", self.theirs))
        return [d for d in self.ours.split() if d not in inside]

    def names(self, picks: dict[str, int]) -> str:
        """The Hugging Face name for one pick of each source dim (``{"l": 3, "c": 1}``)."""
        choices = dict(self.choices)
        return self.name.format(**{d: choices[d][i] if d in choices else i for d, i in picks.items()})


@dataclasses.dataclass(frozen=True)
class Family:
    """A Hugging Face architecture: its ``model_type``, class name, tensors and the features it uses."""

    model_type: str
    architecture: str
    tensors: tuple[Tensor, ...]
    qkv_bias: bool = False
    moe: bool = False
    ignored: tuple[str, ...] = (r".*rotary_emb\.inv_freq",)  # tensors a checkpoint may hold that carry no weights


_L = "model.layers.{l}."
_ATTENTION = (
    Tensor("embed", "model.embed_tokens.weight", "v d", "v d"),
    Tensor("final_norm/scale", "model.norm.weight", "d", "d"),
    Tensor("head", "lm_head.weight", "d v", "v d"),
    Tensor("blocks/block/attn_norm/scale", _L + "input_layernorm.weight", "l d", "d"),
    Tensor("blocks/block/mlp_norm/scale", _L + "post_attention_layernorm.weight", "l d", "d"),
    Tensor("blocks/block/attn/w_q", _L + "self_attn.q_proj.weight", "l d h k", "(h k) d"),
    Tensor("blocks/block/attn/w_kv", _L + "self_attn.{c}_proj.weight", "l d g c k", "(g k) d", (("c", ("k", "v")),)),
    Tensor("blocks/block/attn/w_o", _L + "self_attn.o_proj.weight", "l h k d", "d (h k)"),
)
_DENSE = (
    Tensor("blocks/block/mlp/w_gate_up", _L + "mlp.{c}_proj.weight", "l d c f", "f d", (("c", ("gate", "up")),)),
    Tensor("blocks/block/mlp/w_down", _L + "mlp.down_proj.weight", "l f d", "d f"),
)
_BIASES = (
    Tensor("blocks/block/attn/b_q", _L + "self_attn.q_proj.bias", "l h k", "(h k)"),
    Tensor("blocks/block/attn/b_kv", _L + "self_attn.{c}_proj.bias", "l g c k", "(g k)", (("c", ("k", "v")),)),
)
_E = _L + "block_sparse_moe."
_EXPERTS = (
    Tensor("blocks/block/mlp/w_router", _E + "gate.weight", "l d x", "x d"),
    Tensor("blocks/block/mlp/w_gate_up", _E + "experts.{e}.{c}.weight", "l e d c f", "f d", (("c", ("w1", "w3")),)),
    Tensor("blocks/block/mlp/w_down", _E + "experts.{e}.w2.weight", "l e f d", "d f"),
)

FAMILIES: dict[str, Family] = {
    "llama": Family("llama", "LlamaForCausalLM", _ATTENTION + _DENSE),
    "mistral": Family("mistral", "MistralForCausalLM", _ATTENTION + _DENSE),
    "qwen2": Family("qwen2", "Qwen2ForCausalLM", _ATTENTION + _DENSE + _BIASES, qkv_bias=True),
    "mixtral": Family("mixtral", "MixtralForCausalLM", _ATTENTION + _EXPERTS, moe=True),
}


def family_of(hf: dict[str, Any]) -> Family:
    """The family of a ``config.json``, by its ``model_type``; raises naming the known ones."""
    kind = hf.get("model_type")
    if kind not in FAMILIES:
        raise ValueError(f"config.json model_type {kind!r} is not a known family; known: {', '.join(FAMILIES)}")
    return FAMILIES[kind]


def family_for(cfg: GPTConfig) -> Family:
    """The family a ``GPTConfig`` exports as: mixtral (experts), qwen2 (q/k/v biases), mistral (a
    ``max_length``: its sliding window), else llama."""
    if cfg.n_experts:
        return FAMILIES["mixtral"]
    if cfg.qkv_bias:
        return FAMILIES["qwen2"]
    return FAMILIES["mistral"] if cfg.max_length else FAMILIES["llama"]


def tensors_of(family: Family, cfg: GPTConfig) -> tuple[Tensor, ...]:
    """The rows a model of ``cfg`` has: no ``head`` row when the embeddings are tied."""
    return tuple(t for t in family.tensors if not (t.path == "head" and cfg.tie_embeddings))
