"""``mesh.axes="auto"``: the planner picks the layout for the devices the run has.

    cfg = resolve_auto(override(recipe("gpt-small"), ["mesh.axes=auto"]))  # then train(cfg)
    spmd-train gpt-small --simulate-devices 8 --mesh auto

:func:`choose_layout` plans for this backend's devices and hardware (:func:`detect_hardware`),
compiles the top picks (abstract state) and takes the fastest that fits when compiled; the runner-up
is kept to say why. Mesh, rule set and remat policy are chosen unless fixed (``rules``, ``remat``).
A run directory that already holds a checkpoint keeps the layout its ``config.json`` records.
"""

from __future__ import annotations

import dataclasses
import os

import jax

from spmd.units import fmt_bytes, fmt_seconds
from trainers.config import AUTO, Config
from trainers.logger import read_config
from trainers.planning.confirm import confirm_picks
from trainers.planning.hardware import HARDWARE, get_hardware
from trainers.planning.planner import Estimate, Plan, plan


def detect_hardware(device: jax.Device | None = None) -> str:
    """The :data:`trainers.planning.hardware.HARDWARE` name of ``device`` (default: this backend's first), by its kind."""
    device = device or jax.devices()[0]
    if device.platform == "cpu":
        return "cpu"
    kind = device.device_kind.lower().replace(" ", "")
    for name in ("h200", "h100", "a100", "tpuv5p", "tpuv5lite", "tpuv5e", "tpuv4"):
        if name in kind:
            return {"tpuv5p": "tpu-v5p", "tpuv5lite": "tpu-v5e", "tpuv5e": "tpu-v5e", "tpuv4": "tpu-v4"}.get(name, name)
    raise ValueError(f"mesh.axes='auto' cannot tell the hardware of device kind {device.device_kind!r}; known: "
                     f"{', '.join(HARDWARE)}: pass hardware= (spmd-train --hardware) or give mesh.axes explicitly")


@dataclasses.dataclass(frozen=True)
class AutoChoice:
    """The planner's pick for a run: ``config`` (``cfg`` with it), the pick and the runner-up, the whole plan."""

    config: Config
    chosen: Estimate | None  # None: kept from the run directory's config.json
    runner_up: Estimate | None
    plan: Plan | None
    note: str = ""

    def describe(self) -> str:
        """What was chosen and why, in a few lines."""
        if self.chosen is None:
            return f"mesh auto: {self.note}"
        lines = [f"mesh auto: chose {self.chosen.layout} for {self.plan.devices} devices of {self.plan.hardware.name}: "
                 f"{_figures(self.chosen)}; the fastest of {len(self.plan.ranked)} layouts that fit, confirmed by "
                 f"compiling it"]
        if self.runner_up is not None:
            lines.append(f"  runner-up {self.runner_up.layout}: {_figures(self.runner_up)}")
        else:
            lines.append("  no runner-up: no other layout fits when compiled")
        lines.append(f"  as flags: {self.chosen.layout.command(self.config)}")
        return "\n".join(lines)


def _figures(e: Estimate) -> str:
    return (f"estimated step {fmt_seconds(e.roofline.step_s)}, {fmt_bytes(e.memory.total)} per device, "
            f"MFU {e.roofline.mfu:.1%}")


def choose_layout(cfg: Config, *, devices: int | None = None, hardware: str | None = None, task=None,
                  rules: str | None = None, remat: bool | str | None = None) -> AutoChoice:
    """The fastest compile-confirmed layout of ``cfg`` for ``devices`` (default: this backend's) of
    ``hardware`` (default: :func:`detect_hardware`); ``rules`` / ``remat`` fix the rule set / policy."""
    devices = jax.device_count() if devices is None else devices
    hw = get_hardware(hardware or detect_hardware())
    base = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, axes="data=-1"))
    result = plan(base, devices, hw, task=task, nearest=1)
    ranked = [e for e in result.ranked if (rules is None or e.layout.rules == rules)
              and (remat is None or _same_remat(e.layout.remat, remat))]
    if ranked:
        result = dataclasses.replace(result, ranked=tuple(ranked), **confirm_picks(
            base, ranked, 2, devices, hw, result.budget / hw.hbm_bytes, task if isinstance(task, str) else None))
    if not result.confirmed:
        fixed = ", ".join(f"{k} {v!r}" for k, v in (("rules", rules), ("remat", remat)) if v is not None)
        why = result.why_none() if result.compiled or not result.ranked else ""
        raise ValueError(f"mesh.axes='auto': no layout of {devices} devices of {hw.name}"
                         + (f" with {fixed}" if fixed else "") + " fits when compiled"
                         + (f": {why}" if why else "") + (" (leave them to the planner, or give mesh.axes explicitly)"
                                                          if fixed else ""))
    chosen, *rest = result.confirmed
    return AutoChoice(chosen.layout.apply(base), chosen, rest[0] if rest else None, result)


def _same_remat(a: bool | str | None, b: bool | str) -> bool:
    policy: dict[bool | str | None, str] = {False: "none", True: "full"}
    return policy.get(a, a) == policy.get(b, b)


def resolve_auto(cfg: Config, *, devices: int | None = None, hardware: str | None = None, task=None,
                 rules: str | None = None, remat: bool | str | None = None, say=print) -> Config:
    """``cfg`` with ``mesh.axes="auto"`` replaced by the planner's pick (:func:`choose_layout`; ``say``
    prints why), or by the layout recorded in the run directory when it resumes a checkpoint; any
    other ``cfg`` unchanged."""
    if cfg.mesh.axes != AUTO:
        return cfg
    recorded = _recorded(cfg)
    if recorded is not None:
        choice = AutoChoice(recorded, None, None, None, f"resuming {cfg.run.run_dir} with the layout its config.json "
                            f"records: mesh {recorded.mesh.axes}, rules {recorded.rules}, remat "
                            f"{recorded.model.policy}")
    else:
        choice = choose_layout(cfg, devices=devices, hardware=hardware, task=task, rules=rules, remat=remat)
    say(choice.describe())
    return choice.config


def _recorded(cfg: Config) -> Config | None:
    """``cfg`` with the layout of the run directory's config.json, when the run resumes a checkpoint there."""
    directory = cfg.run.run_dir
    if not (cfg.run.resume and directory and os.path.isdir(directory)):
        return None
    ckpt = cfg.checkpoint.resolve_directory(directory)
    previous = read_config(directory)
    if previous is None or not (os.path.isdir(ckpt) and any(n.isdigit() for n in os.listdir(ckpt))):
        return None
    mesh, model, pipe = previous.get("mesh", {}), previous.get("model", {}), previous.get("pipeline", {})
    if mesh.get("axes", AUTO) == AUTO:
        return None
    return dataclasses.replace(
        cfg, mesh=dataclasses.replace(cfg.mesh, axes=mesh["axes"]), rules=previous.get("rules", cfg.rules),
        model=dataclasses.replace(cfg.model, remat=bool(model.get("remat", cfg.model.remat)),
                                  remat_policy=model.get("remat_policy", cfg.model.remat_policy)),
        pipeline=dataclasses.replace(cfg.pipeline, **{k: pipe[k] for k in ("schedule", "microbatches", "virtual_stages")
                                                      if k in pipe}))
