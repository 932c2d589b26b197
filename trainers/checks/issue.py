"""One checked problem (:class:`Issue`), and what a caller does with a list of them: raise, report or prune.

    raise_first_fatal(issues)   # spmd-train, Config: ValueError naming the value and what is valid
    report(issues)              # the dry run: one line each, fatal first marked
    buildable(issues)           # the planner: keep a layout, or drop it for first_fatal(issues)
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable

# When a check runs: on the config alone, on a mesh's axis sizes, on the data, on a checkpoint, on a compiled step.
STAGES = ("config", "layout", "data", "checkpoint", "compiled")

# The config key that sets each logical dim of the built-in GPT (and the batch), for messages.
CONFIG_FIELD = {
    "mlp": "model.d_ff", "heads": "model.n_heads", "kv_heads": "model.n_kv_heads", "vocab": "model.vocab_size",
    "embed": "model.d_model", "layers": "model.n_layers", "head_dim": "model.head_dim", "batch": "data.global_batch",
}


@dataclasses.dataclass(frozen=True)
class Issue:
    """One diagnosed problem: what (kind), where (path, dim), and the suggested fix.

    ``stage`` is when it was found (one of :data:`STAGES`); ``key`` what to change: the config key
    (``"model.n_heads"``) where one sets it, else the parameter path or place (defaults to ``path``).
    ``fatal``: the run (or the layout) cannot be built at all.
    """

    # "indivisible" | "rules" | "batch" | "pipeline" | "replicated" | "all-to-all" | "remat" | "activations"
    # | "config" | "profile" | "accumulate" | "data" | "checkpoint"
    kind: str
    path: str
    dim: str | None
    message: str
    fix: str
    fatal: bool = False
    _: dataclasses.KW_ONLY
    stage: str = "layout"
    key: str = ""

    def __post_init__(self) -> None:
        if self.stage not in STAGES:
            raise ValueError(f"Issue.stage={self.stage!r}; valid: {', '.join(STAGES)}")
        if not self.key:
            object.__setattr__(self, "key", self.path)

    def __str__(self) -> str:
        return f"{self.message}: {self.fix}" if self.fix else self.message


def first_fatal(issues: Iterable[Issue]) -> Issue | None:
    """The first issue that rules the run (or layout) out, or None."""
    return next((i for i in issues if i.fatal), None)


def buildable(issues: Iterable[Issue]) -> bool:
    """Whether nothing in ``issues`` is fatal (the planner keeps the layout)."""
    return first_fatal(issues) is None


def raise_first_fatal(issues: Iterable[Issue]) -> None:
    """ValueError with the first fatal issue's message and fix (the value, and what would be valid)."""
    issue = first_fatal(issues)
    if issue is not None:
        raise ValueError(str(issue))


def report(issues: Iterable[Issue]) -> list[str]:
    """One line per issue, ``"stage key: message: fix"``, fatal ones marked (the dry run prints them)."""
    return [f"{'FATAL ' if i.fatal else ''}{i.stage} {i.key}: {i}" for i in issues]


def name_config_key(error: Exception) -> str:
    """A sharding error about the built-in GPT's parameters, with the config key that sets the dim."""
    found = re.search(r"dim \d+ \('(\w+)'\)", str(error))
    key = CONFIG_FIELD.get(found.group(1)) if found else None
    return f"{error} (that size is {key})" if key else str(error)
