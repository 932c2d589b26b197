"""Rematerialisation policies by name: what a block keeps for its backward pass, and what it recomputes.

``wrap(body, policy)`` returns ``body`` under ``jax.checkpoint`` with the named policy; a
:class:`spmd.Stack` applies it to each block of its scan. Policies:

- ``none``: keep every intermediate the backward pass needs (no recompute);
- ``full``: keep only the block's input; recompute the whole block in the backward pass.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

POLICIES = ("none", "full")


def resolve(remat: bool | str) -> str:
    """A policy name from a Stack's ``remat`` argument (``False`` -> ``none``, ``True`` -> ``full``)."""
    if isinstance(remat, bool):
        return "full" if remat else "none"
    if remat not in POLICIES:
        raise ValueError(f"remat policy {remat!r} is not one of {POLICIES}")
    return remat


def wrap(body: Callable, policy: bool | str) -> Callable:
    """``body`` rematerialised under ``policy``."""
    policy = resolve(policy)
    if policy == "none":
        return body
    return jax.checkpoint(body, prevent_cse=False)
