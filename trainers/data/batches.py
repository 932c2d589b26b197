"""Global-batch assembly: which rows of the global batch this process loads, and stitching them into global arrays."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from spmd.sharding import path_str


def process_rows(sharding: jax.sharding.Sharding, global_batch: int) -> tuple[int, int]:
    """Which rows of a ``[global_batch, ...]`` batch this process must load: ``(block, n_blocks)``.

    The rows this process's devices hold under ``sharding`` form block ``block`` of ``n_blocks``
    equal, contiguous blocks. With hosts along ``data`` (the usual layout) that is
    ``(process_index, process_count)``; when several processes hold the same rows (e.g. ``data=2,
    tensor=4`` on 4 processes x 2 devices, where each ``data`` row spans two processes) they
    load the same block, and a batch replicated over all devices is one block.
    """
    shape = (global_batch,)
    rows = {(idx[0].start or 0, global_batch if idx[0].stop is None else idx[0].stop)
            for idx in sharding.addressable_devices_indices_map(shape).values()}
    intervals = sorted(rows)
    start, stop = intervals[0][0], intervals[-1][1]
    size = stop - start
    if any(a[1] != b[0] for a, b in zip(intervals, intervals[1:])):
        raise ValueError(
            f"this process's devices hold non-contiguous rows {intervals} of the batch; "
            "put the batch-sharding axes (data, fsdp) outermost so each process holds one block of rows"
        )
    if global_batch % size or start % size:
        raise ValueError(
            f"this process holds rows [{start}, {stop}) of global_batch={global_batch}: not one of equal blocks; "
            "use a global batch divisible by the number of processes along the batch axes"
        )
    return start // size, global_batch // size


def to_global(local_batch: Any, sharding: jax.sharding.Sharding, global_batch: int) -> Any:
    """Assemble this process's rows (block :func:`process_rows`) of any batch pytree into global
    ``[global_batch, ...]`` arrays."""
    block, n_blocks = process_rows(sharding, global_batch)
    rows = global_batch // n_blocks

    def one(path, local):
        local = np.asarray(local)
        if local.ndim < 1 or local.shape[0] != rows:
            raise ValueError(
                f"local batch {path_str(path) or '<root>'!r} has shape {local.shape}; expected {rows} rows "
                f"(block {block} of {n_blocks} of global_batch={global_batch} under this batch sharding); "
                "every leaf of a batch needs the batch as its leading dim"
            )
        return jax.make_array_from_process_local_data(sharding, local, (global_batch, *local.shape[1:]))

    return jax.tree_util.tree_map_with_path(one, local_batch)
