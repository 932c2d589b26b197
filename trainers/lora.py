"""LoRA in a run: ``lora.*`` config, the frozen base, PEFT export and import, merging into the weights.

    spmd-train gpt-small --set checkpoint.init_from=hf:llama --set lora.rank=16 --set lora.alpha=32
    spmd-export runs/x --to peft out/     # adapter_config.json + adapter_model.safetensors (PEFT's names)
    spmd-export runs/x --to hf out/       # the adapters merged into the weights: a plain Hugging Face folder

The adapters are ordinary parameters (:mod:`spmd.models.lora`), so every layout, checkpoint and resume path
takes them unchanged. The base is frozen twice over: the loss sees it through ``stop_gradient`` (its
gradient is zero, so the gradient norm and clipping are the adapters'), and the optimizer
(:func:`freeze_base`) keeps no state for it and never moves it. See docs/post-training.md.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from spmd.models.lora import DEFAULT_TARGETS, PROJECTIONS, LoRASpec, draw_dropout, has_dropout, is_adapter
from spmd.sharding import path_str

PEFT = "peft:"
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
# our projection -> (the base weight it adapts, (fused dim, index) within it or None)
BASE_OF: dict[str, tuple[str, tuple[int, int] | None]] = {
    "attn/q_proj": ("attn/w_q", None), "attn/k_proj": ("attn/w_kv", (3, 0)), "attn/v_proj": ("attn/w_kv", (3, 1)),
    "attn/o_proj": ("attn/w_o", None), "mlp/gate_proj": ("mlp/w_gate_up", (2, 0)),
    "mlp/up_proj": ("mlp/w_gate_up", (2, 1)), "mlp/down_proj": ("mlp/w_down", None),
}
STACK = "blocks/block/"  # where a GPT's stacked blocks keep their parameters (leading dim: layers)


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """``rank`` 0 (the default): no adapters, the run as without this section. ``rank >= 1``: adapters
    ``scale * (x @ A) @ B`` with ``scale = alpha / rank`` on the projections ``targets`` (a regex searched
    in ``attn/q_proj``, ``attn/k_proj``, ``attn/v_proj``, ``attn/o_proj``, ``mlp/gate_proj``, ``mlp/up_proj``,
    ``mlp/down_proj``) and every other parameter frozen. ``dropout``: PEFT's ``lora_dropout``, on the adapters'
    input in training only (masks from the step's key, per row of the batch: any layout or pipeline draws one
    device's). ``init_from``: ``peft:DIR``, a PEFT adapter to start from (its rank, alpha and targets are used;
    ``dropout`` stays this section's)."""

    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    targets: str = DEFAULT_TARGETS
    init_from: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 0:
            raise ValueError(f"lora.rank={self.rank!r} must be an integer >= 0 (0: no LoRA; e.g. 8 or 16)")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) or not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora.dropout={self.dropout!r} must be a number in [0, 1)")
        if self.init_from and not self.init_from.startswith(PEFT):
            raise ValueError(f"lora.init_from={self.init_from!r} must be peft:DIR (a folder with {ADAPTER_CONFIG} "
                             f"and {ADAPTER_WEIGHTS}), or empty")
        if self.init_from and not self.rank:
            raise ValueError(f"lora.init_from={self.init_from!r} needs lora.rank >= 1 (it is set from the adapter "
                             "by spmd-train; in Python call trainers.lora.resolve(cfg) first)")
        if self.rank:
            try:
                self.spec
            except ValueError as e:
                raise ValueError(f"lora.{str(e)[len('LoRA '):]}") from None

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def spec(self) -> LoRASpec | None:
        """The model-side adapter spec, or None when LoRA is off."""
        return LoRASpec(self.rank, float(self.alpha), self.targets, float(self.dropout)) if self.rank else None


def spec_of(cfg: Any) -> LoRASpec | None:
    """The adapter spec of a run config (None: LoRA off, or a config without a ``lora`` section)."""
    lora = getattr(cfg, "lora", None)
    return lora.spec if lora is not None else None


def adapter_mask(params: Any) -> Any:
    """Tree like ``params`` with True on adapter parameters, False on the frozen base."""
    return jax.tree_util.tree_map_with_path(lambda p, _: is_adapter(path_str(p, drop=())), params)


