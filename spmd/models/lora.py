"""LoRA adapters: a low-rank update ``scale * (x @ A) @ B`` beside a frozen projection, with logical dims.

A projection ``W[in..., out...]`` (e.g. ``w_q[D, H, K]``) gains ``A[in..., r]`` and ``B[r, out...]``; the
rank dim ``r`` is replicated and every other dim names the base weight's logical dim, so the adapter shards
wherever its base shards (``A[D_fsdp, r]``, ``B[r, H_tensor, K]`` under ``fsdp_tp``), gathered at use as the
base weight is. Projections are named as PEFT names Llama's (``attn/q_proj`` ... ``mlp/down_proj``);
``LoRASpec.targets`` is a regex searched in those names. ``A`` starts as PEFT's, ``B`` at zero, so an adapted
model starts equal to its base; ``scale = alpha / rank``. ``dropout = p > 0`` is PEFT's, on the adapter's
input in training only; each adapter keeps its mask's key as a :class:`DropoutKey` variable that
:func:`draw_dropout` sets from the loss's key; row b of a batch draws its mask from ``fold_in(key, b)``
(:func:`dropout_mask`), so every layout and pipeline draws one device's masks. See docs/post-training.md.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Sequence
from typing import TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

PROJECTIONS: tuple[str, ...] = ("attn/q_proj", "attn/k_proj", "attn/v_proj", "attn/o_proj",
                                "mlp/gate_proj", "mlp/up_proj", "mlp/down_proj")
DEFAULT_TARGETS = r"(q|k|v|o|gate|up|down)_proj$"
ADAPTER_PATH = re.compile(r"(^|/)(q|k|v|o|gate|up|down)_proj/(a|b)$")  # a parameter path inside an Adapter


@dataclasses.dataclass(frozen=True)
class LoRASpec:
    """Which projections carry an adapter (``targets``: a regex searched in :data:`PROJECTIONS`), its
    rank ``r >= 1``, ``alpha`` (the update is scaled by ``alpha / rank``) and ``dropout`` (PEFT's
    ``lora_dropout``: the probability of zeroing an element of the adapter's input in training)."""

    rank: int
    alpha: float = 16.0
    targets: str = DEFAULT_TARGETS
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"LoRA rank must be a positive integer, got {self.rank!r}")
        if not isinstance(self.alpha, (int, float)) or not math.isfinite(self.alpha) or self.alpha <= 0:
            raise ValueError(f"LoRA alpha must be a finite number > 0, got {self.alpha!r}")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) or not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout must be a number in [0, 1), got {self.dropout!r}")
        try:
            pattern = re.compile(self.targets)
        except (re.error, TypeError) as e:
            raise ValueError(f"LoRA targets {self.targets!r} is not a valid regex: {e}") from None
        if not any(pattern.search(p) for p in PROJECTIONS):
            raise ValueError(f"LoRA targets {self.targets!r} matches no projection; the projections are "
                             f"{', '.join(PROJECTIONS)} (default {DEFAULT_TARGETS!r})")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def targeted(self, projection: str) -> bool:
        """Whether ``projection`` (one of :data:`PROJECTIONS`) carries an adapter."""
        return re.search(self.targets, projection) is not None

    @property
    def projections(self) -> tuple[str, ...]:
        return tuple(p for p in PROJECTIONS if self.targeted(p))


def is_adapter(path: str) -> bool:
    """Whether the '/'-joined parameter path names an adapter's ``a`` or ``b`` (else: a frozen base weight)."""
    return ADAPTER_PATH.search(path) is not None


def _uniform(bound: float):
    def init(key: jax.Array, shape: tuple[int, ...], dtype: jnp.dtype) -> jax.Array:
        return jax.random.uniform(key, shape, dtype, -bound, bound)

    return init


M = TypeVar("M", bound=nnx.Module)
Use = Callable[[nnx.Param], jax.Array]  # a parameter as used in compute (spmd.models.layers.weight)


class DropoutKey(nnx.Variable):
    """The raw key data of an adapter's dropout mask (``[layers, key]`` in a stack): set each step by
    :func:`draw_dropout`, read in training only. State of the model, not a parameter."""


def _key_data() -> jax.Array:
    return jax.random.key_data(jax.random.key(0))


