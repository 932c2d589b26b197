"""Parameter counts and training FLOPs of the GPT, for MFU.

Training FLOPs per token follow the PaLM paper (Chowdhery et al. 2022, appendix B):
``6 * N_matmul + 12 * n_layers * H * K * L`` where N_matmul counts the parameters used in matmuls
(every weight except the embedding lookup and norm scales; the output head counts even when tied,
since its matmul still runs) and the second term is attention's QK^T and AV matmuls (forward 2x,
backward 4x, causal masking not subtracted, as in PaLM and MaxText). 6 = 2 (multiply-add) x 3
(forward + two backward matmuls).
"""

from __future__ import annotations

from spmd.models.gpt import GPTConfig


def block_params(cfg: GPTConfig) -> int:
    d, h, g, k, f = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.k, cfg.ff
    attn = d * h * k + 2 * d * g * k + h * k * d
    mlp = 3 * d * f
    return attn + mlp + 2 * d


def param_count(cfg: GPTConfig, *, embedding: bool = True) -> int:
    """Exact number of parameters (``embedding=False`` leaves out the token-embedding table)."""
    n = cfg.n_layers * block_params(cfg) + cfg.d_model  # blocks + final norm
    if not cfg.tie_embeddings:
        n += cfg.d_model * cfg.vocab_size
    if embedding:
        n += cfg.vocab_size * cfg.d_model
    return n


def matmul_params(cfg: GPTConfig) -> int:
    """Parameters that take part in a matmul per token (norm scales and the lookup excluded)."""
    per_block = block_params(cfg) - 2 * cfg.d_model
    return cfg.n_layers * per_block + cfg.d_model * cfg.vocab_size


def flops_per_token(cfg: GPTConfig, seq_len: int) -> float:
    """Training (forward + backward) FLOPs per token at this sequence length."""
    attention = 12 * cfg.n_layers * cfg.n_heads * cfg.k * seq_len
    return 6.0 * matmul_params(cfg) + attention


def flops_per_step(cfg: GPTConfig, global_batch: int, seq_len: int) -> float:
    """Training FLOPs of one step over the global batch."""
    return flops_per_token(cfg, seq_len) * global_batch * seq_len
