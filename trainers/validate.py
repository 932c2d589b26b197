"""Moved to :mod:`trainers.checks`; kept only for the two imports of trainers.loop and trainers.step."""

from trainers.checks.config import check_fsdp_gather  # noqa: F401  (moved to trainers.checks)
from trainers.checks.layout import check_batch  # noqa: F401  (moved to trainers.checks)
