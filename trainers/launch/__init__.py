"""Starting runs: the ``spmd-train`` / ``spmd-plan`` CLI, ``spmd-launch`` (N processes on one machine)
and the command lines for TPU pods and SLURM clusters (``scripts/`` holds the launcher scripts).

    python -m trainers gpt-small --simulate-devices 8     # = spmd-train
"""

# submodules, imported on use (``from trainers.launch import cli``): the CLI must start without jax
__all__ = ["cli", "command", "local", "plan", "pods", "tokenize"]