def freeze_base(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """``tx`` on the adapters only: the base gets a zero update and no optimizer state (``set_to_zero``)."""
    def labels(params: Any) -> Any:
        return jax.tree.map(lambda t: "adapter" if t else "frozen", adapter_mask(params))

    return optax.multi_transform({"adapter": tx, "frozen": optax.set_to_zero()}, labels)


def frozen_base_loss(loss_fn: Callable) -> Callable:
    """``loss_fn`` with every parameter but the adapters behind ``stop_gradient``: the base's gradient is
    zero (nothing of it is computed beyond what the adapters' gradient needs). With ``lora.dropout > 0`` the
    adapters' mask keys are drawn first from ``rngs`` (its ``dropout`` stream: the train step's key), so the
    masks are a function of the run's seed and step (``spmd.models.lora.draw_dropout``)."""
    def loss(model: nnx.Module, batch: Any, rngs: nnx.Rngs | None = None):
        if rngs is not None and has_dropout(model):
            draw_dropout(model, rngs.dropout())
        state = nnx.state(model, nnx.Param)
        pure = nnx.to_pure_dict(state)
        frozen = jax.tree_util.tree_map_with_path(
            lambda p, x: x if is_adapter(path_str(p, drop=())) else jax.lax.stop_gradient(x), pure)
        nnx.replace_by_pure_dict(state, frozen)
        nnx.update(model, state)
        return loss_fn(model, batch, rngs)

    for attr in ("pipelined", "weighted", "manual_unsafe"):
        if hasattr(loss_fn, attr):
            setattr(loss, attr, getattr(loss_fn, attr))
    return loss


def count(params: Any) -> tuple[int, int]:
    """``(adapter elements, all elements)`` of a params tree (arrays or shapes)."""
    sizes = jax.tree.map(lambda x: math.prod(x.shape), params)
    mask = adapter_mask(params)
    total = sum(jax.tree.leaves(sizes))
    return sum(s for s, m in zip(jax.tree.leaves(sizes), jax.tree.leaves(mask)) if m), total


# ---- PEFT's format -------------------------------------------------------------------------------------------

def _flat(params: Mapping[str, Any]) -> dict[str, Any]:
    return {path_str(p, drop=()): x for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}


def _unflat(flat: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for path, x in flat.items():
        node = out
        *parents, leaf = path.split("/")
        for k in parents:
            node = node.setdefault(k, {})
        node[leaf] = x
    return out


def peft_name(projection: str, layer: int, part: str) -> str:
    """PEFT's tensor name of ``projection``'s ``lora_A``/``lora_B`` (``part`` "A" or "B") in ``layer``."""
    module = "self_attn" if projection.startswith("attn/") else "mlp"
    return f"base_model.model.model.layers.{layer}.{module}.{projection.split('/')[1]}.lora_{part}.weight"


def peft_tensors(params: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """The adapters of a GPT's params (pure dict) as PEFT's tensors: per layer ``lora_A.weight[r, in]`` and
    ``lora_B.weight[out, r]``, the in and out dims flattened as the Hugging Face projections flatten them."""
    flat = _flat(params)
    out = {}
    for projection in PROJECTIONS:
        a_key = STACK + projection + "/a"
        if a_key not in flat:
            continue
        a_LIr, b_LrO = np.asarray(flat[a_key], np.float32), np.asarray(flat[STACK + projection + "/b"], np.float32)
        r = a_LIr.shape[-1]
        for i in range(a_LIr.shape[0]):
            out[peft_name(projection, i, "A")] = np.ascontiguousarray(a_LIr[i].reshape(-1, r).T)
            out[peft_name(projection, i, "B")] = np.ascontiguousarray(b_LrO[i].reshape(r, -1).T)
    if not out:
        raise ValueError(f"these params hold no LoRA adapters (no {STACK}<projection>/a); was the run trained with "
                         "lora.rank >= 1?")
    return out


def peft_config(spec: LoRASpec, base: str = "") -> dict[str, Any]:
    """PEFT's ``adapter_config.json`` for ``spec`` (target modules listed by name)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": spec.rank, "lora_alpha": spec.alpha,
            "lora_dropout": spec.dropout, "target_modules": sorted({p.split("/")[1] for p in spec.projections}),
            "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
            "init_lora_weights": True, "modules_to_save": None, "base_model_name_or_path": base}


def save_peft(out: str, spec: LoRASpec, params: Mapping[str, Any], *, base: str = "") -> list[str]:
    """Write ``adapter_config.json`` and ``adapter_model.safetensors`` (f32) of ``params``' adapters to ``out``."""
    from safetensors.numpy import save_file

    os.makedirs(out, exist_ok=True)
    save_file(peft_tensors(params), os.path.join(out, ADAPTER_WEIGHTS), metadata={"format": "pt"})
    with open(os.path.join(out, ADAPTER_CONFIG), "w") as f:
        json.dump(peft_config(spec, base), f, indent=2)
    return [ADAPTER_CONFIG, ADAPTER_WEIGHTS]


def peft_dir(source: str) -> str:
    """The folder of ``peft:DIR``, checked to hold an adapter."""
    path = source[len(PEFT):] if source.startswith(PEFT) else source
    missing = [f for f in (ADAPTER_CONFIG, ADAPTER_WEIGHTS) if not os.path.isfile(os.path.join(path, f))]
    if missing:
        raise ValueError(f"lora.init_from={source!r}: {path!r} has no {' or '.join(missing)}; give a PEFT adapter "
                         "folder (what PeftModel.save_pretrained writes)")
    return path


def read_peft_config(path: str) -> LoRASpec:
    """The :class:`LoRASpec` of a PEFT adapter folder; refuses what this model cannot compute the same."""
    with open(os.path.join(path, ADAPTER_CONFIG)) as f:
        hf = json.load(f)
    wrong = {k: hf.get(k) for k, ok in (("peft_type", "LORA"), ("bias", "none")) if hf.get(k, ok) != ok}
    wrong.update({k: hf[k] for k in ("use_rslora", "use_dora", "fan_in_fan_out") if hf.get(k)})
    wrong.update({k: hf[k] for k in ("rank_pattern", "alpha_pattern", "layers_to_transform", "modules_to_save")
                  if hf.get(k)})
    if wrong:
        raise ValueError(f"the PEFT adapter in {path!r} has settings this model does not compute: {wrong}; supported: "
                         "peft_type LORA, bias none, no rsLoRA/DoRA/fan_in_fan_out, one rank and alpha for all layers")
    modules = hf.get("target_modules")
    names = {p.split("/")[1] for p in PROJECTIONS}
    if isinstance(modules, str):
        targets = modules
    elif isinstance(modules, list) and modules and set(modules) <= names:
        targets = "(" + "|".join(sorted(modules)) + ")$"
    else:
        raise ValueError(f"the PEFT adapter in {path!r} targets {modules!r}; this model adapts {sorted(names)}")
    return LoRASpec(int(hf["r"]), float(hf["lora_alpha"]), targets)


def read_peft(path: str, abstract_adapters: Mapping[str, Any]) -> dict[str, Any]:
    """The adapters of the PEFT folder ``path`` in the structure, shapes and shardings of ``abstract_adapters``
    (a pure dict of the model's adapter parameters); raises naming a missing tensor or a shape that differs."""
    from safetensors.numpy import load_file

    tensors = load_file(os.path.join(path, ADAPTER_WEIGHTS))
    flat = _flat(abstract_adapters)
    used, out = set(), {}
    for key, want in flat.items():
        projection = key[len(STACK):].rsplit("/", 1)[0]
        part = key[-1].upper()
        layers = []
        for i in range(want.shape[0]):
            name = peft_name(projection, i, part)
            if name not in tensors:
                raise ValueError(f"the PEFT adapter in {path!r} has no tensor {name} (parameter {key})")
            t = tensors[name].T  # [in, r] or [r, out]
            if t.size != math.prod(want.shape[1:]) or t.shape[0 if part == "A" else 1] != math.prod(
                    want.shape[1:-1] if part == "A" else want.shape[2:]):
                raise ValueError(f"tensor {name} has shape {tensors[name].shape}, parameter {key} needs "
                                 f"{tuple(want.shape[1:])} per layer")
            layers.append(t.reshape(want.shape[1:]))
            used.add(name)
        value = np.stack(layers).astype(want.dtype)
        sharding = getattr(want, "sharding", None)
        out[key] = jax.device_put(value, sharding) if sharding is not None else jnp.asarray(value)
    extra = sorted(set(tensors) - used)
    if extra:
        raise ValueError(f"the PEFT adapter in {path!r} has {len(extra)} tensor(s) this model's adapters do not: "
                         f"{', '.join(extra[:4])}")
    return _unflat(out)


# ---- merging and starting --------------------------------------------------------------------------------------

def merged(params: Mapping[str, Any], spec: LoRASpec) -> dict[str, Any]:
    """The base weights with every adapter's ``scale * A @ B`` added in (the adapters dropped): a plain GPT's
    params, computing what the adapted model computes."""
    flat = {k: np.array(v, np.float32) for k, v in _flat(params).items()}
    for projection in PROJECTIONS:
        a_key = STACK + projection + "/a"
        if a_key not in flat:
            continue
        a_LIr, b_LrO = flat.pop(a_key), flat.pop(STACK + projection + "/b")
        n, r = a_LIr.shape[0], a_LIr.shape[-1]
        d = np.einsum("lir,lro->lio", a_LIr.reshape(n, -1, r), b_LrO.reshape(n, r, -1)) * spec.scale
        d = d.reshape(a_LIr.shape[:-1] + b_LrO.shape[2:])
        base, fused = BASE_OF[projection]
        w = flat[STACK + base]
        if fused is None:
            w += d
        else:
            index = [slice(None)] * w.ndim
            index[fused[0]] = fused[1]  # type: ignore[call-overload]
            w[tuple(index)] += d
    return _unflat(flat)


def split(params: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(base, adapters)``: a pure params dict in two (either may be empty)."""
    flat = _flat(params)
    return (_unflat({k: v for k, v in flat.items() if not is_adapter(k)}),
            _unflat({k: v for k, v in flat.items() if is_adapter(k)}))


def combine(base: Mapping[str, Any], adapters: Mapping[str, Any]) -> dict[str, Any]:
    """One pure params dict of ``base`` and ``adapters`` (the inverse of :func:`split`)."""
    return _unflat({**_flat(base), **_flat(adapters)})


def join(base: Mapping[str, Any], adapters: Mapping[str, Any], like: Any) -> Any:
    """``base`` and ``adapters`` back in the structure of ``like``."""
    flat = {**_flat(base), **_flat(adapters)}
    leaves = jax.tree_util.tree_flatten_with_path(like)
    return jax.tree.unflatten(leaves[1], [flat[path_str(p, drop=())] for p, _ in leaves[0]])


def initial_adapters(make_model: Callable[[], nnx.Module], abstract_adapters: Any) -> Any:
    """The adapters ``make_model()`` starts with, created on their shardings (the base weights it would draw
    are dead code to XLA, so nothing base-sized is allocated)."""
    shardings = jax.tree.map(lambda x: x.sharding, abstract_adapters)

    def adapters():
        return split(nnx.to_pure_dict(nnx.state(make_model(), nnx.Param)))[1]

    return jax.jit(adapters, out_shardings=shardings)()


def resolve(cfg: Any) -> Any:
    """``cfg`` with ``lora.rank``, ``alpha`` and ``targets`` taken from ``lora.init_from=peft:DIR``'s
    adapter config (unchanged without one); refused without a ``checkpoint.init_from=hf:`` base."""
    source = cfg.lora.init_from
    if not source:
        return cfg
    if not str(cfg.checkpoint.init_from).startswith("hf:"):
        raise ValueError(f"lora.init_from={source!r} needs the base model it was trained on: give "
                         "checkpoint.init_from=hf:PATH too")
    spec = read_peft_config(peft_dir(source))
    lora = dataclasses.replace(cfg.lora, rank=spec.rank, alpha=spec.alpha, targets=spec.targets)
    return dataclasses.replace(cfg, lora=lora)


def read_with_adapters(cfg: Any, abstract_params: Any, read_base: Callable[[Any], Any]) -> Any:
    """A LoRA run's start from ``checkpoint.init_from=hf:PATH``: the base read by ``read_base(abstract base)``,
    the adapters from ``lora.init_from=peft:DIR`` or as the model draws them (seed ``run.seed``)."""
    from spmd.models import GPT

    base, adapters = split(abstract_params)
    params = read_base(base)
    if cfg.lora.init_from:
        values = read_peft(peft_dir(cfg.lora.init_from), adapters)
    else:
        spec = cfg.lora.spec
        values = initial_adapters(lambda: GPT(cfg.model, rngs=nnx.Rngs(cfg.run.seed), lora=spec), adapters)
    return join(split(params)[0], values, abstract_params)


__all__ = ["LoRAConfig", "adapter_mask", "freeze_base", "frozen_base_loss", "load_adapted", "merged", "peft_tensors", "read_peft",
           "read_peft_config", "resolve", "save_peft", "spec_of"]


def load_adapted(hf: str, spec: LoRASpec | None = None, peft: str | None = None, mesh: Any = None,
                 rules: Any = "none", seed: int = 0) -> Any:
    """A ``GPT`` with the Hugging Face folder ``hf``'s weights and LoRA adapters: PEFT's from the folder ``peft``
    (its rank, alpha and targets), else ``spec``'s as drawn with ``seed``; sharded on ``mesh`` (default one
    device) by ``rules``."""
    import meshes
    from spmd.interchange import read_params
    from spmd.interchange.pretrained import pretrained_config
    from spmd.models import GPT
    from spmd.variables import init_model

    spec = read_peft_config(peft_dir(peft)) if peft else spec
    if spec is None:
        raise ValueError("load_adapted needs a LoRASpec or a PEFT adapter folder")
    cfg = pretrained_config(hf)
    mesh = mesh or meshes.single_device_mesh()
    model_vars = init_model(lambda: GPT(cfg, rngs=nnx.Rngs(seed), lora=spec), rules, mesh, abstract=True)
    abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            model_vars.params, model_vars.shardings["params"])
    base, adapters = split(abstract)
    values = read_peft(peft_dir(peft), adapters) if peft else initial_adapters(
        lambda: GPT(cfg, rngs=nnx.Rngs(seed), lora=spec), adapters)
    params = join(read_params(hf, cfg, base), values, abstract)
    return model_vars.merge(params, model_vars.other)
