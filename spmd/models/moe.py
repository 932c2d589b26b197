"""Mixture-of-experts MLP, with expert parallelism over the ``expert`` mesh axis.

``MoE(...)(x[B, L, D]) -> (y[B, L, D], stats)``: a router (:mod:`spmd.models.router`) sends each
token to k of E SwiGLU experts ``w_gate_up[E, D, 2, F]``, ``w_down[E, F, D]``; optional shared
experts run on every token. Each device routes its own tokens (the ``expert`` axis shards the
batch outside the layer), packs them into a static buffer ``x[E, C, D]``, and a ``shard_map`` over
the token axes and ``expert`` moves it with two all-to-alls (dispatch, combine) per forward pass,
two more in the backward. Capacity ``C`` per expert per device: ``ceil(cf * T * k / E)`` tokens
(overflow dropped), or ``T`` when dropless (``cf = 0``), where the experts run grouped matmuls
(:mod:`spmd.models.grouped`) over the rows that exist. Bytes and diagrams: docs/moe.md.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from meshes import axis_sizes
from spmd import collectives
from spmd.constraints import active_layout, constrain, group_axes
from spmd.models import grouped
from spmd.models import router as router_lib
from spmd.models.layers import GatedMLP, fan_in_init, param, weight
from spmd.rules import Rules, axes_of

EP_PRESETS = "dp_ep, fsdp_ep, fsdp_tp_ep"
EXCHANGES = ("padded", "ragged")  # dropless dispatch under expert parallelism: static [ep, R, D] buffers, routed rows
STATS = (*router_lib.STATS, "dropped")  # the statistics a MoE layer returns (without report_rows)


def experts_mlp(x_SECD: jax.Array, w_gate_up_EDTF: jax.Array, w_down_EFD: jax.Array) -> jax.Array:
    """The experts: ``y[S, E, C, D] = down_e(silu(x @ gate_e) * (x @ up_e))`` for every expert e
    (S = source devices, C = slots); ``F`` may be sharded over ``tensor`` (XLA all-reduces the
    row-parallel ``w_down`` output over it)."""
    h_SECTF = jnp.einsum("secd,edtf->sectf", x_SECD, w_gate_up_EDTF)
    h_SECF = jax.nn.silu(h_SECTF[..., 0, :]) * h_SECTF[..., 1, :]
    return jnp.einsum("secf,efd->secd", h_SECF, w_down_EFD)


def dispatch_combine(x_TD: jax.Array, experts_TK: jax.Array, gates_TK: jax.Array, w_gate_up_EDTF: jax.Array,
                     w_down_EFD: jax.Array, *, n_experts: int, capacity: int,
                     axis: str | None = None) -> tuple[jax.Array, jax.Array]:
    """One device's tokens through their experts: ``(y[T, D], kept[T, K])``.

    Without ``axis`` every expert is local (``w[E, ...]``). With ``axis`` (inside a ``shard_map``
    manual over it, |axis| = ep) this device holds experts ``w[E_axis, ...]`` (E/ep of them) and:

        x[E, C, D]                 this device's tokens, packed by expert (slot order: router.slots)
        -> all_to_all(axis)        dispatch: x[E_axis, (axis, C), D], i.e. [ep sources, E/ep, C, D]
        -> experts_mlp             y[ep, E/ep, C, D]
        -> all_to_all(axis)        combine: y[E, C, D], back on the devices that own the tokens

    Each all-to-all moves ``E * C * D`` elements per device, ``(ep-1)/ep`` of them off the device.
    """
    t, d = x_TD.shape
    slot_TK, kept_TK = router_lib.slots(experts_TK, n_experts, capacity)
    x_TKD = jnp.broadcast_to(x_TD[:, None, :], (t, experts_TK.shape[1], d))
    # each (expert, slot) receives at most one token; slots >= capacity fall outside and are dropped
    x_ECD = jnp.zeros((n_experts, capacity, d), x_TD.dtype).at[experts_TK, slot_TK].add(x_TKD, mode="drop")
    if axis is None:
        y_ECD = experts_mlp(x_ECD[None], w_gate_up_EDTF, w_down_EFD)[0]
    else:
        ep = n_experts // w_gate_up_EDTF.shape[0]
        x_ECD = collectives.all_to_all(x_ECD, axis, split_dim=0, concat_dim=0)  # dispatch
        x_SECD = x_ECD.reshape(ep, n_experts // ep, capacity, d)
        y_ECD = experts_mlp(x_SECD, w_gate_up_EDTF, w_down_EFD).reshape(n_experts, capacity, d)
        y_ECD = collectives.all_to_all(y_ECD, axis, split_dim=0, concat_dim=0)  # combine
    y_TKD = y_ECD.at[experts_TK, slot_TK].get(mode="fill", fill_value=0)
    weights_TK = jnp.where(kept_TK, gates_TK, 0.0)
    y_TD = jnp.einsum("tkd,tk->td", y_TKD.astype(jnp.float32), weights_TK)
    return y_TD.astype(x_TD.dtype), kept_TK


def _most_rows(tokens: int, n_experts: int, k: int, ep: int) -> int:
    """The most expert rows one device may hold dropless: its ``T * k`` assignments on one device; under
    ``ep > 1`` every source's tokens may pick its E/ep experts, at most ``ep * T * min(k, E/ep)`` (<= E * T)."""
    return tokens * k if ep == 1 else min(ep * tokens * min(k, n_experts // ep), n_experts * tokens)


def expert_rows(tokens: int, n_experts: int, k: int, capacity_factor: float, ep: int = 1) -> tuple[int, int]:
    """``(buffer rows, expert rows)`` of one device's ``tokens``, as static shapes hold them (memory): the
    rows packed for dispatch (``E * C`` with a capacity; under ``ep > 1`` dropless ``ep * T * min(k, E/ep)``,
    :func:`_by_device`; one device dropless ``T * k``) and the rows its experts' buffers hold (with a capacity ``E * C``; dropless the
    grouped blocks of :func:`dropless` for the most rows a device may receive; the loops compute only
    the blocks that hold rows, ``T * k`` plus padding with balanced routing)."""
    if capacity_factor > 0:
        slots = n_experts * router_lib.capacity(tokens, n_experts, k, capacity_factor)
        return slots, slots
    groups = n_experts // ep
    b = grouped.block_rows(tokens * k, groups)
    rows = grouped.n_blocks(_most_rows(tokens, n_experts, k, ep), groups, b) * b
    return (tokens * k, rows) if ep == 1 else (_most_rows(tokens, n_experts, k, ep), rows)


def dropless(x_TD: jax.Array, experts_TK: jax.Array, gates_TK: jax.Array, w_gate_up_EDTF: jax.Array,
             w_down_EFD: jax.Array, *, n_experts: int, axis: str | None = None,
             impl: str | None = None, exchange: str | None = None) -> tuple[jax.Array, jax.Array]:
    """One device's tokens through their experts, none dropped, with grouped matmuls: ``(y[T, D], rows)``,
    ``rows`` the expert rows this device computed (int32, block padding included).

    Without ``axis`` the ``T * k`` assignments go through :func:`spmd.models.grouped.grouped_mlp`
    (``T * k`` rows plus block padding, not ``E * T``). With ``axis`` each assignment travels to the device
    of its expert, packed per destination (:func:`_by_device`: ``T * min(k, E/ep)`` rows to each, with
    the row's local expert id beside it; two all-to-alls forward, as :func:`dispatch_combine`'s but
    ``local / min(k, local)`` times smaller than its ``[E, T, D]`` grid at ``C = T``); the receiving
    device groups the rows it holds for each of its E/ep experts. Its buffers hold the worst case,
    ``ep * T * min(k, E/ep)`` rows; the grouped loops run over the rows that came, ``T * k`` with
    balanced routing. ``exchange="ragged"`` (:data:`EXCHANGES`; None: ``"padded"`` on CPU, ``"ragged"``
    elsewhere) moves only the routed rows instead (:func:`_ragged`), ``T * k`` per device.
    """
    t, d = x_TD.shape
    k = experts_TK.shape[1]
    if axis is None:
        x_RD = jnp.broadcast_to(x_TD[:, None, :], (t, k, d)).reshape(t * k, d)
        y_RD, rows = grouped.grouped_mlp(x_RD, experts_TK.reshape(t * k), w_gate_up_EDTF, w_down_EFD, max_rows=t * k,
                                         impl=impl)
        y_TKD = y_RD.reshape(t, k, d)
    else:
        local = w_gate_up_EDTF.shape[0]
        ep = n_experts // local
        exchange = exchange or ("padded" if jax.default_backend() == "cpu" else "ragged")
        if exchange not in EXCHANGES:
            raise ValueError(f"MoE exchange={exchange!r}; valid: {', '.join(EXCHANGES)}")
        if exchange == "ragged":
            y_TKD, rows = _ragged(x_TD, experts_TK, w_gate_up_EDTF, w_down_EFD, ep=ep, axis=axis, impl=impl)
        else:
            x_SRD, group_SR, dest_TK, slot_TK = _by_device(x_TD, experts_TK, ep, local)
            x_SRD = collectives.all_to_all(x_SRD, axis, split_dim=0, concat_dim=0)  # dispatch: [sources, R, D]
            group_SR = collectives.all_to_all(group_SR, axis, split_dim=0, concat_dim=0)  # each row's local expert
            r = x_SRD.shape[1]
            y_RD, rows = grouped.grouped_mlp(x_SRD.reshape(ep * r, d), group_SR.reshape(ep * r), w_gate_up_EDTF,
                                             w_down_EFD, max_rows=ep * r, expected_rows=t * k, impl=impl)
            y_SRD = collectives.all_to_all(y_RD.reshape(ep, r, d), axis, split_dim=0, concat_dim=0)  # combine
            y_TKD = y_SRD.at[dest_TK, slot_TK].get(mode="fill", fill_value=0)
    y_TD = jnp.einsum("tkd,tk->td", y_TKD.astype(jnp.float32), gates_TK)
    return y_TD.astype(x_TD.dtype), rows


def _ragged(x_TD, experts_TK, w_gate_up_EDTF, w_down_EFD, *, ep: int, axis: str, impl: str | None):
    """``(y[T, K, D], rows)`` of :func:`dropless` over ``axis``, moving the routed rows only: this device's ``T * k`` assignments sorted by
    expert (so by device), ``send[j]`` rows to device j, which stacks its sources' rows in source order and
    groups them by its E/ep experts; the combine sends each row back to where it came from. The ``[ep, ep]``
    row counts are all-gathered first (``ep * ep`` int32). The receive buffer holds the worst case,
    ``ep * T * min(k, E/ep)`` rows (a memory bound), of which ``T * k`` are filled with balanced routing."""
    t, k = experts_TK.shape
    local = w_gate_up_EDTF.shape[0]
    bound = t * min(k, local)  # the most rows one device sends another: a token's k experts are distinct
    e_R = experts_TK.reshape(t * k).astype(jnp.int32)
    order_R = jnp.argsort(e_R, stable=True)  # by expert, so by device, then by local expert
    e_R = e_R[order_R]
    send_S = jnp.sum(jax.nn.one_hot(e_R // local, ep, dtype=jnp.int32), axis=0)
    sent_SS = collectives.all_gather(send_S[None], axis, dim=0)  # [source, destination] row counts
    me = collectives.axis_index(axis)
    recv_S = sent_SS[:, me]
    start_S, recv_start_S = jnp.cumsum(send_S) - send_S, jnp.cumsum(recv_S) - recv_S
    below_SS = (jnp.arange(ep) < me)[:, None]
    there_S = jnp.sum(jnp.where(below_SS, sent_SS, 0), axis=0)  # where this device's rows land on each device
    home_S = jnp.sum(jnp.where(jnp.arange(ep)[None, :] < me, sent_SS, 0), axis=1)  # where rows return to on each
    cap = ep * bound

    def move(rows, fill, back=False):
        size = t * k if back else cap
        out = jnp.full((size, *rows.shape[1:]), fill, rows.dtype)
        if back:
            return collectives.ragged_all_to_all(rows, out, recv_start_S, recv_S, home_S, send_S, axis, bound=bound)
        return collectives.ragged_all_to_all(rows, out, start_S, send_S, there_S, recv_S, axis, bound=bound)

    x_RD = move(x_TD[order_R // k], 0)  # dispatch
    group_R = move(e_R % local, local)  # each row's local expert; unfilled rows: none
    y_RD, rows = grouped.grouped_mlp(x_RD, group_R, w_gate_up_EDTF, w_down_EFD, max_rows=cap, expected_rows=t * k,
                                     impl=impl)
    y_RD = move(y_RD, 0, back=True)  # combine: in this device's sorted order
    return jnp.zeros_like(y_RD).at[order_R].set(y_RD).reshape(t, k, -1), rows


def _by_device(x_TD: jax.Array, experts_TK: jax.Array, ep: int, local: int):
    """One device's assignments packed by the device that holds their expert: ``x[ep, R, D]`` and the local
    expert id of each row ``group[ep, R]`` (``local``: no row), with ``(dest, slot)[T, K]`` of each
    assignment. ``R = T * min(k, E/ep)``: a token's k experts are distinct, so at most ``min(k, E/ep)`` of
    them sit on one device; no row is dropped, and a slot of device j is padding only beyond its rows."""
    t, k = experts_TK.shape
    r = t * min(k, local)
    dest_TK = experts_TK // local
    onehot = jax.nn.one_hot(dest_TK.reshape(t * k), ep, dtype=jnp.int32)
    slot_TK = jnp.sum((jnp.cumsum(onehot, axis=0) - 1) * onehot, axis=-1).reshape(t, k)  # rank on its device
    x_TKD = jnp.broadcast_to(x_TD[:, None, :], (t, k, x_TD.shape[1]))
    x_SRD = jnp.zeros((ep, r, x_TD.shape[1]), x_TD.dtype).at[dest_TK, slot_TK].set(x_TKD)
    group_SR = jnp.full((ep, r), local, jnp.int32).at[dest_TK, slot_TK].set((experts_TK % local).astype(jnp.int32))
    return x_SRD, group_SR, dest_TK, slot_TK


def expert_layout(rules: Rules, sizes: dict[str, int], n_experts: int,
                  outer: tuple[str, ...] = ()) -> tuple[int, P, tuple[str, ...]]:
    """``(ep, token spec, manual axes)`` of an MoE layer under ``rules`` on a mesh of axis ``sizes``.

    The tokens ``x[B, L, D]`` stay where the activation rules put batch and length (``embed`` must
    not be sharded); the layer runs per shard over those axes and ``expert`` (ep = its size), and over
    ``outer``: token axes already manual around it, which the rules there no longer name.
    Raises a ValueError naming the rule set when it cannot give expert parallelism.
    """
    ep = sizes.get("expert", 1)
    if "expert" in outer:  # split outside (rules stripped of it): the weights arrive whole, W[E]
        sizes = {a: s for a, s in sizes.items() if a != "expert"}
    acts = rules.spec(("expert",), kind="activations", mesh_sizes=sizes)
    params = rules.spec(("expert",), kind="params", mesh_sizes=sizes)
    want = P("expert") if ep > 1 and "expert" not in outer else P()
    if acts != want or params != want:
        raise ValueError(
            f"rule set {rules.name!r} maps the MoE dim 'expert' to params {params} / activations {acts} on a mesh "
            f"with expert={ep}; experts must shard over the expert axis only ({want}): use an expert-parallel "
            f"preset ({EP_PRESETS}) or the rule expert -> expert in both tables")
    spec = rules.spec(("batch", "length", "embed"), kind="activations", mesh_sizes=sizes, what="MoE input")
    spec = P(*(tuple(spec) + (None,) * 3)[:3])
    if spec[2] is not None:
        raise ValueError(f"rule set {rules.name!r} shards the MoE input's embed dim over {spec[2]!r}; the router "
                         f"and experts need whole tokens (activations must not shard 'embed')")
    token_axes = axes_of(spec[0]) + axes_of(spec[1]) + tuple(outer)
    if ep > 1 and "expert" not in token_axes:
        raise ValueError(
            f"rule set {rules.name!r} does not split the batch over the expert axis (batch -> {spec[0]!r}, "
            f"mesh expert={ep}): each device must route its own tokens; use an expert-parallel preset ({EP_PRESETS})")
    if n_experts % ep:
        raise ValueError(f"n_experts={n_experts} does not divide over the expert axis of size {ep}; use a multiple of {ep}")
    return ep, spec, tuple(a for a in ("data", "pipe", "fsdp", "seq", "expert", "tensor") if a in token_axes)


class MoE(nnx.Module):
    """Top-k mixture of SwiGLU experts: ``(y[B, L, D], stats) = moe(x[B, L, D])``.

    Parameters: router ``W[D, E]`` (f32; ``D`` as every ``embed`` dim, gathered at use), experts ``w_gate_up[E_expert, D, 2, F]`` and
    ``w_down[E_expert, F, D]`` (dims ``expert, embed, -, mlp``: under ``fsdp_tp_ep`` that is
    ``w_gate_up[E_expert, D_fsdp, 2, F_tensor]``, gathered over ``fsdp`` before use), and with
    ``n_shared > 0`` a shared :class:`GatedMLP` of width ``n_shared * F`` added on every token.

    ``stats`` (f32 scalars): ``aux_loss``, ``z_loss``, ``load_max``, ``load_min`` (from
    :func:`spmd.models.router.route`) and ``dropped`` (fraction of assignments over capacity); with
    ``report_rows``, ``expert_rows`` too: rows the experts computed per top-k assignment, mean over
    devices (1 + block padding dropless, ``E * C / (T * k)`` with a capacity; it depends on the
    layout). A model adds ``w_aux * aux_loss + w_z * z_loss`` to its loss. ``grouped_impl``: how
    dropless experts run (:func:`spmd.models.grouped.grouped_mlp`'s ``impl``; None: by backend); ``exchange``:
    how their rows move under expert parallelism (:func:`dropless`'s; None: by backend).
    """

    opens_manual_region = True  # runs its own shard_map, or none inside a region manual over all its axes

    def __init__(self, d_model: int, d_ff: int, n_experts: int, k: int = 2, *, rngs: nnx.Rngs,
                 capacity_factor: float = 0.0, router: str = "softmax", n_shared: int = 0,
                 dtype: jnp.dtype = jnp.float32, report_rows: bool = False, grouped_impl: str | None = None,
                 exchange: str | None = None):
        if n_experts < 1 or not 1 <= k <= n_experts:
            raise ValueError(f"MoE needs n_experts >= 1 and 1 <= k <= n_experts, got n_experts={n_experts}, k={k}")
        if router not in router_lib.ROUTERS:
            raise ValueError(f"MoE router {router!r} is not one of {router_lib.ROUTERS}")
        if exchange not in (None, *EXCHANGES):
            raise ValueError(f"MoE exchange {exchange!r} is not one of {EXCHANGES} (or None: by backend)")
        if capacity_factor < 0 or n_shared < 0:
            raise ValueError(f"MoE capacity_factor (0 = dropless) and n_shared must be >= 0, got "
                             f"{capacity_factor}, {n_shared}")
        self.w_router = param(rngs, fan_in_init(d_model), (d_model, n_experts), ("embed", None))
        self.w_gate_up = param(rngs, fan_in_init(d_model), (n_experts, d_model, 2, d_ff),
                               ("expert", "embed", None, "mlp"))
        self.w_down = param(rngs, fan_in_init(d_ff), (n_experts, d_ff, d_model), ("expert", "mlp", "embed"))
        self.shared = GatedMLP(d_model, n_shared * d_ff, rngs=rngs, dtype=dtype) if n_shared else None
        self.n_experts, self.k, self.capacity_factor, self.router, self.dtype = (
            n_experts, k, capacity_factor, router, dtype)
        self.report_rows, self.grouped_impl, self.exchange = report_rows, grouped_impl, exchange

    def __call__(self, x_BLD: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        b, length, d = x_BLD.shape
        x_BLD = constrain(x_BLD, ("batch", "length", "embed"))
        logits_BLE = jnp.einsum("bld,de->ble", x_BLD.astype(jnp.float32), weight(self.w_router, jnp.float32))
        routing = router_lib.route(logits_BLE.reshape(b * length, self.n_experts), self.k, self.router,
                                   axes=enclosing_token_axes(x_BLD))
        experts_BLK = routing.experts_TK.reshape(b, length, self.k)
        gates_BLK = routing.gates_TK.reshape(b, length, self.k)
        # gathered in the compute dtype, but they enter the expert shard_map in f32, typed varying there and
        # only then cast back: the gradient's sum over the token axes runs in f32 (a bf16 one, JAX's
        # psum_invariant, has a combiner XLA:CPU's all-reduce promotion aborts on)
        w_gate_up = weight(self.w_gate_up, self.dtype).astype(jnp.float32)
        w_down = weight(self.w_down, self.dtype).astype(jnp.float32)
        y_BLD, kept_BLK, rows = self._experts(x_BLD, experts_BLK, gates_BLK, w_gate_up, w_down)
        if self.shared is not None:
            y_BLD = y_BLD + self.shared(x_BLD)
        stats = dict(routing.stats, dropped=1.0 - jnp.mean(kept_BLK.astype(jnp.float32)))
        if self.report_rows:  # depends on the layout (block padding per device): not a model metric
            stats["expert_rows"] = jnp.mean(rows.astype(jnp.float32)) / (b * length * self.k / rows.size)
        return constrain(y_BLD, ("batch", "length", "embed")), stats

    def _experts(self, x_BLD, experts_BLK, gates_BLK, w_gate_up, w_down):
        """Dispatch, experts and combine: on one device, or per shard over the token axes and ``expert``.

        Inside an enclosing region manual over every token axis (gradient accumulation's loop with
        ``fsdp_gather="per_step"``) the per-shard body runs as it is, no ``shard_map``: the weights arrive
        whole (gathered once per step), each device slices its E/ep experts (gradient ``G[E]`` zero outside
        that slice). Inside a region manual over some of them only (accumulation's loop over ``data``, replica
        groups' region) its ``shard_map`` over the rest opens nested, typed unchecked, as the enclosing region
        must then be: checked, jax would name the enclosing axes in its linearization's residuals, which
        Shardy refuses in a nested region."""
        layout = active_layout()
        outer = enclosing_token_axes(x_BLD)
        ep, spec, manual = 1, P(), ()
        if layout is not None:
            mesh, rules = layout
            ep, spec, manual = expert_layout(rules, axis_sizes(mesh), self.n_experts, outer)
        n, k, cf = self.n_experts, self.k, self.capacity_factor
        inner = tuple(a for a in manual if a not in outer)

        def local(x_BLD, experts_BLK, gates_BLK, w_gate_up, w_down):
            w_gate_up, w_down = (collectives.varying_like(w, x_BLD).astype(self.dtype) for w in (w_gate_up, w_down))
            if ep > 1 and "expert" in outer and w_gate_up.shape[0] == n:  # W[E] whole: keep this device's E/ep
                start = jax.lax.axis_index("expert") * (n // ep)
                w_gate_up, w_down = (jax.lax.dynamic_slice_in_dim(w, start, n // ep) for w in (w_gate_up, w_down))
            b, length, d = x_BLD.shape
            t = b * length
            args = (x_BLD.reshape(t, d), experts_BLK.reshape(t, k), gates_BLK.reshape(t, k), w_gate_up, w_down)
            axis = "expert" if ep > 1 else None
            if cf == 0:
                (y_TD, rows), kept_TK = dropless(*args, n_experts=n, axis=axis, impl=self.grouped_impl,
                                                   exchange=self.exchange), args[1] >= 0
            else:
                capacity = router_lib.capacity(t, n, k, cf)
                y_TD, kept_TK = dispatch_combine(*args, n_experts=n, capacity=capacity, axis=axis)
                rows = jnp.asarray(n * capacity, jnp.int32)  # every slot: E/ep experts x ep sources x C
            return y_TD.reshape(b, length, d), kept_TK.reshape(b, length, k), rows[None]

        if not inner:
            return local(x_BLD, experts_BLK, gates_BLK, w_gate_up, w_down)
        w_spec = P("expert") if "expert" in inner else P()
        tok = P(spec[0], spec[1])
        nested = bool(layout[0].abstract_mesh.manual_axes)  # in accumulation's loop, replica groups' region
        return jax.shard_map(local, mesh=layout[0], in_specs=(tok, tok, tok, w_spec, w_spec),
                             out_specs=(tok, tok, P(inner)), axis_names=set(inner),
                             check_vma=not nested)(x_BLD, experts_BLK, gates_BLK, w_gate_up, w_down)


def enclosing_token_axes(x_BLD: jax.Array) -> tuple[str, ...]:
    """The mesh axes already manual around the layer that split its tokens: those ``x`` varies over
    (``data`` inside gradient accumulation's loop) or that the active layout's mesh types Manual (a
    pipeline's region, whose values carry no such types), less ``pipe`` (pipeline stages, not tokens)
    and the axes of replica groups (:func:`spmd.constraints.replica_groups`: local SGD's ``data``)."""
    layout = active_layout()
    manual = set() if layout is None else set(layout[0].abstract_mesh.manual_axes)
    return tuple(sorted((manual | collectives.varying_axes(jax.typeof(x_BLD))) - {"pipe", *group_axes()}))
