"""Local SGD / DiLoCo: replica groups over ``data`` that train alone and synchronise every H steps.

The ``data`` axis (size D, the slow DCN axis) holds G replica groups (``local_sgd.groups``; default G = D),
G/D on each data shard. Every leaf of the ordinary train state gains a leading group dim, ``X[G_data, ...]``:
params, inner optimizer state, counters, RNG and guard window per group. The inner step is the ordinary
step (:mod:`trainers.step`) mapped over groups
(``jax.vmap``, the group dim placed on ``data`` by its shardings) under the rule set without ``data``: group
g trains on rows ``[g*B/G, (g+1)*B/G)`` of the global batch; nothing in it communicates over ``data``. Every
H steps (and at the run's last step) the outer step all-reduces the params over ``data`` once (one variadic
psum of gradient size), applies ``outer_params - mean_g(params_g)`` as a pseudo-gradient with an outer
optax optimizer (default: plain averaging below H = 100, DiLoCo's Nesterov momentum from there on,
Douillard et al. 2023) and sets every group's params to the result. See docs/training.md ("Local SGD").
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import spmd
from spmd.constraints import replica_groups
from spmd.manual import manual_mesh
from spmd.rules import Rules, axes_of
from trainers.state import ShardedState, TrainState

OUTER_OPTIMIZERS = ("auto", "nesterov", "sgd")
OUTER_DTYPES = ("float32", "bfloat16", "int8")  # how the outer all-reduce moves the pseudo-gradients
NESTEROV_FROM = 100  # "auto": DiLoCo's outer Nesterov from this H on, plain model averaging below it
OUTER_DEFAULTS = {"nesterov": (0.7, 0.9), "sgd": (1.0, 0.0)}  # (outer_lr, outer_momentum) when not set
OUTER_KEYS = ("outer_params", "outer_opt_state")
AXIS = "data"
_ALL = ("ok", "finite")  # flags true for the step only when true in every group
_ANY = ("loss_spike", "grad_norm_spike")


@dataclasses.dataclass(frozen=True)
class LocalSGDConfig:
    """``every`` (H): inner steps between synchronisations; 0 = off (ordinary data parallelism).
    The outer optimizer: ``"nesterov"`` (DiLoCo's: lr 0.7, momentum 0.9), ``"sgd"`` (heavy-ball
    momentum ``outer_momentum``; lr 1 and momentum 0 = plain model averaging, and with H = 1 data
    parallelism), or ``"auto"`` (the default): plain averaging for H < ``NESTEROV_FROM`` (100),
    DiLoCo's Nesterov from there on. ``outer_lr`` / ``outer_momentum`` None: the chosen optimizer's.
    ``outer_dtype``: what the outer all-reduce moves; ``"float32"`` the params, ``"bfloat16"`` each
    group's pseudo-gradient in bf16 (half the bytes), ``"int8"`` it quantized with a scale per
    chunk (a quarter); summed in f32 (:func:`compressed_mean`). ``groups``: G, the number of replica
    groups, a multiple of the ``data`` size; 0: the ``data`` size. Fixed for a run: a checkpoint of G
    groups resumes on any mesh whose ``data`` size divides G."""

    every: int = 0
    groups: int = 0
    outer_optimizer: str = "auto"
    outer_lr: float | None = None
    outer_momentum: float | None = None
    outer_dtype: str = "float32"

    def __post_init__(self) -> None:
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 0:
            raise ValueError(f"local_sgd.every={self.every!r} must be an integer >= 0 (0: off; H >= 1 inner steps "
                             "between synchronisations)")
        if isinstance(self.groups, bool) or not isinstance(self.groups, int) or self.groups < 0 or self.groups == 1:
            raise ValueError(f"local_sgd.groups={self.groups!r} must be 0 (the data axis's size) or an integer >= 2 "
                             "(replica groups, a multiple of the data size)")
        if self.outer_dtype not in OUTER_DTYPES:
            raise ValueError(f"local_sgd.outer_dtype={self.outer_dtype!r}; valid: {', '.join(OUTER_DTYPES)}")
        if self.outer_optimizer not in OUTER_OPTIMIZERS:
            raise ValueError(f"local_sgd.outer_optimizer={self.outer_optimizer!r}; valid: {', '.join(OUTER_OPTIMIZERS)}")
        if self.outer_lr is not None and (not isinstance(self.outer_lr, (int, float)) or not 0 < self.outer_lr < math.inf):
            raise ValueError(f"local_sgd.outer_lr={self.outer_lr!r} must be a finite number > 0 (or None: the "
                             "outer optimizer's default)")
        if self.outer_momentum is not None and (not isinstance(self.outer_momentum, (int, float))
                                                or not 0 <= self.outer_momentum < 1):
            raise ValueError(f"local_sgd.outer_momentum={self.outer_momentum!r} must be a number in [0, 1) (or None: "
                             "the outer optimizer's default)")
        if self.outer == "nesterov" and self.momentum == 0:
            raise ValueError("local_sgd.outer_optimizer='nesterov' needs local_sgd.outer_momentum > 0; "
                             "use outer_optimizer=sgd for plain SGD")

    @property
    def enabled(self) -> bool:
        return self.every >= 1

    @property
    def outer(self) -> str:
        """The outer optimizer this H runs: ``outer_optimizer``, or for ``"auto"`` ``"sgd"`` (plain
        averaging) when H < ``NESTEROV_FROM``, else ``"nesterov"``."""
        if self.outer_optimizer != "auto":
            return self.outer_optimizer
        return "nesterov" if self.every >= NESTEROV_FROM else "sgd"

    @property
    def lr(self) -> float:
        return float(self.outer_lr if self.outer_lr is not None else OUTER_DEFAULTS[self.outer][0])

    @property
    def momentum(self) -> float:
        return float(self.outer_momentum if self.outer_momentum is not None else OUTER_DEFAULTS[self.outer][1])

    def describe(self) -> str:
        """The resolved outer optimizer, e.g. ``"sgd lr 1 momentum 0 (auto at H=10)"``."""
        how = f" (auto at H={self.every})" if self.outer_optimizer == "auto" else ""
        moved = "" if self.outer_dtype == "float32" else f", {self.outer_dtype} pseudo-gradients"
        return f"{self.outer} lr {self.lr:g} momentum {self.momentum:g}{how}{moved}"


def outer_optimizer(cfg: LocalSGDConfig) -> optax.GradientTransformation:
    """The outer optax optimizer of ``cfg`` (as resolved for its H): SGD with Nesterov or heavy-ball
    momentum, or none."""
    return optax.sgd(cfg.lr, momentum=cfg.momentum if cfg.momentum > 0 else None, nesterov=cfg.outer == "nesterov")


def inner_rules(rules: Rules) -> Rules:
    """``rules`` with the ``data`` axis removed from every dim: what one replica group runs under."""
    def strip(table):
        return tuple((dim, tuple(a for a in axes_of(axes) if a != AXIS) or None) for dim, axes in table)

    return Rules(f"{rules.name}/local", strip(rules.params), strip(rules.activations))


def step_layout(mesh: Mesh, template: ShardedState) -> tuple[Mesh, ShardedState]:
    """The mesh and state template the groups' inner step is built on: with ``data`` > 1 the step runs
    inside the groups' region manual over ``data``, so on the mesh with ``data`` typed Manual, every
    sharding of the template re-targeted at its abstract mesh (which the groups' vmap can batch); the
    specs under :func:`inner_rules` never name ``data``."""
    if dict(mesh.shape).get(AXIS, 1) == 1:
        return mesh, template
    inner = manual_mesh(mesh, frozenset({AXIS}))
    shardings = jax.tree.map(lambda s: NamedSharding(inner.abstract_mesh, s.spec), template.shardings)
    return inner, dataclasses.replace(template, shardings=shardings)


def groups_of(mesh: Mesh, cfg: LocalSGDConfig) -> int:
    """G: ``cfg.groups``, or the size of ``data``; ValueError when the mesh cannot hold them."""
    data = dict(mesh.shape).get(AXIS, 1)
    groups = cfg.groups or data
    if groups < 2:
        raise ValueError(f"local_sgd.every={cfg.every} needs replica groups over the {AXIS!r} axis, but this mesh has "
                         f"{AXIS}={data} ({dict(mesh.shape)}); give {AXIS} >= 2 (e.g. mesh.axes=data=2,fsdp=4), "
                         "local_sgd.groups >= 2, or set local_sgd.every=0")
    if groups % data:
        raise ValueError(f"local_sgd.groups={groups} does not divide over {AXIS}={data} ({dict(mesh.shape)}): give a "
                         f"multiple of {data} (each {AXIS} shard runs groups/{data} of them)")
    return groups


def check_resume(stored: Any, groups: int | None, step: int) -> None:
    """ValueError when checkpoint ``step`` (its metadata tree ``stored``) was written with another
    number of replica groups, or in the other mode; ``groups=None`` is ordinary data parallelism."""
    written = int(stored["step"].shape[0]) if OUTER_KEYS[0] in stored and stored["step"].shape else None
    if written == groups:
        return
    if groups is None:
        raise ValueError(f"checkpoint step {step} was written by local SGD with {written} replica groups; resume it "
                         f"with local_sgd.every >= 1 on a mesh with data={written}")
    if written is None:
        raise ValueError(f"checkpoint step {step} was written without local SGD; local_sgd.every={groups and 'H'} "
                         "cannot resume it: start from its params with checkpoint.init_from and a new run.run_dir")
    raise ValueError(f"checkpoint step {step} holds {written} replica groups but this run has {groups} "
                     f"(local_sgd.groups, 0: the data size): set local_sgd.groups={written} to resume them, on any "
                     f"mesh whose data size divides {written}")


def data_bytes(compiled: Any, mesh: Mesh) -> int:
    """Bytes per device that one run of ``compiled`` sends over ``data``: every collective whose axes
    include it, as the accelerator runs it (``spmd.hlo.collectives``), at its ring wire bytes (an
    all-reduce 2 (g-1)/g of its buffer, a reduce-scatter, all-gather or all-to-all (g-1)/g)."""
    ops = spmd.hlo.collectives(compiled, mesh)
    return round(sum(op.count * op.wire_bytes for op in ops if AXIS in op.axes))


class LocalSGD:
    """The local-SGD form of a run's state and steps (see the module docstring).

    ``state`` holds the ordinary state's keys with a leading group dim plus ``outer_params`` (the last
    synchronised params, sharded like params, replicated over ``data``) and ``outer_opt_state``.
    ``bytes_sent`` counts the bytes per device sent over ``data`` by every compiled call so far.
    """

    def __init__(self, cfg: LocalSGDConfig, template: ShardedState, step_fn: Callable, mesh: Mesh,
                 batch_sharding: NamedSharding, *, steps: int) -> None:
        """``template``: one group's state (``sharded_state`` under :func:`inner_rules`, plus the guard
        window); ``step_fn``: the pure ordinary step under those rules (``train_step_fn(jit=False)``);
        ``batch_sharding``: the global batch's (rows over ``data`` and the inner batch axes)."""
        self.cfg, self.mesh, self.steps, self.groups = cfg, mesh, steps, groups_of(mesh, cfg)
        if template.state.model_state is not None:
            raise ValueError("local_sgd.every >= 1 does not support models with non-parameter state (batch statistics, "
                             f"RNG streams: {sorted(template.state.model_state)}); set local_sgd.every=0")
        self.tx = outer_optimizer(cfg)
        params, param_shardings = template.state.params, template.shardings.params
        outer_opt = jax.eval_shape(self.tx.init, params)
        outer_opt_shardings = spmd.optimizer_shardings(self.tx, outer_opt, param_shardings, mesh)
        group = lambda s: NamedSharding(mesh, P(AXIS, *s.spec))
        self.group_shardings = jax.tree.map(group, template.shardings)
        self.shardings = self.group_shardings.replace(outer_params=param_shardings, outer_opt_state=outer_opt_shardings)
        self.batch_sharding = batch_sharding
        metric = NamedSharding(mesh, P(AXIS))
        G = self.groups

        def start(one: TrainState) -> TrainState:
            """Every group from one state (each its own RNG stream), outer params = the params."""
            groups = jax.tree.map(lambda x: jnp.broadcast_to(x, (G, *x.shape)), one)
            key = jax.random.wrap_key_data(one.rng)
            rngs = jax.vmap(lambda g: jax.random.key_data(jax.random.fold_in(key, g)))(jnp.arange(G))
            return groups.replace(rng=rngs, outer_params=one.params, outer_opt_state=self.tx.init(one.params))

        self._start = jax.jit(start, out_shardings=self.shardings)
        # each data shard maps its G/D groups inside a region manual over data (unchecked typing: see
        # spmd.models.moe, whose region nests in it), under replica_groups: nothing in it names data
        mapped = jax.vmap(step_fn)

        def shard_groups(groups: TrainState, split: Any) -> tuple[TrainState, dict[str, jax.Array]]:
            with replica_groups((AXIS,)):
                return mapped(groups, split)

        grouped = mapped
        if dict(mesh.shape).get(AXIS, 1) > 1:
            grouped = jax.shard_map(shard_groups, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS), axis_names={AXIS},
                                    check_vma=False)

        def inner(state: TrainState, batch: Any) -> tuple[TrainState, dict[str, jax.Array]]:
            groups = state.replace(outer_params=None, outer_opt_state=None)
            split = jax.tree.map(lambda x: x.reshape(G, x.shape[0] // G, *x.shape[1:]), batch)  # rows stay put
            groups, metrics = grouped(groups, split)
            return groups.replace(outer_params=state.outer_params, outer_opt_state=state.outer_opt_state), metrics

        def outer(state: TrainState) -> TrainState:
            if cfg.outer_dtype == "float32":
                mean = group_mean(state.params, mesh, G)
                pseudo_grad = jax.tree.map(jnp.subtract, state.outer_params, mean)
            else:
                pseudo_grad = compressed_mean(state.outer_params, state.params, self.shardings.params, param_shardings,
                                              mesh, G, cfg.outer_dtype)
            updates, opt_state = self.tx.update(pseudo_grad, state.outer_opt_state, state.outer_params)
            new = optax.apply_updates(state.outer_params, updates)
            params = jax.tree.map(lambda x: jnp.broadcast_to(x, (G, *x.shape)), new)
            return state.replace(params=params, outer_params=new, outer_opt_state=opt_state)

        def reduce(metrics: dict[str, jax.Array]) -> dict[str, jax.Array]:
            """One step's per-group metrics as the run logs them: flags over every group, the rest means."""
            pick = lambda k, v: v.all() if k in _ALL else v.any() if k in _ANY else v.astype(jnp.float32).mean()
            return {k: pick(k, v) for k, v in metrics.items()}

        rep = spmd.sharding.replicated(mesh)
        self._inner = jax.jit(inner, in_shardings=(self.shardings, batch_sharding),
                              out_shardings=(self.shardings, metric), donate_argnums=(0,))
        self._outer = jax.jit(outer, in_shardings=(self.shardings,), out_shardings=self.shardings, donate_argnums=(0,))
        self._reduce = jax.jit(reduce, out_shardings=rep)
        self._skipped = jax.jit(lambda s: s.sum(), out_shardings=rep)
        self.compiled: dict[str, Any] = {}
        self.bytes_per_call: dict[str, int] = {}
        self.bytes_sent = 0
        abstract = lambda x, s: jax.ShapeDtypeStruct((G, *x.shape), x.dtype, sharding=s)
        one = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
        self.abstract = jax.tree.map(abstract, template.abstract, self.group_shardings).replace(
            outer_params=jax.tree.map(one, params, param_shardings),
            outer_opt_state=jax.tree.map(one, outer_opt, outer_opt_shardings))

    # ------------------------------------------------------------------------------------ running
    def _call(self, name: str, fn: Any, *args: Any) -> Any:
        """Compile ``fn`` for ``args`` once (counting its bytes over ``data``), run it, count the bytes."""
        if name not in self.compiled:
            self.compiled[name] = fn.lower(*args).compile()
            self.bytes_per_call[name] = data_bytes(self.compiled[name], self.mesh)
        self.bytes_sent += self.bytes_per_call[name]
        return self.compiled[name](*args)

    def compile_steps(self, batch: Any) -> dict[str, Any]:
        """The inner and outer steps compiled for :attr:`abstract` and ``batch`` (shapes only): what a
        dry run reads (``{"inner": ..., "outer": ...}``)."""
        return {"inner": self._inner.lower(self.abstract, batch).compile(),
                "outer": self._outer.lower(self.abstract).compile()}

    def start(self, one: TrainState) -> TrainState:
        """The local-SGD state from one group's state (fresh, or ``init_from`` params)."""
        return self._start(one)

    def train_step(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, jax.Array]]:
        """One inner step of every group: ``(state, metrics[G])``; nothing is sent over ``data``."""
        return self._call("inner", self._inner, state, batch)

    def due(self, step: int) -> bool:
        """Whether the outer step runs after inner step ``step``: every H steps and at the last step."""
        return step % self.cfg.every == 0 or step == self.steps

    def outer_step(self, state: TrainState) -> TrainState:
        """Average params over groups (one all-reduce over ``data``), the outer update, re-broadcast."""
        return self._call("outer", self._outer, state)

    def fetch(self, metrics: list[dict[str, jax.Array]]) -> list[dict[str, Any]]:
        """Per-group step metrics as host values, one dict per step (a few scalars over ``data`` each)."""
        return jax.device_get([self._call("metrics", self._reduce, m) for m in metrics])

    def skipped(self, state: TrainState) -> int:
        """Group-steps skipped by the guard, summed over groups."""
        return int(jax.device_get(self._skipped(state.skipped)))

    def eval_view(self, state: TrainState) -> TrainState:
        """What eval reads: the outer (last synchronised) params."""
        return TrainState(state.outer_params)

    def summary(self, steps: int) -> dict[str, float]:
        """Bytes per device sent over ``data``: in all, per inner and outer call, and per step run."""
        per = {f"data_bytes_{k}": float(v) for k, v in self.bytes_per_call.items() if k != "metrics"}
        return {"data_bytes": float(self.bytes_sent), "data_bytes_per_step": self.bytes_sent / max(steps, 1), **per}


def group_mean(params_G: Any, mesh: Mesh, groups: int) -> Any:
    """``mean_g params[g]``: ``X[G_data, ...] -> X[...]``, one all-reduce over ``data`` of every leaf
    together (a variadic psum in a ``shard_map`` manual over ``data`` only; other axes stay automatic)
    of each shard's sum over its G/D groups."""
    def local(x_l):
        return jax.tree.map(lambda s: s / groups, jax.lax.psum(jax.tree.map(_local_sum, x_l), AXIS))

    if dict(mesh.shape).get(AXIS, 1) == 1:  # every group on every device: nothing to reduce over data
        return jax.tree.map(lambda x: _local_sum(x) / groups, params_G)

    specs = jax.tree.map(lambda _: P(AXIS), params_G)
    return jax.shard_map(local, mesh=mesh, in_specs=(specs,), out_specs=jax.tree.map(lambda _: P(), params_G),
                         axis_names=frozenset({AXIS}))(params_G)


def _local_sum(x_l: jax.Array) -> jax.Array:
    """``x[G/D, ...]`` summed over its groups in order (one group: itself, unrounded)."""
    total = x_l[0]
    for i in range(1, x_l.shape[0]):
        total = total + x_l[i]
    return total


def compressed_mean(outer: Any, params_G: Any, group_shardings: Any, shardings: Any, mesh: Mesh, groups: int,
                    dtype: str) -> Any:
    """``mean_g (outer - params[g])``, the pseudo-gradient, moved over ``data`` (size D) in ``dtype``: each
    device's sum over its G/D groups is flattened into D chunks, encoded (bf16; int8 with one f32 scale
    per chunk); an all-to-all gives each data shard every shard's copy of one chunk, summed in f32 and
    encoded again; an all-gather the whole. The ring all-reduce's bytes at ``dtype``'s width (bf16
    travels as its uint16 bits: no reduction runs in it). Manual over every mesh axis: the bytes are the
    shards'."""
    shards = dict(mesh.shape).get(AXIS, 1)
    if shards == 1:  # nothing moves over data: the f32 mean
        return jax.tree.map(lambda o, m: o - m.astype(o.dtype), outer, group_mean(params_G, mesh, groups))

    def one(o, p_l):
        d = _local_sum(o.astype(jnp.float32) - p_l.astype(jnp.float32))
        n = d.size
        flat = jnp.pad(d.reshape(-1), (0, -n % shards)).reshape(shards, -1)
        recv = [jax.lax.all_to_all(a, AXIS, 0, 0) for a in _encode(flat, dtype)]
        mean = jnp.sum(_decode(recv, dtype), axis=0) / groups
        full = _decode([jax.lax.all_gather(a[0], AXIS) for a in _encode(mean[None], dtype)], dtype)
        return full.reshape(-1)[:n].reshape(d.shape).astype(o.dtype)

    spec = lambda s: s.spec
    return jax.shard_map(lambda o, p: jax.tree.map(one, o, p), mesh=mesh,
                         in_specs=(jax.tree.map(spec, shardings), jax.tree.map(spec, group_shardings)),
                         out_specs=jax.tree.map(spec, shardings), check_vma=False)(outer, params_G)


def _encode(x_NC: jax.Array, dtype: str) -> list[jax.Array]:
    """``x[N, C]`` as sent: bf16 bits as uint16; int8 symmetric per row, ``[q[N, C], scale[N, 1] f32]``."""
    if dtype == "bfloat16":
        return [jax.lax.bitcast_convert_type(x_NC.astype(jnp.bfloat16), jnp.uint16)]
    scale = jnp.max(jnp.abs(x_NC), axis=1, keepdims=True) / 127.0
    q = jnp.round(x_NC / jnp.where(scale > 0, scale, 1.0))
    return [jnp.clip(q, -127, 127).astype(jnp.int8), scale]


def _decode(parts: list[jax.Array], dtype: str) -> jax.Array:
    if dtype == "bfloat16":
        return jax.lax.bitcast_convert_type(parts[0], jnp.bfloat16).astype(jnp.float32)
    return parts[0].astype(jnp.float32) * parts[1]
