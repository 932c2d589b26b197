"""Typed, frozen run configuration and ``key=value`` overrides.

A :class:`Config` groups one frozen dataclass per concern (model, mesh, rules, optimizer,
lr, data, checkpoint, run). Recipes (``trainers.recipes``) are functions returning a Config;
the CLI applies overrides such as ``model.d_model=256`` or ``lr.peak_lr=1e-3`` with
:func:`override`, which parses each value by the field's declared type and rejects unknown keys
and bad values with an error listing what is valid.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax

import meshes
from spmd.models import GPTConfig
from spmd.pipeline import PipelineConfig
from trainers.checkpoint import CheckpointConfig
from trainers.checks.config import check_fsdp_gather
from trainers.checks.issue import raise_first_fatal
from trainers.checks.registry import check
from trainers.data import DataConfig
from trainers.local_sgd import LocalSGDConfig
from trainers.lora import LoRAConfig
from trainers.lr import LRConfig
from trainers.objectives.config import DPOConfig
from trainers.optim import OptimizerConfig
from trainers.trace import PROCESSES, parse_steps

AUTO = "auto"  # mesh.axes: the planner picks mesh, rule set and remat (trainers.planning.resolve_auto)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Mesh axis sizes in the CLI form (``"data=2,tensor=4"``; -1 infers one), DCN sizes across slices."""

    axes: str = "data=-1"
    dcn: str = ""
    axis_type: str = "auto"

    def __post_init__(self) -> None:
        if isinstance(self.axes, str) and self.axes.strip().lower() == AUTO and self.axes != AUTO:
            object.__setattr__(self, "axes", AUTO)  # --mesh AUTO / Auto: the planner's choice, as --mesh auto
        if self.axes != AUTO:
            self.spec  # validates names and sizes now, not on the pod
        elif self.dcn:
            raise ValueError(f"mesh.axes='auto' with mesh.dcn={self.dcn!r}: the planner chooses single-slice layouts; "
                             "give mesh.axes explicitly for a multi-slice run")
        if self.axis_type not in meshes.AXIS_TYPES:
            raise ValueError(f"mesh.axis_type {self.axis_type!r} is not one of {sorted(meshes.AXIS_TYPES)}")

    @property
    def spec(self) -> meshes.MeshSpec:
        """The validated :class:`meshes.MeshSpec` (ICI sizes, DCN sizes) of ``axes`` and ``dcn``."""
        if self.axes == AUTO:
            raise ValueError("mesh.axes='auto' is a layout the planner has not chosen yet: resolve it first with "
                             "trainers.planning.resolve_auto(cfg) (spmd-train --mesh auto does), or give axis sizes "
                             "such as mesh.axes=fsdp=-1")
        return meshes.MeshSpec.of(self.axes, self.dcn or None)

    def sizes(self, devices: int) -> dict[str, int]:
        """Axis sizes (ICI x DCN, every canonical axis, outermost first) this mesh has on ``devices``
        devices, without building it (the dry run and the planner plan for devices they do not have)."""
        ici, dcn = self._resolve(devices)
        return {a: ici[a] * dcn.get(a, 1) for a in ici}

    def dcn_axes(self, devices: int) -> tuple[str, ...]:
        """The axes that cross slices or hosts (DCN size > 1) on ``devices`` devices."""
        return tuple(a for a, s in self._resolve(devices)[1].items() if s > 1)

    def _resolve(self, devices: int) -> tuple[dict[str, int], dict[str, int]]:
        spec = self.spec
        dcn = dict(spec.dcn)
        if any(s == -1 for s in dcn.values()):
            raise ValueError(f"mesh.dcn={self.dcn!r}: sizes for {devices} devices need explicit DCN sizes (no -1)")
        return spec.resolve(devices, math.prod(dcn.values()) if dcn else 1)

    def build(self, devices: Sequence[jax.Device] | None = None) -> jax.sharding.Mesh:
        """The run's one Mesh, over ``devices`` (default: every device of every process)."""
        return meshes.make_mesh(self.spec, devices=devices, axis_type=self.axis_type)


