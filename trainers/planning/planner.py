"""``spmd-plan TARGET --devices N --hardware H``: which layout to run, decided before the pod.

Enumerates layouts (``data x pipe x fsdp x seq x expert x tensor``, rule sets, every schedule of
``spmd.pipeline.NAMES``, remat policies least recompute first until one fits), estimates each analytically (:mod:`trainers.planning.costs`), drops those that
cannot be built or whose accelerator memory model exceeds the budget, ranks the rest by estimated step
time, and with ``confirm=k`` compiles the top picks (:mod:`trainers.planning.confirm`), keeping the first
k that fit. With no valid layout it names the blockers and the nearest workable device counts
(:mod:`trainers.planning.blockers`). See docs/planning.md.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import warnings
from collections.abc import Iterator

import spmd
from meshes import AXES
from spmd import pipeline as pipeline_lib
from spmd import remat as remat_lib
from spmd.pipeline import PipelineConfig
from spmd.units import fmt_bytes
from trainers.checks import Issue, buildable, check, first_fatal
from trainers.config import Config
from trainers.planning.blockers import blockers, device_splits, workable_counts
from trainers.planning.confirm import confirm_picks
from trainers.planning.costs import MemoryEstimate, Roofline, Traffic, layout_costs
from trainers.planning.hardware import Hardware, get_hardware
from trainers.planning.profile import TaskProfile, profile_task
from trainers.planning.report import DryRunReport, counts_text, format_plan, layer_stack
from trainers.task import Task, load_task

# rule set -> (mesh axes it needs > 1, axes it may also use): one candidate per distinct layout. Every
# rule set also splits the length over seq (context parallelism), so seq is open to each of them.
RULE_AXES = {"dp": (("data",), ()), "fsdp": (("fsdp",), ("data",)), "tp": (("tensor",), ()),
             "dp_tp": (("data", "tensor"), ()), "fsdp_tp": (("fsdp", "tensor"), ("data",)),
             "dp_tp_sp": (("data", "tensor"), ()), "fsdp_tp_sp": (("fsdp", "tensor"), ("data",)),
             "dp_ep": (("expert",), ("data",)), "fsdp_ep": (("fsdp", "expert"), ("data",)),
             "fsdp_tp_ep": (("fsdp", "tensor", "expert"), ("data",))}


@dataclasses.dataclass(frozen=True)
class Layout:
    """One way to run a config: mesh axis sizes (outermost first), rule set, remat (``True`` /
    ``False``: ``model.remat``; a :mod:`spmd.remat` policy name: ``model.remat_policy``; None: not
    a choice, a task's model decides), and with a ``pipe`` axis > 1 the pipeline schedule,
    microbatches M and virtual stages V."""

    mesh: tuple[tuple[str, int], ...]
    rules: str
    remat: bool | str | None
    schedule: str = "none"
    microbatches: int = 1
    virtual_stages: int = 1

    def __post_init__(self) -> None:
        for name, size in self.mesh:
            if name not in AXES or size < 1:
                raise ValueError(f"Layout mesh entry {name}={size}: axes are {AXES}, sizes >= 1")
        spmd.get_rules(self.rules)
        if self.remat is not None:
            remat_lib.resolve(self.remat)
        self.pipeline  # validates schedule, microbatches and virtual stages
        if (self.pipe > 1) != (self.schedule != "none"):
            raise ValueError(f"Layout with pipe={self.pipe} and pipeline schedule {self.schedule!r}: a pipe axis > 1 "
                             f"needs a schedule ({', '.join(pipeline_lib.NAMES)}), and schedule 'none' needs pipe=1")

    @property
    def pipe(self) -> int:
        return self.sizes.get("pipe", 1)

    @property
    def pipeline(self) -> PipelineConfig:
        return PipelineConfig(self.schedule, self.microbatches, self.virtual_stages)

    def _pipeline_sets(self) -> list[str]:
        return [f"pipeline.schedule={self.schedule}", f"pipeline.microbatches={self.microbatches}",
                f"pipeline.virtual_stages={self.virtual_stages}"]

    @property
    def sizes(self) -> dict[str, int]:
        return dict(self.mesh)

    @property
    def mesh_arg(self) -> str:
        return ",".join(f"{n}={s}" for n, s in self.mesh if s > 1) or "data=1"

    def _remat_sets(self) -> list[str]:
        if self.remat is None:
            return []
        if isinstance(self.remat, str):
            return [f"model.remat_policy={self.remat}"]
        return [f"model.remat={str(self.remat).lower()}", "model.remat_policy="]  # a policy in the base would win

    def overrides(self) -> list[str]:
        remat = self._remat_sets()
        return [f"mesh.axes={self.mesh_arg}", f"rules={self.rules}", *remat, *self._pipeline_sets()]

    def apply(self, cfg: Config) -> Config:
        """``cfg`` run with this layout (the config ``override(cfg, self.overrides())`` gives, built directly)."""
        model = cfg.model
        if isinstance(self.remat, str):
            model = dataclasses.replace(model, remat_policy=self.remat)
        elif self.remat is not None:
            model = dataclasses.replace(model, remat=self.remat, remat_policy="")
        return dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, axes=self.mesh_arg), rules=self.rules,
                                   model=model, pipeline=dataclasses.replace(
                                       cfg.pipeline, schedule=self.schedule, microbatches=self.microbatches,
                                       virtual_stages=self.virtual_stages))

    def command(self, base: Config | None = None) -> str:
        """The ``spmd-train`` flags of this layout (pipeline settings when it pipelines, or when ``base`` does)."""
        out = f"--mesh {self.mesh_arg} --rules {self.rules}"
        if isinstance(self.remat, str):
            out += f" --set model.remat_policy={self.remat}"
        elif self.remat is not None:
            out += f" --set model.remat={str(self.remat).lower()}"
            if base is not None and base.model.remat_policy:
                out += " --set model.remat_policy="
        if self.pipe > 1:
            out += "".join(f" --set {s}" for s in self._pipeline_sets())
        elif base is not None and base.pipeline.enabled:
            out += " --set pipeline.schedule=none --set pipeline.virtual_stages=1"
        return out

    def __str__(self) -> str:
        pp = ""
        if self.pipe > 1:
            pp = f" {self.schedule} M={self.microbatches}" + (f" V={self.virtual_stages}" if self.virtual_stages > 1 else "")
        remat = f" remat={self.remat}" if isinstance(self.remat, str) else " remat" if self.remat else ""
        return f"{self.mesh_arg} {self.rules}{pp}{remat}"


@dataclasses.dataclass(frozen=True)
class Estimate:
    layout: Layout
    memory: MemoryEstimate | None
    traffic: tuple[Traffic, ...]
    roofline: Roofline | None
    budget: float
    issues: tuple[Issue, ...]

    @property
    def buildable(self) -> bool:
        return buildable(self.issues)

    @property
    def fits(self) -> bool:
        return self.buildable and self.memory is not None and self.memory.total <= self.budget

    @property
    def reason(self) -> str:
        if not self.buildable:
            return str(first_fatal(self.issues))
        if not self.fits:
            return f"needs {fmt_bytes(self.memory.total)} per device > budget {fmt_bytes(self.budget)}"
        return f"dominant cost: {self.roofline.dominant}"


def estimate_layout(cfg: Config, layout: Layout, hardware: str | Hardware, *, headroom: float | None = None,
                    task: Task | TaskProfile | None = None, issues: tuple[Issue, ...] | None = None) -> Estimate:
    """The analytic estimate of ``cfg`` run with ``layout`` on ``hardware``: the built-in GPT's
    formulas, or with ``task`` (a Task or its :class:`~trainers.planning.profile.TaskProfile`) any model's.
    ``issues``: the layout checks' result for this mesh and rule set, when known (they do not read remat)."""
    hw = get_hardware(hardware)
    headroom = hw.headroom if headroom is None else headroom
    sizes = {a: layout.sizes.get(a, 1) for a in ("data", "pipe", "fsdp", "seq", "expert", "tensor")}
    budget = headroom * hw.hbm_bytes
    if layout.pipe > 1 and issues is None:  # the pipeline's own checks, as Issues (the config refuses to build on the first)
        piped = [i for i in check(cfg, stages=("layout",), mesh_shape=sizes, rules=layout.rules,
                                  pipeline=layout.pipeline, select=("pipeline",)) if i.fatal]
        if piped:
            return Estimate(layout, None, (), None, budget, tuple(piped))
    try:
        run = layout.apply(cfg)
    except ValueError as e:  # the config's own checks (e.g. a pipeline microbatch that does not split)
        return Estimate(layout, None, (), None, budget, (Issue("config", "config", None, str(e), "", fatal=True,
                                                                stage="config"),))
    profile = task if task is None or isinstance(task, TaskProfile) else profile_task(task, cfg)
    costs = layout_costs(run, sizes, hw, profile=profile, issues=issues)
    return Estimate(layout, costs.memory, costs.traffic, costs.roofline, budget, costs.issues)


def __getattr__(name: str) -> object:
    if name == "estimate":  # the old name of estimate_layout
        warnings.warn("trainers.planning.planner.estimate is now estimate_layout", DeprecationWarning, stacklevel=2)
        return estimate_layout
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _factorisations(n: int, k: int) -> Iterator[tuple[int, ...]]:
    if k == 1:
        yield (n,)
        return
    for a in range(1, n + 1):
        if n % a == 0:
            for rest in _factorisations(n // a, k - 1):
                yield (a,) + rest


@functools.lru_cache(maxsize=4096)
def _schedule_builds(name: str, S: int, M: int, V: int) -> bool:
    try:
        pipeline_lib.get_schedule(name, S, M, V)
    except ValueError:
        return False
    return True


def pipeline_options(pipe: int, n_layers: int, batch: int, names: tuple[str, ...] | None = None) -> list[tuple[str, int, int]]:
    """``(schedule, M, V)`` tried on a pipe axis of this size: every schedule of ``names`` (default
    ``spmd.pipeline.NAMES``, read when called) with M in ``{pipe, 2 pipe, 4 pipe}`` dividing ``batch``;
    V=2 for a schedule that accepts two chunks per stage (where the layers split into ``2 x pipe``), else V=1;
    only the (name, M, V) whose table builds (e.g. interleaved needs M a multiple of pipe)."""
    if pipe == 1:
        return [("none", 1, 1)]
    out = []
    for M in (pipe, 2 * pipe, 4 * pipe):
        if batch % M:
            continue
        for name in names if names is not None else pipeline_lib.NAMES:
            multi = _schedule_builds(name, pipe, pipe, 2)  # the schedule runs V > 1 chunks per stage
            V = 2 if multi else 1
            if n_layers % (pipe * V) == 0 and _schedule_builds(name, pipe, M, V):
                out.append((name, M, V))
    return out


def candidates(devices: int, *, remat: tuple[bool | str | None, ...] = (False, True), n_layers: int | None = None,
               batch: int | None = None, seq_len: int | None = None, n_experts: int = 0) -> list[Layout]:
    """Every (data, pipe, fsdp, seq, expert, tensor) factorisation of ``devices`` with each rule set using
    exactly the axes other than pipe and seq; pipe > 1 only with ``n_layers`` (a divisor of it) and
    ``batch`` (M must divide it); seq > 1 only with ``seq_len`` a multiple of 2 x seq; expert > 1 only
    with ``n_experts`` a multiple of it (the ``*_ep`` rule sets); both also with a pipe."""
    if not isinstance(devices, int) or isinstance(devices, bool) or devices < 1:
        raise ValueError(f"devices must be a positive integer, got {devices!r}")
    for name, value in (("n_layers", n_layers), ("batch", batch), ("seq_len", seq_len)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
    if not isinstance(n_experts, int) or n_experts < 0:
        raise ValueError(f"n_experts must be an integer >= 0, got {n_experts!r}")
    out = []
    for d, p, f, s, e, t in _factorisations(devices, 6):
        if p > 1 and (n_layers is None or batch is None or n_layers % p):
            continue
        if s > 1 and (seq_len is None or seq_len % (2 * s)) or e > 1 and (not n_experts or n_experts % e):
            continue
        rest = devices // (p * s)
        used = {a for a, size in {"data": d, "fsdp": f, "expert": e, "tensor": t}.items() if size > 1}
        for (rules, (need, may)), r in itertools.product(RULE_AXES.items(), remat):
            if rest > 1 and not (set(need) <= used <= set(need) | set(may)):
                continue
            if rest == 1 and rules != "dp":
                continue
            mesh = tuple((a, n) for a, n in (("data", d), ("pipe", p), ("fsdp", f), ("seq", s), ("expert", e),
                                             ("tensor", t)) if n > 1 or a not in ("seq", "expert"))
            for schedule, M, V in pipeline_options(p, n_layers or 1, batch or 1):
                out.append(Layout(mesh, rules, r, schedule, M, V))
    return out


@dataclasses.dataclass(frozen=True)
class Plan:
    """Every layout estimated: ``ranked`` (fit the budget, fastest first) and ``rejected``; with compile
    confirmation, ``compiled`` holds the dry runs of the picks tried in rank order and ``confirmed`` the
    estimates of those that fit; with nothing valid, ``blockers`` and the nearest workable counts."""

    devices: int
    hardware: Hardware
    ranked: tuple[Estimate, ...]  # fitting layouts, fastest first
    rejected: tuple[Estimate, ...]
    budget: float = 0.0  # bytes per device a layout may use (headroom x HBM)
    compiled: tuple[DryRunReport, ...] = ()  # the dry runs of the picks tried, in rank order
    confirmed: tuple[Estimate, ...] = ()  # the picks whose compile fits, in rank order
    blockers: tuple[str, ...] = ()  # why no factorisation of `devices` is valid (empty when some is)
    nearest: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())  # workable device counts (below, above)
    layer_stack: str = ""  # how the built-in GPT's blocks run on the hardware (report.layer_stack); "" for a task

    @property
    def picks(self) -> tuple[Estimate, ...]:
        """What to print as choices: the compile-confirmed picks when compiles ran, else the analytic ranking."""
        return self.confirmed if self.compiled else self.ranked

    @property
    def best(self) -> Estimate:
        if not self.picks:
            raise ValueError(self.why_none())
        return self.picks[0]

    def why_none(self) -> str:
        """One paragraph: why no layout is chosen (blockers, memory, or compiles that did not fit)."""
        if self.ranked and self.compiled:
            tried = "; ".join(f"{e.layout}: " + (f"compile failed: {r.error}" if r.error else fmt_bytes(r.peak_bytes))
                              for e, r in zip(self.ranked, self.compiled))
            return (f"none of the {len(self.compiled)} compiled picks for {self.devices} devices fits "
                    f"{self.hardware.name} (budget {fmt_bytes(self.budget)}): {tried}")
        head = f"no layout of {self.devices} devices fits {self.hardware.name} (budget {fmt_bytes(self.budget)})"
        lines = [f"{head}: " + "; ".join(self.blockers)] if self.blockers else [head]
        below, above = self.nearest
        if below or above:
            lines.append(f"nearest device counts with a layout that fits: {counts_text(below, 'below')}, "
                         f"{counts_text(above, 'above')}")
        return "\n".join(lines)

    def format(self, top: int = 5) -> str:
        """The ranking as text: the picks (compiled ones with their compiled footprint), rejections grouped
        by reason, blockers and nearest counts when nothing is valid (:func:`report.format_plan`)."""
        return format_plan(self, top)


def plan(cfg: Config, devices: int, hardware: str | Hardware, *, headroom: float | None = None,
         task: Task | str | TaskProfile | None = None, confirm: int = 0, task_name: str | None = None,
         nearest: int = 1) -> Plan:
    """Estimate every candidate layout; the fitting ones ranked by estimated step time.

    ``task`` (a Task, its ``"package.module:attribute"`` name or its profile; None: ``cfg``'s
    built-in GPT) is profiled once and estimated on ``data x fsdp x tensor`` layouts (see the
    module docstring). ``confirm=k`` compiles the picks in rank order until k fit (at most 3k
    compiles; a task is compiled from ``task_name``, or ``task`` when it is a Task or a name).
    With no valid layout (the built-in GPT): ``blockers`` and the ``nearest`` workable device
    counts below and above whose analytic plan has a fitting layout. ``headroom``: the share of HBM a
    layout may use (default the hardware's :attr:`~trainers.planning.hardware.Hardware.headroom`)."""
    hw = get_hardware(hardware)
    headroom = hw.headroom if headroom is None else headroom
    if not 0 < headroom <= 1:
        raise ValueError(f"headroom must be in (0, 1], got {headroom!r}")
    if not isinstance(confirm, int) or confirm < 0:
        raise ValueError(f"confirm must be an integer >= 0 (picks to compile), got {confirm!r}")
    if task is None:
        profile = None
        layouts = candidates(devices, remat=(None,), n_layers=cfg.model.n_layers, seq_len=cfg.data.seq_len,
                             batch=cfg.data.global_batch // cfg.run.grad_accum, n_experts=cfg.model.n_experts)
        estimates = [e for layout in layouts for e in remat_ladder(cfg, layout, hw, headroom)]
    else:
        profile = task if isinstance(task, TaskProfile) else profile_task(
            load_task(task) if isinstance(task, str) else task, cfg)
        # a task's model annotates what it annotates: the plain rule sets only (no SP / EP presets)
        layouts = [c for c in candidates(devices, remat=(None,)) if not c.rules.endswith(("_sp", "_ep"))]
        estimates = [estimate_layout(cfg, layout, hw, headroom=headroom, task=profile) for layout in layouts]
    ranked = sorted((e for e in estimates if e.fits), key=lambda e: (e.roofline.step_s, e.memory.total))
    rejected = sorted((e for e in estimates if not e.fits), key=lambda e: e.memory.total if e.memory else math.inf)
    result = Plan(devices, hw, tuple(ranked), tuple(rejected), headroom * hw.hbm_bytes,
                  layer_stack=layer_stack(cfg.model, hw) if task is None else "")
    if not ranked and task is None and nearest:
        result = dataclasses.replace(result, **_explain(cfg, devices, hw, headroom, nearest, rejected))
    if confirm and ranked:
        result = dataclasses.replace(result, **confirm_picks(cfg, ranked, confirm, devices, hw, headroom,
                                                        task_name or (task if isinstance(task, (str, Task)) else None)))
    return result


# spmd.remat policies the planner tries, least recompute first (False: none, True: full); offload is left
# out (the host transfers it adds are not in the step-time model), save_block_input is full's alias
REMAT_LADDER: tuple[bool | str, ...] = (False, "save_all_but_gathered", "save_dots", True)


def remat_ladder(cfg: Config, layout: Layout, hw: Hardware, headroom: float) -> list[Estimate]:
    """``layout`` estimated under each policy of :data:`REMAT_LADDER` in turn until one fits: that one
    is the layout's fastest (each later policy recomputes more); the ones before it are rejected by
    the memory model, and the ones after it are not estimated. A layout that cannot be built at all
    is estimated once."""
    out: list[Estimate] = []
    for remat in REMAT_LADDER:  # the layout checks run once: the policy changes none of them
        e = estimate_layout(cfg, dataclasses.replace(layout, remat=remat), hw, headroom=headroom,
                            issues=out[0].issues if out else None)
        out.append(e)
        if e.fits or not e.buildable:
            break
    return out


def _explain(cfg: Config, devices: int, hw: Hardware, headroom: float, n: int, rejected: list[Estimate]) -> dict:
    """The blockers of ``devices`` and the nearest counts (up to 3 tried each way) with a layout that fits.
    Where every factorisation is ruled out by memory alone, the blocker is the least memory needed, and
    only larger counts are tried (fewer devices hold more per device)."""
    splits = device_splits(cfg)
    found = blockers(cfg, devices, splits)
    below, above = workable_counts(cfg, devices, splits, n=3 * n)
    least = next((e for e in rejected if e.buildable), None)
    if not found and least is not None:
        found, below = [f"memory: every buildable layout needs more than the budget; the least, {least.layout}, needs "
                        f"{fmt_bytes(least.memory.total)} per device > {fmt_bytes(least.budget)}"], ()
    fitting = [tuple(c for c in side if _any_fits(cfg, c, hw, headroom))[:n] for side in (below, above)]
    return {"blockers": tuple(found), "nearest": tuple(fitting)}


def _any_fits(cfg: Config, devices: int, hw: Hardware, headroom: float, tries: int = 24) -> bool:
    """Whether one of the ``tries`` most sharded layouts of ``devices`` (remat first) fits."""
    layouts = candidates(devices, n_layers=cfg.model.n_layers, batch=cfg.data.global_batch // cfg.run.grad_accum,
                         seq_len=cfg.data.seq_len, n_experts=cfg.model.n_experts)
    order = sorted(layouts, key=lambda x: (-math.prod(n for a, n in x.mesh if a != "data"), not x.remat))
    return any(estimate_layout(cfg, x, hw, headroom=headroom).fits for x in order[:tries])
