"""Checkpoints: orbax saves of the train state and data position, keep-N, resume, restore onto any mesh.

    from trainers.checkpoint import Checkpointer, CheckpointConfig, load_params
"""

from trainers.checkpoint.anywhere import load_params
from trainers.checkpoint.checkpointer import Checkpointer, CheckpointTimeoutError, NoUsableCheckpointError
from trainers.checkpoint.config import CheckpointConfig, resolve_init_from

__all__ = ["CheckpointConfig", "Checkpointer", "CheckpointTimeoutError", "NoUsableCheckpointError", "load_params",
           "resolve_init_from"]
