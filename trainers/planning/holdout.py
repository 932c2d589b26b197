"""Leave-one-source-out accuracy of the step-time model on the published runs.

The model's compute efficiencies (``Hardware.matmul_eff`` and ``attention_eff``) carry one fitted
scale per hardware family (GPU, TPU): the scale, on a grid, that minimises the squared log ratio of
estimated to published tokens/s over the runs it is fitted on. **Fitted**: the scale fitted on every
run; **held out**: for each source (a benchmark table, a paper), the scale fitted without that
source's runs, then that source's runs estimated with it. A source whose family has no other runs
keeps the constants as set (scale 1). Table: docs/calibration.md; ``python -m trainers.planning.holdout``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from trainers.planning.calibration import RATIO_BOUNDS, RUNS, PublishedRun
from trainers.planning.costs import layout_costs
from trainers.planning.hardware import Hardware, get_hardware

GRID = tuple(round(0.70 + 0.02 * i, 2) for i in range(31))  # candidate scales, 0.70 ... 1.30


def source_of(run: PublishedRun) -> str:
    """The source a run is grouped by: one benchmark table or paper (its repository and file)."""
    s = run.source.lower()
    for key, name in (("llama3_h100", "torchtitan H100 table"), ("torchtitan", "torchtitan A100 table"),
                      ("v5p", "MaxText v5p table"), ("v5e", "MaxText v5e table"), ("llm-foundry", "llm-foundry MPT table")):
        if key in s:
            return name
    return run.source


def family(hardware: str) -> str:
    """``"tpu"`` or ``"gpu"``: the runs one scale is fitted over."""
    return "tpu" if hardware.startswith("tpu") else "gpu"


def scaled(hw: Hardware, scale: float) -> Hardware:
    """``hw`` with its matmul and attention efficiencies times ``scale`` (at most 1)."""
    return dataclasses.replace(hw, matmul_eff=min(1.0, hw.matmul_eff * scale),
                               attention_eff=min(1.0, hw.attention_eff * scale))


def ratio(run: PublishedRun, scale: float = 1.0) -> float:
    """Estimated / published tokens/s per device of ``run`` in its published layout, efficiencies x ``scale``."""
    cfg = run.config()
    costs = layout_costs(cfg, run.sizes, scaled(get_hardware(run.hardware), scale))
    if costs.roofline is None:
        raise ValueError(f"published run {run.name!r} does not build: {[str(i) for i in costs.issues if i.fatal]}")
    tokens = cfg.data.global_batch * cfg.data.seq_len / costs.roofline.step_s / run.devices
    return tokens / run.tokens_per_device


@dataclasses.dataclass(frozen=True)
class Holdout:
    """One run: its source, the fitted ratio and scale (all runs), the held-out ratio and scale (its source left out)."""

    run: PublishedRun
    source: str
    fitted: float
    fitted_scale: float
    held_out: float
    held_out_scale: float


def fit(ratios: dict[str, dict[float, float]], names: Sequence[str]) -> float:
    """The grid scale minimising the squared log ratios of ``names`` (1.0 when there are none)."""
    if not names:
        return 1.0
    return min(GRID, key=lambda s: (sum(math.log(ratios[n][s]) ** 2 for n in names), abs(s - 1)))


def leave_one_source_out(runs: Sequence[PublishedRun] = RUNS) -> list[Holdout]:
    """Every run's fitted and held-out ratio (see the module docstring)."""
    ratios = {r.name: {s: ratio(r, s) for s in GRID} for r in runs}
    sources = {r.name: source_of(r) for r in runs}
    fams = {r.name: family(r.hardware) for r in runs}
    out = []
    for r in runs:
        same = [x.name for x in runs if fams[x.name] == fams[r.name]]
        s_all = fit(ratios, same)
        s_out = fit(ratios, [n for n in same if sources[n] != sources[r.name]])
        out.append(Holdout(r, sources[r.name], ratios[r.name][s_all], s_all, ratios[r.name][s_out], s_out))
    return out


def table(rows: Sequence[Holdout] | None = None) -> str:
    """The leave-one-source-out table in markdown."""
    rows = leave_one_source_out() if rows is None else rows
    lo, hi = RATIO_BOUNDS
    out = ["| run | source | fitted ratio (scale) | held-out ratio (scale without the source) | held out in bounds |",
           "|---|---|---|---|---|"]
    for h in rows:
        ok = "yes" if lo <= h.held_out <= hi else "NO"
        out.append(f"| {h.run.name} | {h.source} | {h.fitted:.2f} ({h.fitted_scale:.2f}) | "
                   f"{h.held_out:.2f} ({h.held_out_scale:.2f}) | {ok} |")
    return "\n".join(out)


if __name__ == "__main__":
    print(table())
