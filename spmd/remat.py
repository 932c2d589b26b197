"""Rematerialisation policies by name: what a block keeps for its backward pass, and what it recomputes.

``wrap(body, policy)`` returns ``body`` under ``jax.checkpoint`` with the named policy; a
:class:`spmd.Stack` applies it to the body of its scan, so a policy holds per block. The
checkpoint's own inputs are always kept: the block input ``x[B, L, D]`` (the scan carry) and the
layer's parameters as stored (under FSDP the shards ``W[D_fsdp, F]``, no copy). A policy decides
which values computed *inside* the block are kept as well; whatever the backward pass reads and
was not kept is recomputed from those inputs. Per block and device (``B L`` tokens):

``none``
    no checkpoint: every intermediate the backward pass reads is kept (projections, attention
    probabilities, MLP hidden, norm statistics) **and each layer's weights as the block used
    them**: under FSDP the all-gathered ``W[D, F]`` of every layer, under any layout a copy of
    every layer's weights in the compute dtype. Recomputes nothing; weights gathered once.
``save_all_but_gathered``
    everything ``none`` keeps except what a sharding constraint produced: the weights as laid out
    for compute (``spmd.models.layers.weight``; under FSDP the all-gathered ``W[D, F]``). Recomputes
    no matmul; the backward pass re-gathers each layer's weights (FSDP) or re-reads them. With a
    compute dtype other than the parameters' (bf16) the cast that precedes the layout is kept
    instead: a ``1/N`` shard under FSDP, a bf16 copy of the weights under a replicated layout
    (which ``none`` keeps too). An activation's constraint is recomputed from its kept input.
``save_dots``
    the outputs of the matmuls without dot batch dims -- the projections ``x @ W`` (q, k, v, the
    attention output, gate, up, down: ``(H + 2 G) K + 2 D + 2 F`` values per token with the tensor
    dims unsplit) -- and nothing else. Recomputes the elementwise work (norms, RoPE, softmax, SiLU)
    and attention's score and value matmuls (``Q K^T``, ``P V``: dot batch dims ``[B, heads]``,
    the ``L^2`` term, never kept); re-gathers the weights; no weight matmul is recomputed.
``offload``
    what ``save_dots`` keeps, copied to host memory (``pinned_host``) in the forward pass and back
    in the backward pass: on the device about what ``full`` keeps plus the copies in flight;
    recompute as ``save_dots``, plus the host transfers. jax moves the values only on TPU and GPU
    (not measured here: no GPU); the CPU backend lowers the transfers away, so there it runs as
    ``save_dots`` (same numbers, same memory).
``full``
    nothing computed inside the block: the block input only. Recomputes the block's forward pass
    in the backward but its last matmul (``w_down``, whose output the backward never reads): about
    +1/3 of the blocks' training FLOPs; weights re-gathered.
``save_block_input``
    the same policy as ``full`` (an alias): a Stack block's only activation input is the block
    input, so "keep nothing inside the block" and "keep the block input" are one policy here.

So device memory for activations orders ``none >= save_all_but_gathered > save_dots > offload ~
full``, and recompute the reverse. Under FSDP the weight a block uses is a sharding constraint's
output, never a matmul's, so **no policy but** ``none`` **keeps the gathered weights**
(``tests/test_remat.py`` checks the saved residuals and the compiled temp bytes).

Measured (``benchmarks/remat.py``: GPT d_model 128, 4 layers, batch 16 x 128, f32, fsdp8, donated
train step, CPU): temp bytes 1.00 / 0.89 / 0.43 / 0.43 / 0.28 x ``none`` and executed matmul FLOPs
1.00 / 1.00 / 1.04 / 1.04 / 1.25 x ``none`` for ``none`` / ``save_all_but_gathered`` /
``save_dots`` / ``offload`` (as ``save_dots`` on CPU) / ``full``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

POLICIES = ("none", "save_all_but_gathered", "save_dots", "offload", "full", "save_block_input")
ALIASES = {"save_block_input": "full"}
HOST = "pinned_host"  # the memory space ``offload`` moves kept values to
OFFLOADING_PLATFORMS = ("tpu", "gpu")  # where jax lowers the host transfers (elsewhere they are no-ops)
_CONSTRAINTS = ("sharding_constraint", "reshard")  # how a weight is laid out for compute (Auto / Explicit)


def resolve(remat: bool | str) -> str:
    """A policy name from a Stack's ``remat`` argument (``False`` -> ``none``, ``True`` -> ``full``)."""
    if isinstance(remat, bool):
        return "full" if remat else "none"
    if remat not in POLICIES:
        raise ValueError(f"remat policy {remat!r} is not one of {', '.join(POLICIES)} (or True / False)")
    return remat


def check(policy: bool | str, device: jax.Device | None = None) -> str:
    """``resolve(policy)``; for ``offload``, also that ``device`` (default: the first) has host memory."""
    policy = resolve(policy)
    if policy == "offload":
        device = device or jax.devices()[0]
        kinds = sorted(m.kind for m in device.addressable_memories())
        if HOST not in kinds:
            raise ValueError(f"remat policy 'offload' moves kept values to {HOST!r} memory, which the "
                             f"{device.platform} backend ({device.device_kind}) does not have (its memories: "
                             f"{', '.join(kinds)}); use 'save_dots' or 'full'")
    return policy


def offloads(device: jax.Device | None = None) -> bool:
    """Whether ``offload`` really moves values to the host on ``device``'s backend (TPU, GPU)."""
    return (device or jax.devices()[0]).platform in OFFLOADING_PLATFORMS


def _all_but_constraints(prim: Any, *_: Any, **__: Any) -> bool:
    return prim.name not in _CONSTRAINTS


def jax_policy(policy: bool | str) -> Callable | None:
    """The ``jax.checkpoint`` policy of a name (None for ``none``: no checkpoint at all)."""
    name = resolve(policy)
    name = ALIASES.get(name, name)
    cp = jax.checkpoint_policies
    return {
        "none": None,
        "save_all_but_gathered": _all_but_constraints,
        "save_dots": cp.dots_with_no_batch_dims_saveable,
        "offload": cp.offload_dot_with_no_batch_dims("device", HOST),
        "full": cp.nothing_saveable,
    }[name]


def wrap(body: Callable, policy: bool | str) -> Callable:
    """``body`` rematerialised under ``policy`` (``body`` itself for ``none``)."""
    policy = check(policy)
    if policy == "none":
        return body
    # prevent_cse=False: inside a scan the loop already keeps XLA from merging the recompute away
    return jax.checkpoint(body, prevent_cse=False, policy=jax_policy(policy))
