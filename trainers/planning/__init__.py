"""Planning above the run: the dry run (compile without running), the analytic cost model, the
planner that ranks layouts, and the diagnostics that explain a bad layout before any device is used.
Nothing in the rest of ``trainers`` imports this package.

    from trainers.planning import dry_run, plan, resolve_auto
"""

from trainers.planning.auto import resolve_auto
from trainers.planning.dryrun import dry_run
from trainers.planning.planner import Plan, plan
from trainers.planning.report import DryRunReport

__all__ = ["DryRunReport", "Plan", "dry_run", "plan", "resolve_auto"]
