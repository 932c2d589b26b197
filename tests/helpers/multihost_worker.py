"""One process of a multi-process test run, started by ``trainers.launch.local.launch`` (or directly).

    python tests/helpers/multihost_worker.py mesh          # global mesh, hybrid DCN mesh, data shards; then process 1 dies
    python tests/helpers/multihost_worker.py mismatch ARGS # spmd-train ARGS, process 1 with another version and seed
    python tests/helpers/multihost_worker.py init          # meshes.distributed.initialize() from SPMD_* only

Settings come from the SPMD_* variables the launcher sets; XLA_FLAGS gives the device count.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import meshes  # noqa: E402


def mesh_checks() -> None:
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    from trainers.data import DataConfig, make_loader

    pid, n = jax.process_index(), jax.process_count()
    local = jax.local_device_count()
    assert n == int(os.environ["SPMD_NUM_PROCESSES"]) and jax.device_count() == n * local == 8, (n, jax.device_count())

    # One 8-device mesh over all processes; the consistency check passes when nothing differs.
    mesh = meshes.make_mesh({"data": 2, "tensor": 4})
    assert mesh.size == 8 and {d.process_index for d in mesh.devices.flat} == set(range(n))
    meshes.distributed.check_consistent(meshes.distributed.fingerprint(mesh, {"same": "config"}))

    # Hybrid ICI x DCN mesh: data crosses processes (DCN), tensor stays inside one (ICI).
    hybrid = meshes.make_mesh(meshes.MeshSpec.of({"data": 1, "tensor": local}, {"data": n}))
    assert dict(zip(hybrid.axis_names, hybrid.devices.shape))["data"] == n
    axis = hybrid.axis_names.index("data")
    rows = [{d.process_index for d in np.take(hybrid.devices, i, axis=axis).flat} for i in range(n)]
    assert rows == [{i} for i in range(n)], rows
    print(f"hybrid rows by process: {rows}", flush=True)

    # Each process loads only its rows; together they are exactly the single-process global batch.
    cfg = DataConfig(corpus="synthetic", seq_len=8, global_batch=8, synthetic_tokens=4096, vocab_size=64)
    mine = next(make_loader(cfg, "train"))["inputs"]
    whole = next(make_loader(cfg, "train", process_index=0, process_count=1))["inputs"]
    assert mine.shape == (8 // n, 8), mine.shape
    np.testing.assert_array_equal(mine, whole[pid * (8 // n) : (pid + 1) * (8 // n)])
    gathered = multihost_utils.process_allgather(mine, tiled=True)
    np.testing.assert_array_equal(gathered, whole)
    print(f"MESH OK process={pid} rows={pid * (8 // n)}..{(pid + 1) * (8 // n)}", flush=True)

    # A process dies mid-run; the others wait in a collective that can never finish.
    multihost_utils.sync_global_devices("checks done")
    if pid == n - 1:
        print("DYING", flush=True)
        os._exit(3)
    time.sleep(0.5)
    multihost_utils.sync_global_devices("never completes")
    print("UNEXPECTED: survived a dead peer", flush=True)


def mismatch(args: list[str]) -> int:
    from trainers.launch import cli

    if os.environ["SPMD_PROCESS_ID"] == "1":
        meshes.distributed.toolkit_version = lambda: "0.0.0-other"
        args = [*args, "--set", "run.seed=1"]
    return cli.main(args)


def main(argv: list[str]) -> int:
    mode, rest = argv[0], argv[1:]
    if mode == "mismatch":
        return mismatch(rest)
    started = meshes.distributed.initialize()
    print(f"initialized={started}", flush=True)
    if mode == "mesh":
        mesh_checks()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
