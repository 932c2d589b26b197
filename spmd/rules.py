"""Rules: logical dims -> mesh axes, as data.

A rule set holds two tables of (logical dim, mesh axes) pairs, one for parameters and one for
activations; nothing else in the toolkit spells a PartitionSpec. Rule sets per strategy: ``dp``,
``fsdp``, ``tp``, ``dp_tp``, ``fsdp_tp`` (e.g. fsdp: ``W[D_fsdp, F]``, ``x[B_(data,fsdp), L, D]``),
expert-parallel ``dp_ep``, ``fsdp_ep``, ``fsdp_tp_ep`` (``W[E_expert, D, F]``, ``x[B_(data,expert), L, D]``) and
sequence-parallel ``dp_tp_sp``, ``fsdp_tp_sp`` (residual stream ``x[B_data, L_tensor, D]``, Megatron-SP).
Every preset splits activation ``length`` over ``seq`` (context parallelism; nothing when seq=1).
Table and what communicates: docs/sharding.md.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence

from jax.sharding import PartitionSpec as P

from meshes import AXES

# Logical dims models annotate (docs/architecture.md, vocabulary).
LOGICAL_DIMS: tuple[str, ...] = (
    "batch", "length", "embed", "mlp", "heads", "kv_heads", "head_dim", "vocab", "layers", "stage", "expert",
    "residual_length",
)

# A dim a rule set leaves unmapped follows another dim's rule: the residual stream's length is split
# like ``length`` (e.g. over ``seq``) unless the rule set maps it too (sequence parallelism adds ``tensor``).
FOLLOWS: dict[str, str] = {"residual_length": "length"}

Axes = str | tuple[str, ...] | None
Table = tuple[tuple[str, Axes], ...]


class RulesError(ValueError):
    """A rule set, or a use of one, that cannot give a valid sharding."""


def axes_of(axes: Axes) -> tuple[str, ...]:
    """The mesh axes of one rule or PartitionSpec entry as a tuple: None -> (), 'fsdp' -> ('fsdp',)."""
    if axes is None:
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)


def _check_table(table: Table, what: str) -> Table:
    table = tuple((str(k), v if v is None or isinstance(v, str) else tuple(v)) for k, v in table)
    keys = [k for k, _ in table]
    for key in keys:
        if keys.count(key) > 1:
            raise RulesError(f"{what} rules give logical dim {key!r} more than once: {table}")
    for key, axes in table:
        for axis in axes_of(axes):
            if axis not in AXES:
                raise RulesError(
                    f"{what} rule {key!r} -> {axes!r} names unknown mesh axis {axis!r}; valid axes: {', '.join(AXES)}"
                )
        if len(set(axes_of(axes))) != len(axes_of(axes)):
            raise RulesError(f"{what} rule {key!r} -> {axes!r} repeats a mesh axis")
    return table


@dataclasses.dataclass(frozen=True)
class Rules:
    """A named rule set: one table for parameters, one for activations (tuples of (dim, axes))."""

    name: str
    params: Table = ()
    activations: Table = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "params", _check_table(self.params, f"{self.name!r} params"))
        object.__setattr__(self, "activations", _check_table(self.activations, f"{self.name!r} activations"))

    def known_dims(self) -> set[str]:
        return set(LOGICAL_DIMS) | {k for k, _ in self.params} | {k for k, _ in self.activations}

    def spec(
        self,
        dims: Sequence[str | None],
        *,
        kind: str = "params",
        mesh_sizes: Mapping[str, int] | None = None,
        what: str = "array",
    ) -> P:
        """PartitionSpec for an array whose dims have these logical names (None = never sharded).

        ``kind`` picks the table ("params" or "activations"). With ``mesh_sizes``, axes the mesh
        lacks or has at size 1 are dropped (they cost nothing). A dim the table does not map takes
        the rule of the dim it :data:`FOLLOWS`, if any. A rule set that would use one mesh axis for
        two dims of the same array raises, naming both dims.
        """
        sizes = None if mesh_sizes is None else tuple(sorted(mesh_sizes.items()))
        return _spec(self, tuple(dims), kind, sizes, what)  # the planner asks for the same specs many times

    def _spec(self, dims: tuple[str | None, ...], kind: str, sizes: tuple[tuple[str, int], ...] | None,
              what: str) -> P:
        if kind not in ("params", "activations"):
            raise RulesError(f"kind must be 'params' or 'activations', got {kind!r}")
        mesh_sizes = None if sizes is None else dict(sizes)
        table = dict(self.params if kind == "params" else self.activations)
        known = self.known_dims()
        used: dict[str, str] = {}
        entries: list[Axes] = []
        for dim in dims:
            if dim is not None and dim not in known:
                raise RulesError(
                    f"{what} has unknown logical dim {dim!r}; known dims: {', '.join(sorted(known))} "
                    f"(add a rule for it to use a new name)"
                )
            axes = axes_of(table[dim] if dim in table else table.get(FOLLOWS.get(dim))) if dim is not None else ()
            for axis in axes:
                if axis in used:
                    raise RulesError(
                        f"rule set {self.name!r} shards {what} dims {used[axis]!r} and {dim!r} both over mesh "
                        f"axis {axis!r}; an axis can shard only one dim of an array (dims {tuple(dims)})"
                    )
                used[axis] = dim
            if mesh_sizes is not None:
                axes = tuple(a for a in axes if mesh_sizes.get(a, 1) > 1)
            entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
        while entries and entries[-1] is None:
            entries.pop()
        return P(*entries)

    def replace(self, *, name: str | None = None, params: Mapping[str, Axes] | None = None,
                activations: Mapping[str, Axes] | None = None) -> Rules:
        """A copy with some dims re-mapped, e.g. ``FSDP.replace(params={"vocab": "tensor"})``."""
        def merge(table: Table, new: Mapping[str, Axes] | None) -> Table:
            out = dict(table)
            out.update(new or {})
            return tuple(out.items())

        return Rules(name or self.name, merge(self.params, params), merge(self.activations, activations))


_TP_PARAMS: Table = (("mlp", "tensor"), ("heads", "tensor"), ("kv_heads", "tensor"), ("vocab", "tensor"))
_TP_ACTS: Table = (("mlp", "tensor"), ("heads", "tensor"), ("kv_heads", "tensor"), ("vocab", "tensor"))

# A Stack's stacked ``layers`` dim is split over ``pipe`` in every preset (contiguous blocks of layers
# per pipeline stage; with pipe=1 the rule drops out).
_PIPE: Table = (("layers", "pipe"),)

# Context parallelism: activations split along the length over ``seq`` through the whole block in every
# preset (spmd.models.context exchanges K/V in attention; with seq=1 the rule drops out).
_SEQ: Table = (("length", "seq"),)

NONE = Rules("none", params=_PIPE, activations=_SEQ)
DP = Rules("dp", params=_PIPE, activations=(("batch", "data"),) + _SEQ)
FSDP = Rules("fsdp", params=_PIPE + (("embed", "fsdp"),), activations=(("batch", ("data", "fsdp")),) + _SEQ)
TP = Rules("tp", params=_PIPE + _TP_PARAMS, activations=_TP_ACTS + _SEQ)
DP_TP = Rules("dp_tp", params=_PIPE + _TP_PARAMS, activations=(("batch", "data"),) + _TP_ACTS + _SEQ)
FSDP_TP = Rules(
    "fsdp_tp", params=_PIPE + (("embed", "fsdp"),) + _TP_PARAMS,
    activations=(("batch", ("data", "fsdp")),) + _TP_ACTS + _SEQ,
)

# Megatron sequence parallelism: the residual stream and the norms (``residual_length``; everything
# between a row-parallel output and the next column-parallel input) split L over ``tensor`` too, so
# each row-parallel all-reduce becomes a reduce-scatter and each column-parallel input an all-gather
# (the same bytes), and those activations take 1/t of the memory. Inside attention and the MLP,
# ``length`` stays whole (``heads`` / ``mlp`` hold ``tensor`` there).
_SP_ACTS: Table = (("residual_length", ("seq", "tensor")),)  # seq: context parallelism, when seq > 1


def _with_sp(rules: Rules) -> Rules:
    return Rules(f"{rules.name}_sp", params=rules.params, activations=rules.activations + _SP_ACTS)


DP_TP_SP, FSDP_TP_SP = _with_sp(DP_TP), _with_sp(FSDP_TP)

# Expert parallelism (spmd.models.moe): MoE expert weights ``w[E_expert, ...]``, and the ``expert`` axis
# also splits the batch outside the MoE layers (each device routes its own tokens; docs/moe.md).
_EP: Table = (("expert", "expert"),)


def _with_ep(rules: Rules) -> Rules:
    acts = dict(rules.activations)
    batch = acts.get("batch")
    return Rules(f"{rules.name}_ep", params=rules.params + _EP,
                 activations=tuple((k, v) for k, v in acts.items() if k != "batch")
                 + (("batch", axes_of(batch) + ("expert",)),) + _EP)


DP_EP, FSDP_EP, FSDP_TP_EP = _with_ep(DP), _with_ep(FSDP), _with_ep(FSDP_TP)

RULE_SETS: dict[str, Rules] = {r.name: r for r in (NONE, DP, FSDP, TP, DP_TP, FSDP_TP, DP_TP_SP, FSDP_TP_SP, DP_EP, FSDP_EP, FSDP_TP_EP)}


def get_rules(name: str | Rules) -> Rules:
    """A preset by name (``"dp"``, ``"fsdp"``, ``"tp"``, ``"dp_tp"``, ``"fsdp_tp"``, ``"none"``, ...: RULE_SETS)."""
    if isinstance(name, Rules):
        return name
    try:
        return RULE_SETS[name]
    except KeyError:
        raise RulesError(f"unknown rule set {name!r}; valid presets: {', '.join(RULE_SETS)}") from None


@functools.lru_cache(maxsize=65536)
def _spec(rules: Rules, dims: tuple[str | None, ...], kind: str, sizes: tuple[tuple[str, int], ...] | None,
          what: str) -> P:
    return rules._spec(dims, kind, sizes, what)