@dataclasses.dataclass(frozen=True)
class RunConfig:
    name: str = "run"
    run_dir: str = ""  # "" -> runs/<name>
    steps: int = 1000
    grad_accum: int = 1  # microbatches per step (the global batch is split k ways)
    # with grad_accum > 1, when weights sharded over fsdp are gathered: "per_microbatch" (ZeRO-3, least
    # memory) or "per_step" (gathered once, gradients reduce-scattered once: full-size weights and
    # gradient accumulator per device, 1/k of the fsdp bytes); data-parallel gradients are reduced once either way
    fsdp_gather: str = "per_microbatch"
    z_loss: float = 0.0
    eval_every: int = 100
    eval_batches: int = 4  # batches per evaluation; -1: one full pass over a finite eval set; 0: no eval
    log_every: int = 10
    seed: int = 0
    max_bad_steps: int = 5  # consecutive bad steps (skip) or rollbacks in all (rollback) before the run stops
    resume: bool = True  # resume from the newest valid checkpoint; false needs an empty checkpoint directory
    tensorboard: bool = True
    progress: bool = True
    guard: str = "skip"  # bad step (non-finite or spike): "skip" its update | "rollback" to a checkpoint | "stop"
    spike_factor: float = 10.0  # a spike is loss or grad norm > factor x running median; 0 turns spikes off
    spike_window: int = 32  # accepted steps in the running median (spikes are flagged once it is full)
    # a proposed update is not applied, and the run stops naming the cause, when |update| > max_update_ratio x
    # |params| or the params would exceed max_param_growth x their norm before the first update; 0 turns one off
    max_update_ratio: float = 1.0
    max_param_growth: float = 10.0
    preemption_check_every: int = 1  # steps between multi-process agreements on a stop request
    profile_steps: str = ""  # "START:END": a jax.profiler trace of those steps (inclusive) in run_dir/tensorboard
    profile_processes: str = "first"  # which processes trace: "first" (process 0) or "all"
    memory_profile_step: int = 0  # > 0: a device-memory profile after that step (also on SIGUSR1) in run_dir/memory
    sample_every: int = 0  # > 0: every N steps log a few generated continuations of sample_prompt (built-in GPT)
    sample_prompt: str = "Once upon a time"  # text, encoded with data.tokenizer (or as bytes)
    objective: str = "lm"  # the built-in task's loss: "lm" (next token) | "dpo" (preference pairs: the dpo section)

    def __post_init__(self) -> None:
        from trainers.faults.guard import validate, validate_update_limits

        for name in ("steps", "grad_accum", "eval_every", "log_every", "max_bad_steps", "preemption_check_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"run.{name} must be >= 1, got {getattr(self, name)}")
        if self.steps > 2**31 - 1:  # the state's step counter is int32
            raise ValueError(f"run.steps={self.steps} is beyond the int32 step counter (at most {2**31 - 1}); "
                             "give the number of optimizer steps to run (--steps N)")
        validate(self.guard, self.spike_factor, self.spike_window)
        validate_update_limits(self.max_update_ratio, self.max_param_growth)
        check_fsdp_gather(self.fsdp_gather)
        parse_steps(self.profile_steps)
        if self.profile_processes not in PROCESSES:
            raise ValueError(f"run.profile_processes={self.profile_processes!r}; valid: {', '.join(PROCESSES)}")
        if self.memory_profile_step < 0:
            raise ValueError(f"run.memory_profile_step must be >= 0 (0: none), got {self.memory_profile_step}")
        if self.eval_batches < -1:
            raise ValueError(f"run.eval_batches must be >= 0, or -1 for one full pass over the eval set; got {self.eval_batches}")
        if self.sample_every < 0 or not self.sample_prompt:
            raise ValueError(f"run.sample_every must be >= 0 (0: no samples) and run.sample_prompt non-empty, got "
                             f"{self.sample_every}, {self.sample_prompt!r}")
        if self.z_loss < 0:
            raise ValueError(f"run.z_loss must be >= 0, got {self.z_loss}")

    @property
    def directory(self) -> str:
        return self.run_dir or f"runs/{self.name}"


@dataclasses.dataclass(frozen=True)
class Config:
    model: GPTConfig = GPTConfig()
    mesh: MeshConfig = MeshConfig()
    rules: str = "fsdp_tp"
    optimizer: OptimizerConfig = OptimizerConfig()
    lr: LRConfig = LRConfig()  # the learning-rate schedule (pipeline.schedule is the pipeline's)
    data: DataConfig = DataConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    run: RunConfig = RunConfig()
    pipeline: PipelineConfig = PipelineConfig()  # schedule "none": the block stack runs as a plain scan
    local_sgd: LocalSGDConfig = LocalSGDConfig()  # every >= 1: replica groups over data, synchronised every H steps
    lora: LoRAConfig = LoRAConfig()  # rank >= 1: LoRA adapters on a frozen base (trainers.lora)
    dpo: DPOConfig = DPOConfig()  # read with run.objective=dpo (docs/post-training.md)

    def __post_init__(self) -> None:
        from spmd import get_rules

        get_rules(self.rules)
        if self.data.global_batch % self.run.grad_accum:
            raise ValueError(
                f"data.global_batch {self.data.global_batch} does not divide into run.grad_accum "
                f"{self.run.grad_accum} microbatches"
            )
        self.lr.for_run(self.run.steps)  # the schedule fits the run (lr.total_steps 0 is run.steps)
        if self.model.vocab_size < self.data.vocab_size:
            raise ValueError(f"model.vocab_size {self.model.vocab_size} < data.vocab_size {self.data.vocab_size}")
        # the config stage of the checks pass (local SGD's partners, the pipeline on mesh.axes' sizes), now:
        # ``spmd-train --set`` fails before any compile; an inferred (-1) axis skips the checks that need its size
        raise_first_fatal(check(self, stages=("config",)))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# Keys a resumed run may not change: the checkpoint's shapes (model), the data stream the saved position
# points into, the optimizer state's structure. Everything else (LR, steps, cadences, mesh, rules) may.
FIXED_ON_RESUME: tuple[str, ...] = ("model.", "data.corpus", "data.path", "data.seq_len", "data.vocab_size", "data.global_batch",
                   "data.seed", "data.validation_fraction", "data.max_tokens", "data.synthetic_tokens",
                   "data.tokenizer", "data.separator", "data.text_field", "data.fields", "data.packing", "data.truncate",
                   "optimizer.name", "run.objective", "dpo.pairs_per_row")
FIXED_ON_RESUME += ("lora.rank", "lora.targets", "lora.dropout")  # the adapters' shapes; dropout adds mask keys
# ...except these model keys, which change how the step runs, not what the checkpoint holds
FREE_ON_RESUME = ("model.scan_layers",)


def config_changes(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(dotted key, old value, new value)`` for every leaf that differs between two config dicts.

    A key the old dict lacks (written before the key existed) counts as the key's default."""
    def flat(node: Any, prefix: str = "") -> dict[str, Any]:
        if isinstance(node, Mapping):
            out: dict[str, Any] = {}
            for k, v in node.items():
                out.update(flat(v, f"{prefix}{k}."))
            return out
        return {prefix[:-1]: list(node) if isinstance(node, tuple) else node}

    a, b = flat(old), flat(new)
    defaults = flat(Config().to_dict())
    a.update({k: defaults[k] for k in b if k not in a and k in defaults})
    return [(k, a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


def fixed_on_resume(key: str) -> bool:
    """Whether a resumed run must keep ``key`` as its checkpoint was written with."""
    return key not in FREE_ON_RESUME and any(key == f or (f.endswith(".") and key.startswith(f)) for f in FIXED_ON_RESUME)


def changes_since_last_run(cfg: Config) -> list[tuple[str, Any, Any]]:
    """What differs from the config stored in the run directory. ValueError, before anything is
    written, when a checkpoint will be resumed and a change cannot be (model shapes, the data stream)."""
    directory = cfg.run.directory
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise ValueError(f"run.run_dir={directory!r} is a file, not a directory; give a directory path "
                         f"(e.g. runs/{cfg.run.name})")
    from trainers.logger import read_config

    previous = read_config(directory)
    if previous is None:
        return []
    changes = config_changes(previous, cfg.to_dict())
    ckpt_dir = cfg.checkpoint.resolve_directory(directory)
    resumes = cfg.run.resume and os.path.isdir(ckpt_dir) and any(n.isdigit() for n in os.listdir(ckpt_dir))
    refused = [c for c in changes if fixed_on_resume(c[0])] if resumes else []
    refused, content = _same_data(directory, previous, cfg, refused) if resumes else (refused, [])
    if content:
        raise ValueError(f"cannot resume {directory}: the data its checkpoints point into has changed since "
                         f"{os.path.join(directory, 'data_manifest.json')} recorded it (data.path={cfg.data.path!r}): "
                         f"{'; '.join(content)}. Restore those files, or start a new run with another run.run_dir")
    if refused:
        listed = "; ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in refused)
        raise ValueError(f"cannot resume {directory} with {listed}: its checkpoints were written with the values in "
                         f"{os.path.join(directory, 'config.json')}, which is left as it was. Keep those values, "
                         "or give another run.run_dir")
    return changes


def _same_data(directory: str, previous: Mapping[str, Any], cfg: Config,
               refused: list[tuple[str, Any, Any]]) -> tuple[list[tuple[str, Any, Any]], list[str]]:
    """``(refused changes, data files that changed)`` judged by what the data is rather than how it is spelled:
    ``data.packing`` is the same when both resolve to the same packing, ``data.path`` when the manifest the
    run recorded (:mod:`trainers.data.manifest`) matches the files now (which also catches files changed in place)."""
    from trainers.data import manifest as manifest_lib
    from trainers.data.config import DOCUMENT_CORPORA

    old_data = previous.get("data", {}) if isinstance(previous.get("data"), Mapping) else {}
    old_corpus = old_data.get("corpus", DataConfig().corpus)
    old_packing = old_data.get("packing") or ("segments" if old_corpus in DOCUMENT_CORPORA else "concat")
    refused = [c for c in refused if not (c[0] == "data.packing" and old_packing == cfg.data.packing_mode)]
    recorded = manifest_lib.recorded(directory)
    if recorded is None or recorded.get("corpus") != cfg.data.corpus:
        return refused, []  # a run from before manifests (or another corpus, refused by its key): as spelled
    content = manifest_lib.differences(recorded, cfg.data)
    if not content:
        refused = [c for c in refused if c[0] != "data.path"]  # the same bytes by another path
    return refused, content


def valid_keys(cfg: Any, prefix: str = "") -> list[str]:
    """Every overridable dotted key of a config."""
    keys = []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            keys += valid_keys(value, f"{prefix}{f.name}.")
        else:
            keys.append(f"{prefix}{f.name}")
    return keys


def _parse(text: str, annotation: Any, key: str) -> Any:
    """Parse ``text`` as a value of type ``annotation`` (int, float, bool, str, tuple, optional)."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if text.lower() in ("none", "null") and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _parse(text, arg, key)
            except ValueError as e:
                errors.append(str(e))
        raise ValueError(f"{key}={text!r}: " + "; ".join(errors))
    if annotation is bool:
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{key}={text!r} is not a boolean (true/false)")
    if annotation is int:
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"{key}={text!r} is not an integer") from None
    if annotation is float:
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"{key}={text!r} is not a number") from None
    if origin is tuple:
        items = json.loads(text) if text.startswith("[") else [t for t in text.split(",") if t]
        return tuple(str(i) for i in items)
    return text


def override(cfg: Config, assignments: Iterable[str]) -> Config:
    """Apply ``section.field=value`` overrides; unknown keys and bad values raise ValueError.

    All overrides are applied together before any validation, so their order does not matter
    (``run.steps=4 lr.warmup_steps=1`` is as good as the reverse).
    """
    keys = valid_keys(cfg)
    tree: dict[str, Any] = {}
    for item in assignments:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep:
            raise ValueError(f"override {item!r} is not of the form key=value (e.g. model.d_model=256)")
        if key not in keys:
            raise ValueError(_unknown_key(key, keys))
        node = tree
        *parents, leaf = key.split(".")
        for name in parents:
            node = node.setdefault(name, {})
        node[leaf] = (text.strip(), key)
    return _apply(cfg, tree)


def _unknown_key(key: str, keys: list[str]) -> str:
    """'unknown config key' with the closest keys, then the valid keys one section per line."""
    close = [k for k in keys if k.split(".")[-1] == key.split(".")[-1]]
    close += [k for k in difflib.get_close_matches(key, keys, n=3, cutoff=0.6) if k not in close]
    hint = f"; did you mean {' or '.join(close)}?" if close else ""
    sections: dict[str, list[str]] = {}
    for k in keys:
        section, _, rest = k.partition(".")
        sections.setdefault(section if rest else "", []).append(rest or k)
    lines = [f"  {name}.{{{', '.join(names)}}}" if name else f"  {', '.join(names)}" for name, names in sections.items()]
    return f"unknown config key {key!r}{hint}\nValid keys:\n" + "\n".join(lines)


def _apply(node: Any, changes: dict[str, Any]) -> Any:
    hints = typing.get_type_hints(type(node))
    values = {}
    for name, change in changes.items():
        if isinstance(change, dict):
            values[name] = _apply(getattr(node, name), change)
        else:
            text, key = change
            values[name] = _parse(text, hints[name], key)
    try:
        return dataclasses.replace(node, **values)
    except (ValueError, TypeError) as e:
        changed = ", ".join(f"{k}" for k in changes)
        raise ValueError(f"bad value among overrides of {type(node).__name__} ({changed}): {e}") from None
