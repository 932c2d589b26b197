"""The one checks pass: rules registered per stage, run in order over a :class:`Context`.

    @rule("layout", needs=("sizes",))
    def batch(ctx: Context) -> list[Issue]: ...

    check(cfg, stages=("config", "layout"), mesh_shape={"data": 8}) -> [Issue, ...]

A rule reads what it needs of the context and returns issues; one whose ``needs`` are missing
(no mesh, no task, no compiled step) is skipped. Callers choose the policy: raise, report or prune
(:mod:`trainers.checks.issue`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import spmd
from spmd.models import GPTConfig
from spmd.pipeline import PipelineConfig
from trainers.checks.issue import STAGES, Issue
from trainers.model_variables import ModelVariables, model_variables


@dataclasses.dataclass(frozen=True)
class Compiled:
    """What the compiled stage reads of a compiled step: its collectives (``spmd.hlo.collectives``),
    the compiler's log, and ``activations``, the arguments of
    :func:`~trainers.checks.compiled.check_activation_split` after the step (None: not checked)."""

    ops: Sequence[spmd.hlo.Collective] = ()
    log: str = ""
    activations: tuple[int, int, int, int, int, tuple[str, ...]] | None = None


@dataclasses.dataclass(frozen=True, eq=False)
class Context:
    """What the rules read: the config (a ``trainers.Config``) or, without one, its pieces; the mesh's
    axis sizes; the task; the compiled step; a batch; the ``--set`` assignments. Fields left None are
    filled from ``cfg`` where it has them (:meth:`of`)."""

    cfg: Any = None
    sizes: Mapping[str, int] | None = None
    task: Any = None  # a trainers.Task
    model: GPTConfig | ModelVariables | None = None  # None: the task's model, else cfg.model (the built-in GPT)
    rules: spmd.Rules | str | None = None
    pipeline: PipelineConfig | None = None
    global_batch: int | None = None
    grad_accum: int = 1
    seq_len: int | None = None
    compiled: Compiled | None = None
    batch: Any = None
    sets: Sequence[str] | None = None

    @classmethod
    def of(cls, cfg: Any = None, **given: Any) -> Context:
        """A context of ``cfg`` with the ``given`` fields (None ones left out) in place of the config's."""
        given = {k: v for k, v in given.items() if v is not None}
        if cfg is not None:
            defaults = {"rules": cfg.rules, "pipeline": cfg.pipeline, "global_batch": cfg.data.global_batch,
                        "grad_accum": cfg.run.grad_accum, "seq_len": cfg.data.seq_len}
            given = {**defaults, **given}
        return cls(cfg=cfg, **given)

    @functools.cached_property
    def gpt(self) -> GPTConfig | None:
        """The built-in GPT's config when the checked model is the built-in GPT, else None."""
        if isinstance(self.model, GPTConfig):
            return self.model
        if self.model is None and self.task is None and self.cfg is not None:
            return self.cfg.model
        return None

    @functools.cached_property
    def variables(self) -> ModelVariables | None:
        """Any other model's abstract variables (given, or traced from the task's model), else None."""
        if isinstance(self.model, ModelVariables):
            return self.model
        if self.model is None and self.task is not None:
            from flax import nnx

            seed = self.cfg.run.seed if self.cfg is not None else 0
            return model_variables(lambda: self.task.model(nnx.Rngs(seed)), self.task.path_rules)
        return None

    @functools.cached_property
    def decided(self) -> tuple[list | None, list[Issue]]:
        """:func:`~trainers.checks.params.check_layout` of :attr:`variables` (read by two rules, run once)."""
        from trainers.checks.params import check_layout

        assert self.variables is not None and self.sizes is not None and self.rules is not None
        return check_layout(self.variables, self.rules, self.sizes)


Check = Callable[[Context], list[Issue]]


@dataclasses.dataclass(frozen=True)
class Rule:
    stage: str
    name: str
    fn: Check
    needs: tuple[str, ...] = ()  # Context fields that must not be None for the rule to run


class Registry:
    """Rules per stage, in registration order."""

    def __init__(self) -> None:
        self.rules: dict[str, list[Rule]] = {s: [] for s in STAGES}

    def rule(self, stage: str, name: str | None = None, *, needs: Iterable[str] = ()) -> Callable[[Check], Check]:
        """Register ``fn(ctx) -> list[Issue]`` under ``stage`` as ``name`` (default: the function's name)."""
        if stage not in STAGES:
            raise ValueError(f"stage {stage!r}; valid: {', '.join(STAGES)}")
        fields = {f.name for f in dataclasses.fields(Context)}
        unknown = [n for n in needs if n not in fields]
        if unknown:
            raise ValueError(f"needs {unknown}: not Context fields ({', '.join(sorted(fields))})")

        def register(fn: Check) -> Check:
            key = name or fn.__name__
            if any(r.name == key for r in self.rules[stage]):
                raise ValueError(f"a {stage} rule named {key!r} is already registered")
            self.rules[stage].append(Rule(stage, key, fn, tuple(needs)))
            return fn

        return register

    def names(self, stage: str) -> list[str]:
        return [r.name for r in self.rules[stage]]

    def run(self, ctx: Context, stages: Iterable[str] = STAGES, select: Iterable[str] | None = None) -> list[Issue]:
        """The issues of ``stages`` (in :data:`STAGES` order; rules in registration order), or of the
        ``select``-ed rules among them; each issue's ``stage`` is its rule's."""
        wanted = tuple(stages) if not isinstance(stages, str) else (stages,)
        bad = [s for s in wanted if s not in STAGES]
        if bad:
            raise ValueError(f"stages {bad}; valid: {', '.join(STAGES)}")
        chosen = [r for s in STAGES if s in wanted for r in self.rules[s]]
        if select is not None:
            names = set(select)
            missing = names - {r.name for r in chosen}
            if missing:
                raise ValueError(f"no rules {sorted(missing)} in stages {list(wanted)}; "
                                 f"valid: {', '.join(r.name for r in chosen)}")
            chosen = [r for r in chosen if r.name in names]
        issues: list[Issue] = []
        for r in chosen:
            if any(getattr(ctx, n) is None for n in r.needs):
                continue
            issues += [i if i.stage == r.stage else dataclasses.replace(i, stage=r.stage) for i in r.fn(ctx)]
        return issues


REGISTRY = Registry()
rule = REGISTRY.rule


def check(cfg: Any = None, *, stages: Iterable[str] = STAGES, mesh_shape: Mapping[str, int] | None = None,
          task: Any = None, select: Iterable[str] | None = None, registry: Registry | None = None,
          **given: Any) -> list[Issue]:
    """Every registered check of ``stages`` on ``cfg`` (a ``trainers.Config``), as :class:`Issue` records.

    ``mesh_shape``: the mesh's axis sizes (the layout stage runs only with them); ``task``: a
    ``trainers.Task`` (its model's variables and its own ``Task.checks`` in place of the built-in GPT's);
    ``select``: only these rules by name; ``given``: :class:`Context` fields in place of the config's
    (``rules``, ``pipeline``, ``model``, ``global_batch``, ``grad_accum``, ``seq_len``, ``compiled``,
    ``batch``, ``sets``). Nothing is raised for an issue: see :func:`~trainers.checks.issue.raise_first_fatal`.
    """
    ctx = Context.of(cfg, sizes=mesh_shape, task=task, **given)
    return (registry or REGISTRY).run(ctx, stages, select)
