"""Rematerialisation policies by name: what a block keeps for its backward pass, and what it recomputes.

``wrap(body, policy)`` returns ``body`` under ``jax.checkpoint`` with the named policy; a
:class:`spmd.Stack` applies it per block. Policies: ``none``, ``save_all_but_gathered``,
``save_dots``, ``offload``, ``full``, ``save_block_input`` (an alias of ``full``). In a loop (a scanned
Stack) ``none`` keeps the matmul outputs and laid-out values and redoes the elementwise ops
(:func:`wrap`). What each keeps, recomputes and measures: docs/memory.md.
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
# also redone, never kept (free to redo; their inputs are kept instead where needed): reshapes and
# concatenation (attention's fused q/k/v weight reshapes and joins the w_q and w_kv shards before its
# one gather; keeping the joined weight would keep a second copy of the layer's weights)
_NOT_KEPT = (*_CONSTRAINTS, "concatenate", "reshape")


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
    return prim.name not in _NOT_KEPT


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


# what ``none`` keeps in a loop besides matmul outputs and constrained values: whatever communicates (a
# collective, or a manual region that may run one: redoing it would add its collectives to the backward loop)
_COMMUNICATES = ("psum", "pmax", "pmin", "ppermute", "pbroadcast", "all_to_all", "ragged_all_to_all", "all_gather",
                 "all_gather_invariant", "reduce_scatter", "psum_invariant", "psend", "precv", "shard_map")


def _loop_keeps(prim: Any, *_: Any, **__: Any) -> bool:
    """``none`` in a loop: every matmul's output, every constrained value (the gathered weights, the residual
    stream, the norms' outputs) and every collective's are kept; the rest is redone (no matmul, no collective)."""
    return prim.name in ("dot_general", *_CONSTRAINTS, *_COMMUNICATES)


def wrap(body: Callable, policy: bool | str, *, loop: bool = False) -> Callable:
    """``body`` rematerialised under ``policy`` (``body`` itself for ``none``).

    ``loop``: ``body`` is a scan's body (a scanned Stack). There ``none`` keeps what :func:`_loop_keeps` names and
    redoes the elementwise ops (activations, softmax, norm statistics) in the backward loop: a kept value is
    written into a stacked ``[layers, ...]`` buffer (zero-filled and copied first) and read back, which costs
    more than redoing it (docs/performance.md); no matmul is redone, no weight gathered again."""
    policy = check(policy)
    if policy == "none":
        return jax.checkpoint(body, prevent_cse=False, policy=_loop_keeps) if loop else body
    # prevent_cse=False: inside a scan the loop already keeps XLA from merging the recompute away
    return jax.checkpoint(body, prevent_cse=False, policy=jax_policy(policy))