class Adapter(nnx.Module):
    """``delta(x[..., in...]) = scale * (dropout(x) @ a[in..., r]) @ b[r, out...]``, the parameters taken as
    ``use`` gives them (cast to the compute dtype, laid out as activations: ``layers.weight``).

    ``dropout`` (``spec.dropout > 0``) acts when ``deterministic`` is False (``model.train()``), with the mask
    of the key :func:`draw_dropout` set; it is off as created and after ``model.eval()``."""

    def __init__(self, spec: LoRASpec, in_shape: Sequence[int], in_dims: Sequence[str | None],
                 out_shape: Sequence[int], out_dims: Sequence[str | None], *, rngs: nnx.Rngs):
        r = spec.rank
        fan_in = math.prod(in_shape)
        # PEFT: kaiming_uniform(a=sqrt(5)) on lora_A, i.e. U(-1/sqrt(fan_in), 1/sqrt(fan_in)); lora_B zeros
        a = _uniform(fan_in**-0.5)(rngs.params(), (*in_shape, r), jnp.float32)
        self.a = nnx.Param(a, out_sharding=(*in_dims, None), eager_sharding=False)
        self.b = nnx.Param(jnp.zeros((r, *out_shape), jnp.float32), out_sharding=(None, *out_dims),
                           eager_sharding=False)
        self.scale = spec.scale
        self.dropout, self.deterministic = float(spec.dropout), True
        if spec.dropout:
            self.key = DropoutKey(_key_data(), out_sharding=(None,), eager_sharding=False)

    def __call__(self, x: jax.Array, use: Use) -> jax.Array:
        a, b = use(self.a), use(self.b)
        x = x.astype(a.dtype)
        if self.dropout and not self.deterministic:
            x = x * dropout_mask(self.key.get_value(), self.dropout, x.shape).astype(x.dtype)
        h = jnp.tensordot(x, a, axes=a.ndim - 1)  # [..., r]: replicated over the rank
        return jnp.tensordot(h, b, axes=1) * jnp.asarray(self.scale, a.dtype)


def dropout_mask(key_data: jax.Array, rate: float, shape: Sequence[int]) -> jax.Array:
    """``keep / (1 - rate)`` (f32) over an adapter input of ``shape`` ``[B, L, ...]``: row b's ``keep`` is
    Bernoulli(1 - rate) over ``[L, ...]`` in natural token order, drawn from ``fold_in(key, b)``, or from
    ``key_data[b]`` when ``key_data`` holds a key per row (``[B, key]``: :func:`row_keys`, a pipeline stage's
    rows). An element's mask is a function of (key, row, position) alone, so it is the same on any layout,
    pipelined or not; the tokens are put in the layout's order (:func:`_positions`)."""
    keys = key_data if key_data.ndim == 2 else row_keys(key_data, jnp.arange(shape[0]))
    length, index = _positions(shape[1])

    def draw(k: jax.Array) -> jax.Array:  # one row's mask over [L, ...]
        return jax.random.bernoulli(jax.random.wrap_key_data(k), 1.0 - rate, (length, *shape[2:]))

    keep = jax.vmap(draw)(keys)
    if index is not None:
        keep = jnp.take(keep, index, axis=1)
    return keep.astype(jnp.float32) / (1.0 - rate)


def _positions(stored: int) -> tuple[int, jax.Array | np.ndarray | None]:
    """``(L, natural position of each of the ``stored`` tokens a device holds, None: all in natural order)``.
    Under context parallelism the rows are in ``context.sequence_order``; in a region manual over ``seq`` (a
    pipeline stage's) a device holds its shard of them, ``L = stored * seq`` (the mask draws whole rows)."""
    from spmd.constraints import active_layout
    from spmd.models import context

    n = context.seq_shards()
    if n == 1:
        return stored, None
    if "seq" in active_layout()[0].abstract_mesh.manual_axes:
        order = context.balanced_positions(stored * n, n).reshape(n, stored)
        return stored * n, jnp.asarray(order)[jax.lax.axis_index("seq")]
    return stored, context.sequence_order(stored)


def row_keys(key_data: jax.Array, rows_B: jax.Array) -> jax.Array:
    """``[..., key] -> [..., B, key]``: each key folded with each row's index in the batch (``fold_in(key, row)``)."""
    def fold(k: jax.Array, row: jax.Array) -> jax.Array:
        return jax.random.key_data(jax.random.fold_in(jax.random.wrap_key_data(k), row))

    flat = key_data.reshape(-1, key_data.shape[-1])
    out = jax.vmap(jax.vmap(fold, (None, 0)), (0, None))(flat, rows_B)
    return out.reshape(*key_data.shape[:-1], *out.shape[1:])


def carried_keys(state: nnx.State) -> nnx.State:
    """``state`` (a stack's layers) with every :class:`DropoutKey` ``[..., key]`` (uint32) as f32 ``[..., 2 key]``
    (16-bit halves, exact, behind ``stop_gradient``): a pipeline's engine moves and differentiates its stage
    state as floats. :func:`stage_keys` reads them back."""
    keys, rest = nnx.split_state(state, DropoutKey, ...)

    def halves(k: jax.Array) -> jax.Array:
        k = k.astype(jnp.uint32)
        return jax.lax.stop_gradient(jnp.stack([k >> 16, k & 0xFFFF], -1).reshape(*k.shape[:-1], -1).astype(jnp.float32))

    return nnx.merge_state(jax.tree.map(halves, keys), rest)


def stage_keys(state: nnx.State, rows_B: jax.Array) -> nnx.State:
    """``state`` (a pipeline stage's layers, keys as :func:`carried_keys` left them) with every
    :class:`DropoutKey` back as ``[..., key]`` and folded with the index of each row the stage holds
    (``rows_B``, :func:`row_keys`): the masks the whole batch draws for those rows."""
    keys, rest = nnx.split_state(state, DropoutKey, ...)

    def whole(f: jax.Array) -> jax.Array:
        h = jax.lax.stop_gradient(f).astype(jnp.uint32).reshape(*f.shape[:-1], -1, 2)
        return row_keys((h[..., 0] << 16) | h[..., 1], rows_B)

    return nnx.merge_state(jax.tree.map(whole, keys), rest)


