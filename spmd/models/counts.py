"""Parameter counts and training FLOPs of the GPT, for MFU.

Training FLOPs per token follow the PaLM paper (Chowdhery et al. 2022, appendix B):
``6 * N_matmul + 12 * n_layers * H * K * L`` where N_matmul counts the parameters used in matmuls
(every weight except the embedding lookup and norm scales; the output head counts even when tied,
since its matmul still runs) and the second term is attention's QK^T and AV matmuls (forward 2x,
backward 4x, causal masking not subtracted, as in PaLM and MaxText). 6 = 2 (multiply-add) x 3
(forward + two backward matmuls). In MoE blocks a token's matmuls use the router, its k experts and
the shared experts (capacity padding and dropped tokens not counted). LoRA and a reference forward
(DPO): :func:`flops_per_token`.
"""

from __future__ import annotations

from spmd.models.gpt import GPTConfig
from spmd.models.lora import LoRASpec


def block_params(cfg: GPTConfig, *, moe: bool = False, active: bool = False) -> int:
    """Parameters of one block (``moe``: an MoE block; ``active``: only the experts one token uses)."""
    d, h, g, k, f = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.k, cfg.ff
    attn = d * h * k + 2 * d * g * k + h * k * d + ((h + 2 * g) * k if cfg.qkv_bias else 0)
    mlp = 3 * d * f
    if moe:
        fe, e = cfg.expert_ff, cfg.n_experts
        mlp = d * e + 3 * d * fe * (cfg.experts_per_token if active else e) + 3 * d * fe * cfg.n_shared_experts
    return attn + mlp + 2 * d


def _blocks(cfg: GPTConfig, *, active: bool = False) -> int:
    n_moe = cfg.n_layers // cfg.moe_every if cfg.n_experts else 0
    return n_moe * block_params(cfg, moe=True, active=active) + (cfg.n_layers - n_moe) * block_params(cfg)


def param_count(cfg: GPTConfig, *, embedding: bool = True) -> int:
    """Exact number of parameters (``embedding=False`` leaves out the token-embedding table)."""
    n = _blocks(cfg) + cfg.d_model  # blocks + final norm
    if not cfg.tie_embeddings:
        n += cfg.d_model * cfg.vocab_size
    if embedding:
        n += cfg.vocab_size * cfg.d_model
    return n


def matmul_params(cfg: GPTConfig) -> int:
    """Parameters that take part in a matmul per token (norm scales and the lookup excluded)."""
    return _blocks(cfg, active=True) - cfg.n_layers * 2 * cfg.d_model + cfg.d_model * cfg.vocab_size


def adapter_params(cfg: GPTConfig, lora: LoRASpec) -> int:
    """Parameters of ``lora``'s adapters (``r x (d_in + d_out)`` per targeted projection): on the attention of
    every block, on the MLP of the dense blocks (an MoE block's experts carry none)."""
    d, h, g, k, f = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.k, cfg.ff
    sides = {"attn/q_proj": d + h * k, "attn/k_proj": d + g * k, "attn/v_proj": d + g * k, "attn/o_proj": h * k + d,
             "mlp/gate_proj": d + f, "mlp/up_proj": d + f, "mlp/down_proj": f + d}
    n_moe = cfg.n_layers // cfg.moe_every if cfg.n_experts else 0
    per_layer = {part: sum(n for p, n in sides.items() if p.startswith(part) and lora.targeted(p)) for part in ("attn", "mlp")}
    return lora.rank * (cfg.n_layers * per_layer["attn"] + (cfg.n_layers - n_moe) * per_layer["mlp"])


def flops_per_token(cfg: GPTConfig, seq_len: int, *, lora: LoRASpec | None = None, reference: bool = False) -> float:
    """Training (forward + backward) FLOPs per token at this sequence length. ``lora``: the base weights are
    frozen, so their backward computes the input gradient only (4 per weight instead of 6), and each adapter
    parameter costs 6. ``reference``: one more forward of the base without gradients (DPO's reference
    log-probabilities: 2 per weight and attention's forward)."""
    forward = 4.0 * cfg.n_layers * cfg.n_heads * cfg.k * seq_len  # attention's forward; the backward is twice it
    n = matmul_params(cfg)
    weights = (4.0 * n + 6.0 * adapter_params(cfg, lora)) if lora is not None else 6.0 * n
    if reference:
        return weights + 2.0 * n + 4 * forward
    return weights + 3 * forward


def flops_per_step(cfg: GPTConfig, global_batch: int, seq_len: int, *, lora: LoRASpec | None = None,
                   reference: bool = False) -> float:
    """Training FLOPs of one step over the global batch (``lora``, ``reference``: :func:`flops_per_token`)."""
    return flops_per_token(cfg, seq_len, lora=lora, reference=reference) * global_batch * seq_len
