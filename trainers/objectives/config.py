"""Objective settings: ``run.objective`` and the ``dpo`` section of a :class:`trainers.Config`."""

from __future__ import annotations

import dataclasses

OBJECTIVES = ("lm", "dpo")  # run.objective: next-token loss (pretraining, SFT) | DPO on preference pairs


def check_objective(objective: str) -> None:
    if objective not in OBJECTIVES:
        raise ValueError(f"run.objective={objective!r} is not one of {', '.join(OBJECTIVES)}")


@dataclasses.dataclass(frozen=True)
class DPOConfig:
    """Direct preference optimisation (``run.objective=dpo``; docs/post-training.md).

    beta: the KL weight (> 0); loss: "sigmoid" (DPO) | "ipo"; label_smoothing: in [0, 0.5), the
    assumed fraction of flipped labels (conservative DPO, sigmoid only); pairs_per_row: the most
    preference pairs packed into one row of data.seq_len."""

    beta: float = 0.1
    loss: str = "sigmoid"
    label_smoothing: float = 0.0
    pairs_per_row: int = 8

    def __post_init__(self) -> None:
        from spmd.models.dpo import LOSSES

        if isinstance(self.beta, bool) or not isinstance(self.beta, (int, float)) or not self.beta > 0:
            raise ValueError(f"dpo.beta={self.beta!r} must be > 0 (e.g. 0.1)")
        if self.loss not in LOSSES:
            raise ValueError(f"dpo.loss={self.loss!r} is not one of {', '.join(LOSSES)}")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ValueError(f"dpo.label_smoothing={self.label_smoothing!r} must be in [0, 0.5)")
        if self.label_smoothing and self.loss != "sigmoid":
            raise ValueError(f"dpo.label_smoothing={self.label_smoothing!r} is read only by dpo.loss='sigmoid', "
                             f"got dpo.loss={self.loss!r}; set dpo.label_smoothing=0")
        if isinstance(self.pairs_per_row, bool) or not isinstance(self.pairs_per_row, int) or self.pairs_per_row < 1:
            raise ValueError(f"dpo.pairs_per_row={self.pairs_per_row!r} must be a positive int")
