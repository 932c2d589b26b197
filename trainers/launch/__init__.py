"""Starting runs: the ``spmd-train`` / ``spmd-plan`` CLI, ``spmd-launch`` (N processes on one machine)
and the command lines for TPU pods and SLURM clusters (``scripts/`` holds the launcher scripts).

    python -m trainers gpt-small --simulate-devices 8     # = spmd-train
"""

from trainers.launch import cli, local, pods

__all__ = ["cli", "local", "pods"]