def draw_dropout(model: nnx.Module, key: jax.Array) -> None:
    """Set the mask key of every adapter with dropout in ``model`` (in place) from ``key``: the i-th such
    adapter (graph order) gets ``split(fold_in(key, i), n)`` over its ``n`` stacked layers in natural order
    (stored in the stack's layer order: an interleaved pipeline's chunk order draws one device's masks). The
    train step's LoRA loss calls it with a key of the loss's ``nnx.Rngs`` (``trainers.lora.frozen_base_loss``)."""
    from spmd.pipeline.order import order_of

    i = 0
    for _, node in nnx.iter_graph(model):
        if isinstance(node, Adapter) and node.dropout:
            shape = node.key.get_value().shape  # [..., key]
            keys = jax.random.split(jax.random.fold_in(key, i), math.prod(shape[:-1]))
            keys = jax.random.key_data(keys).reshape(shape)
            node.key.set_value(order_of(node.key).to_stored(keys) if len(shape) > 1 else keys)
            i += 1


def has_dropout(model: nnx.Module) -> bool:
    """Whether any adapter of ``model`` has dropout."""
    return any(isinstance(node, Adapter) and node.dropout for _, node in nnx.iter_graph(model))


def attention_adapters(module: nnx.Module, spec: LoRASpec | None, d_model: int, n_heads: int, n_kv_heads: int,
                       head_dim: int, rngs: nnx.Rngs) -> None:
    """Set ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj`` on an attention module, those ``spec`` targets."""
    if spec is None:
        return
    d, q, kv = ((d_model,), ("embed",)), ((n_heads, head_dim), ("heads", "head_dim")), \
        ((n_kv_heads, head_dim), ("kv_heads", "head_dim"))
    for name, (i, o) in (("q_proj", (d, q)), ("k_proj", (d, kv)), ("v_proj", (d, kv)), ("o_proj", (q, d))):
        if spec.targeted(f"attn/{name}"):
            setattr(module, name, Adapter(spec, *i, *o, rngs=rngs))


def mlp_adapters(module: nnx.Module, spec: LoRASpec | None, d_model: int, d_ff: int, rngs: nnx.Rngs) -> None:
    """Set ``gate_proj``, ``up_proj``, ``down_proj`` on a gated MLP, those ``spec`` targets."""
    if spec is None:
        return
    d, f = ((d_model,), ("embed",)), ((d_ff,), ("mlp",))
    for name, (i, o) in (("gate_proj", (d, f)), ("up_proj", (d, f)), ("down_proj", (f, d))):
        if spec.targeted(f"mlp/{name}"):
            setattr(module, name, Adapter(spec, *i, *o, rngs=rngs))


def delta(module: nnx.Module, name: str, x: jax.Array, use: Use) -> jax.Array | None:
    """The adapter ``name`` of ``module`` applied to ``x``, or None when it has none."""
    adapter = getattr(module, name, None)
    return None if adapter is None else adapter(x, use)


def add(y: jax.Array, module: nnx.Module, name: str, x: jax.Array, use: Use) -> jax.Array:
    """``y`` plus the adapter ``name``'s update of ``x`` (``y`` itself when ``module`` has no such adapter)."""
    d = delta(module, name, x, use)
    return y if d is None else y + d.astype(y.dtype)


def add_kv(y_BLnK: jax.Array, module: nnx.Module, name: str, x_BLD: jax.Array, use: Use) -> jax.Array:
    """k or v ``[B, L, n, K]`` (n KV slots, a copy of each of the G KV heads per slot sharing it) plus the
    adapter's ``[B, L, G, K]`` update, copied the same way."""
    d_BLGK = delta(module, name, x_BLD, use)
    if d_BLGK is None:
        return y_BLnK
    n, g = y_BLnK.shape[2], d_BLGK.shape[2]
    if n > g:
        d_BLGK = jnp.repeat(d_BLGK, n // g, axis=2)
    return y_BLnK + d_BLGK.astype(y_BLnK.dtype)


def without_adapters(model: M) -> M:
    """A view of ``model`` whose every adapter's ``b`` is zero (held constant): the base model's output, as
    if it carried no adapters (``y + 0 = y``), on the same weights; ``model`` itself is unchanged.

    The frozen base of a LoRA model without a second copy (the DPO reference: docs/post-training.md). Its
    own parameters are the view's, so nothing is copied but the ``[..., r, out...]`` zeros, which lie as
    ``b`` does. The switch is in the data rather than a trace-time flag: jax reuses the traced jaxpr of a
    body function it has seen (scan, checkpoint), which would ignore a flag flipped between two calls."""
    view = nnx.clone(model)
    for _, node in nnx.iter_graph(view):
        if isinstance(node, Adapter):
            node.b.set_value(jax.lax.stop_gradient(jnp.zeros_like(node.b.get_value())))
    return view
