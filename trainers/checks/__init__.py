"""The checks a run makes before (and just after) it compiles: one pass, five stages, one :class:`Issue` type.

    issues = check(cfg, stages=("config", "layout"), mesh_shape=dict(mesh.shape))
    raise_first_fatal(issues)      # or report(issues), or buildable(issues) to prune a layout

Stages (:data:`STAGES`): config, layout, data, checkpoint, compiled. Rules register per stage
(:func:`rule`); the pass and their order: :mod:`trainers.checks.rules`. See docs/planning.md.
"""

from trainers.checks import rules as _rules  # noqa: F401  (registers the pass's rules)
from trainers.checks.issue import (
    CONFIG_FIELD,
    STAGES,
    Issue,
    buildable,
    first_fatal,
    name_config_key,
    raise_first_fatal,
    report,
)
from trainers.checks.layout import batch_axes
from trainers.checks.registry import REGISTRY, Compiled, Context, Registry, check, rule

__all__ = ["CONFIG_FIELD", "REGISTRY", "STAGES", "Compiled", "Context", "Issue", "Registry", "batch_axes", "buildable",
           "check", "first_fatal", "name_config_key", "raise_first_fatal", "report", "rule"]
