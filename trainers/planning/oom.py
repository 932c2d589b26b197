"""Out of device memory at start-up: the run's memory estimate and the nearest layout that fits.

    raise OutOfMemoryError(explain(cfg, n_devices, device_kind, error))

The estimate is the planner's model of the built-in GPT (docs/memory.md) for the run's mesh; the
nearest change is the fitting layout of :func:`trainers.planning.plan` that differs from the run's
in the fewest of mesh, rule set, remat and pipeline (ties: the faster one), given as ``spmd-train`` flags.
"""

from __future__ import annotations

from spmd.units import fmt_bytes
from trainers.config import Config
from trainers.planning.costs import memory_estimate
from trainers.planning.hardware import HARDWARE, Hardware
from trainers.planning.planner import plan

# device_kind substrings -> HARDWARE names, most specific first
_KINDS = (("h200", "h200"), ("h100", "h100"), ("a100", "a100"), ("v5p", "tpu-v5p"), ("v5 lite", "tpu-v5e"),
          ("v5e", "tpu-v5e"), ("v4", "tpu-v4"))


class OutOfMemoryError(ValueError):
    """The run's state or step does not fit the devices: a configuration problem, with the estimate and a fix."""


def is_oom(exc: BaseException) -> bool:
    """Whether ``exc`` is XLA running out of device memory."""
    text = str(exc)
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def hardware_of(device_kind: str) -> Hardware | None:
    """The :data:`trainers.planning.hardware.HARDWARE` entry of a ``jax.Device.device_kind`` (None: unknown or CPU)."""
    kind = device_kind.lower()
    return next((HARDWARE[name] for key, name in _KINDS if key in kind), None)


def explain(cfg: Config, n_devices: int, device_kind: str, error: BaseException | str, *,
            hardware: Hardware | None = None, target: str = "TARGET") -> str:
    """``out of device memory: <XLA's first line>``, the per-device estimate of ``cfg`` on ``n_devices``
    and, on known hardware, the nearest layout that fits (flags to add)."""
    first = next((line for line in str(error).splitlines() if line.strip()), type(error).__name__)
    sizes = cfg.mesh.sizes(n_devices)
    mem = memory_estimate(cfg, sizes)
    hw = hardware or hardware_of(device_kind)
    lines = [f"out of device memory: {first}",
             f"  estimated per device on mesh {cfg.mesh.axes} ({n_devices} devices): {fmt_bytes(mem.total)} = params "
             f"{fmt_bytes(mem.params)} + optimizer {fmt_bytes(mem.optimizer)} + gradients {fmt_bytes(mem.grads)} + "
             f"activations {fmt_bytes(mem.activations)} + batch {fmt_bytes(mem.batch)}"
             + (f", of {fmt_bytes(hw.hbm_bytes)} on {hw.name}" if hw else "")]
    picks = plan(cfg, n_devices, hw, nearest=0).ranked if hw else ()
    if picks:
        here = {a: s for a, s in sizes.items() if s > 1}
        remat = cfg.model.remat_policy or cfg.model.remat

        def distance(e) -> int:
            layout = e.layout
            return ((({a: s for a, s in layout.sizes.items() if s > 1}) != here) + (layout.rules != cfg.rules)
                    + (layout.remat not in (None, remat)) + (layout.schedule != cfg.pipeline.schedule))

        best = min(picks, key=distance)  # ranked by step time, so ties keep the faster
        lines.append(f"  nearest layout that fits: {best.layout.command(cfg)} ({fmt_bytes(best.memory.total)} per "
                     f"device); spmd-plan {target} --devices {n_devices} --hardware {hw.name} ranks the others")
    else:
        lines.append(f"  what lowers it: --set model.remat_policy=full (recompute activations), a larger fsdp axis "
                     f"(--mesh fsdp=-1), a smaller data.global_batch or run.grad_accum > 1; check with "
                     f"--dry-run --devices {n_devices} --hardware H")
    return "\n".join(lines)
