"""The order a :class:`spmd.Stack` stores its layers in: natural, or an interleaved pipeline's chunk order.

With S stages and V virtual stages the L layers form C = S*V chunks of L/C consecutive layers;
chunk c runs on device ``c % S`` (ZB-V's placement ``"v"``: chunks s and 2S-1-s on device s). In
chunk order ``W[layers_pipe, ...]`` holds device s's chunks (``s, s+S, ...``) as its contiguous block, so ``layers -> pipe`` puts every chunk on the
device that runs it and the pipeline reads the stack in place: no parameter or gradient crosses
``pipe`` per step. Changing the order (checkpoints, the plain scan) is one all-to-all over ``pipe``.
The order travels with the stack's variables as their ``layer_order`` metadata. See docs/pipelines.md.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

KEY = "layer_order"  # nnx.Variable metadata: (stages, virtual) of the chunk order, + "v" for a V


@dataclasses.dataclass(frozen=True)
class LayerOrder:
    """Chunk order of ``stages`` x ``virtual`` with ``placement`` ``"loop"`` (device s: chunks s, s+S, ...)
    or ``"v"`` (virtual = 2, device s: chunks s, 2S-1-s); ``LayerOrder()`` (or any order with one of
    ``stages``, ``virtual`` 1) is natural."""

    stages: int = 1
    virtual: int = 1
    placement: str = "loop"

    def __post_init__(self) -> None:
        for name in ("stages", "virtual"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"LayerOrder.{name} must be an integer >= 1, got {value!r}")
        if self.placement not in ("loop", "v") or (self.placement == "v" and self.virtual not in (1, 2)):
            raise ValueError(f"LayerOrder placement {self.placement!r} with virtual={self.virtual}: valid are "
                             f"'loop' (any virtual) and 'v' (virtual = 2)")
        if self.stages == 1 or self.virtual == 1:  # one chunk per device: chunk order is natural order
            object.__setattr__(self, "stages", 1)
            object.__setattr__(self, "virtual", 1)
            object.__setattr__(self, "placement", "loop")

    @property
    def natural(self) -> bool:
        return self.stages == 1

    def check(self, n_layers: int) -> None:
        """ValueError unless ``n_layers`` splits into S*V equal chunks."""
        if n_layers % (self.stages * self.virtual):
            raise ValueError(f"{n_layers} layers do not split into S*V = {self.stages}*{self.virtual} = "
                             f"{self.stages * self.virtual} equal chunks")

    def natural_index(self, n_layers: int) -> np.ndarray:
        """Stored position i holds natural layer ``natural_index(n)[i]``."""
        return np.asarray(self.to_stored(np.arange(n_layers)))

    def to_natural(self, tree: Any) -> Any:
        """Every leaf ``[L, ...]`` from this order to natural order (``[S, V, Lc] -> [V, S, Lc]``; a V
        also reverses the second arm)."""
        if self.placement == "v":
            return _v_blocks(tree, self.stages, to_natural=True)
        return _swap_blocks(tree, self.stages, self.virtual)

    def to_stored(self, tree: Any) -> Any:
        """Every leaf ``[L, ...]`` from natural order to this order (``[V, S, Lc] -> [S, V, Lc]``)."""
        if self.placement == "v":
            return _v_blocks(tree, self.stages, to_natural=False)
        return _swap_blocks(tree, self.virtual, self.stages)

    @property
    def key(self) -> tuple:
        """The metadata value recording this order: ``(stages, virtual)``, plus ``"v"`` for a V."""
        return (self.stages, self.virtual) + (("v",) if self.placement == "v" else ())

    def convert(self, tree: Any, to: LayerOrder) -> Any:
        """Every leaf ``[L, ...]`` from this order to the order ``to`` (no work when they are equal)."""
        return tree if to == self else to.to_stored(self.to_natural(tree))


NATURAL = LayerOrder()


def _swap_blocks(tree: Any, outer: int, inner: int) -> Any:
    """Each leaf ``[outer*inner*Lc, ...]`` viewed as ``[outer, inner, Lc]`` -> ``[inner, outer, Lc]``, flattened."""
    if outer == 1 or inner == 1:
        return tree

    def one(a):
        if a.shape[0] % (outer * inner):
            raise ValueError(f"{a.shape[0]} layers do not split into {outer}*{inner} = {outer * inner} equal chunks")
        lc = a.shape[0] // (outer * inner)
        a = a.reshape(outer, inner, lc, *a.shape[1:]).swapaxes(0, 1)
        return a.reshape(outer * inner * lc, *a.shape[3:])

    return jax.tree.map(one, tree)


def _v_blocks(tree: Any, S: int, to_natural: bool) -> Any:
    """Each leaf ``[2*S*Lc, ...]``: natural ``[2, S, Lc]`` (arm, index) <-> stored ``[S, 2, Lc]`` with
    device s holding chunks s and 2S-1-s, i.e. the second arm reversed."""

    def one(a):
        if a.shape[0] % (2 * S):
            raise ValueError(f"{a.shape[0]} layers do not split into {S}*2 = {2 * S} equal chunks")
        xp = np if isinstance(a, np.ndarray) else jnp
        lc = a.shape[0] // (2 * S)
        if to_natural:
            a = a.reshape(S, 2, lc, *a.shape[1:]).swapaxes(0, 1)
            return xp.concatenate([a[0], a[1, ::-1]]).reshape(2 * S * lc, *a.shape[3:])
        a = a.reshape(2, S, lc, *a.shape[1:])
        a = xp.stack([a[0], a[1, ::-1]], axis=1)
        return a.reshape(2 * S * lc, *a.shape[3:])

    return jax.tree.map(one, tree)


def _variables(tree: Any) -> list[nnx.Variable]:
    return [v for v in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, nnx.Variable))
            if isinstance(v, nnx.Variable)]


def order_of(tree: Any) -> LayerOrder:
    """The order of a stack's variables (an ``nnx.State`` or module) from their metadata; plain arrays
    are natural. ValueError when the variables disagree."""
    if isinstance(tree, nnx.Module):
        tree = nnx.state(tree)
    found = {v.get_metadata().get(KEY, (1, 1)) for v in _variables(tree)}
    if len(found) > 1:
        raise ValueError(f"the stack's variables are stored in different layer orders {sorted(found)}; "
                         "reorder the whole stack with Stack.reorder")
    return LayerOrder(*found.pop()) if found else NATURAL


def mark(module: nnx.Module, order: LayerOrder) -> None:
    """Record ``order`` in the metadata of every variable of ``module`` (values untouched)."""
    for _, node in nnx.iter_graph(module):
        if isinstance(node, nnx.Variable):
            if order.natural:
                if node.has_metadata(KEY):
                    node.del_metadata(KEY)
            else:
                node.set_metadata(**{KEY: order.key})
