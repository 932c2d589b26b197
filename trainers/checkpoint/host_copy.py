"""A host copy of a sharded state: each distinct shard copied to host memory once, then rebuilt as arrays.

What :class:`trainers.checkpoint.Checkpointer` blocks on when it saves asynchronously: every
device-to-host transfer of the state's distinct shards is started, then collected into 64-byte
aligned host buffers (XLA's CPU client aliases such buffers instead of copying them); replicas of a
shard are copied once. ``arrays()`` rebuilds ``jax.Array`` s with the state's own shardings from
the copy (on accelerators in ``pinned_host`` memory), which orbax then writes in the background.
The buffers of one copy can be handed to the next (``spare=``) once orbax has finished reading them.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np

_ALIGN = 64  # bytes; XLA's CPU client aliases host buffers aligned like this instead of copying them


_Key = tuple[tuple[int, int], ...]  # a shard's index as ((start, stop), ...) per dim


def _index_key(index: tuple[slice, ...], shape: tuple[int, ...]) -> _Key:
    """A shard's index (a tuple of slices, not hashable before Python 3.12) as ((start, stop), ...)."""
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


@functools.lru_cache(maxsize=1024)
def _shard_plan(sharding: jax.sharding.Sharding, shape: tuple[int, ...],
                devices: tuple[jax.Device, ...]) -> tuple[tuple[int, ...], dict[_Key, int]]:
    """Which of an array's addressable shards (``devices``: their order) to copy, one per distinct
    index, and the copied block that holds each index. Cached: a train state keeps its shardings."""
    index_of = sharding.addressable_devices_indices_map(shape)
    copied: list[int] = []
    block_of: dict[_Key, int] = {}
    for position, device in enumerate(devices):
        key = _index_key(index_of[device], shape)
        if key not in block_of:
            block_of[key] = len(copied)
            copied.append(position)
    return tuple(copied), block_of


class HostCopy:
    """A pytree's values in host memory: each distinct shard of every ``jax.Array`` copied once.

    Construction is the device-to-host copy (every transfer started, then collected); afterwards
    nothing refers to the original arrays. ``arrays()`` rebuilds ``jax.Array`` s with the original
    shardings in host memory, replicas of a shard filled from the same host block.
    """

    def __init__(self, state: Any, spare: list[np.ndarray] | None = None) -> None:
        """``spare``: host buffers of an earlier copy that nothing reads any more, reused in order
        where shape and dtype match (fresh memory costs a page fault per 4 KiB on first touch)."""
        leaves, self._treedef = jax.tree.flatten(state)
        self._leaves: list[Any] = []
        self.buffers: list[np.ndarray] = []  # the host memory this copy owns
        spares = iter(spare or ())
        in_flight: list[tuple[list[Any], bool]] = []
        for leaf in leaves:
            if isinstance(leaf, jax.Array):
                shards = leaf.addressable_shards
                copied, block_of = _shard_plan(leaf.sharding, leaf.shape, tuple(s.device for s in shards))
                blocks = [shards[i].data for i in copied]
                for data in blocks:
                    data.copy_to_host_async()
                in_flight.append((blocks, _host_view_aliases(leaf)))
                self._leaves.append((leaf.shape, leaf.sharding, blocks, block_of))
            else:  # numbers are immutable; numpy arrays are copied (the caller may mutate them)
                self._leaves.append(np.array(leaf) if isinstance(leaf, np.ndarray) else leaf)
        for blocks, aliases in in_flight:  # every transfer has started: collect them
            blocks[:] = [self._copied(np.asarray(data), spares) if aliases else np.asarray(data) for data in blocks]

    def _copied(self, host: np.ndarray, spares: Any) -> np.ndarray:
        buffer = next(spares, None)
        if buffer is None or buffer.shape != host.shape or buffer.dtype != host.dtype:
            buffer = _aligned_empty(host.shape, host.dtype)
        np.copyto(buffer, host)
        self.buffers.append(buffer)
        return buffer

    def arrays(self) -> Any:
        """The pytree again, its arrays rebuilt with their shardings in host memory. Once: the
        blocks are released to the rebuilt arrays (on CPU they alias ``buffers``)."""
        leaves, self._leaves = self._leaves, []
        out = []
        for leaf in leaves:
            if isinstance(leaf, tuple):
                shape, sharding, blocks, block_of = leaf

                def block(index: tuple[slice, ...], blocks=blocks, block_of=block_of, shape=shape) -> np.ndarray:
                    return blocks[block_of[_index_key(index, shape)]]

                out.append(jax.make_array_from_callback(shape, _host_sharding(sharding), block))
            else:
                out.append(leaf)
        return jax.tree.unflatten(self._treedef, out)


def _host_view_aliases(array: jax.Array) -> bool:
    """Whether ``np.asarray`` of this array's shards views their own buffers (which the next
    donating step overwrites) instead of returning a transferred copy: on CPU, and in host memory."""
    return array.sharding.memory_kind not in (None, "device") or next(iter(array.sharding.device_set)).platform == "cpu"  # type: ignore[attr-defined]


def _aligned_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialised array at a 64-byte boundary: a CPU device adopts such a buffer without a copy."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    raw = np.empty(nbytes + _ALIGN, np.uint8)
    start = -raw.ctypes.data % _ALIGN
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def _host_sharding(sharding: jax.sharding.Sharding) -> jax.sharding.Sharding:
    """``sharding`` in pinned host memory on accelerators (orbax does not record the memory kind)."""
    device: Any = next(iter(sharding.device_set))
    if device.platform == "cpu" or "pinned_host" not in {m.kind for m in device.addressable_memories()}:
        return sharding
    return sharding.with_memory_kind("pinned_host")


# --------------------------------------------------------------------------------- checks
