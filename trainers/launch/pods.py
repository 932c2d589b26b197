"""Command lines that run one training job on every host of a real cluster.

``train_command``, ``tpu_pod_command`` and ``slurm_command`` build the command lines the scripts in
``trainers/launch/scripts/`` run, so notebooks and tests can check them without a cloud account.
See docs/many-hosts.md.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence


def train_command(
    recipe: str,
    overrides: Sequence[str] = (),
    *,
    tiny: bool = False,
    mesh: str | None = None,
    dcn: str | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    """``spmd-train RECIPE [--tiny] [--mesh AXES] [--dcn AXES] [--set k=v ...] [EXTRA ...]``."""
    if not isinstance(recipe, str) or not recipe.strip():
        raise ValueError(f"recipe must be a recipe name such as 'gpt-125m', got {recipe!r}")
    cmd = ["spmd-train", recipe] + (["--tiny"] if tiny else [])
    cmd += ["--mesh", mesh] if mesh else []
    cmd += ["--dcn", dcn] if dcn else []
    for item in overrides:
        if not isinstance(item, str) or "=" not in item or item.startswith("="):
            raise ValueError(f"override {item!r} is not of the form key=value (e.g. run.steps=100)")
        cmd += ["--set", item]
    return cmd + list(extra)


def tpu_pod_command(
    tpu_name: str,
    zone: str,
    train_cmd: Sequence[str],
    *,
    project: str | None = None,
    workdir: str | None = None,
) -> list[str]:
    """``gcloud compute tpus tpu-vm ssh NAME --zone=Z --worker=all --command="[cd DIR &&] spmd-train ..."``."""
    if not tpu_name or not isinstance(tpu_name, str):
        raise ValueError(f"tpu name must be the TPU VM's name (e.g. 'my-v5p-64'), got {tpu_name!r}")
    if not zone or not isinstance(zone, str):
        raise ValueError(f"zone must be a GCP zone (e.g. 'us-central2-b'), got {zone!r}")
    if not train_cmd:
        raise ValueError("train_cmd is empty; build it with train_command(recipe, ...)")
    remote = shlex.join(train_cmd)
    if workdir:
        # '~' must stay unquoted to expand on the worker.
        remote = f"cd {workdir if workdir.startswith('~') else shlex.quote(workdir)} && {remote}"
    cmd = ["gcloud", "compute", "tpus", "tpu-vm", "ssh", tpu_name, f"--zone={zone}", "--worker=all"]
    cmd += [f"--project={project}"] if project else []
    return cmd + [f"--command={remote}"]


def slurm_command(train_cmd: Sequence[str], *, nodes: int, gpus_per_node: int | None = None) -> list[str]:
    """``srun --nodes=N --ntasks-per-node=1 [--gpus-per-node=G] spmd-train ...``: one process per node."""
    if not isinstance(nodes, int) or isinstance(nodes, bool) or nodes < 1:
        raise ValueError(f"nodes must be a positive integer, got {nodes!r}")
    if gpus_per_node is not None and (not isinstance(gpus_per_node, int) or gpus_per_node < 1):
        raise ValueError(f"gpus_per_node must be a positive integer or None, got {gpus_per_node!r}")
    if not train_cmd:
        raise ValueError("train_cmd is empty; build it with train_command(recipe, ...)")
    cmd = ["srun", f"--nodes={nodes}", "--ntasks-per-node=1"]
    cmd += [f"--gpus-per-node={gpus_per_node}"] if gpus_per_node else []
    return cmd + list(train_cmd)
