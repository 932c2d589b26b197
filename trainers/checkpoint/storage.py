"""What a checkpoint step is on disk: its two items and the orbax handlers and arguments that write and read them."""

from __future__ import annotations

from typing import Any

import jax
import orbax.checkpoint as ocp

# orbax exposes no public path to the per-array metadata store that its default jax.Array handler uses,
# and our handler (other options, see state_save_handler) must write the same metadata for plain orbax
# to read the step as its own: meshes.compat.array_metadata_store reaches it.
from meshes import compat

ITEMS = ("state", "data")
# Files each item writes last; their absence means the item never finished or was damaged.
ITEM_FILES = {"state": "_METADATA", "data": "metadata"}


def handler_registry() -> ocp.handlers.DefaultCheckpointHandlerRegistry:
    """The handlers of both items: the state as a pytree of arrays, the data position as JSON."""
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    registry.add("state", ocp.args.PyTreeSave, state_save_handler())
    registry.add("state", ocp.args.StandardRestore, ocp.StandardCheckpointHandler())
    registry.add("data", ocp.args.JsonSave, ocp.JsonCheckpointHandler())
    registry.add("data", ocp.args.JsonRestore, ocp.JsonCheckpointHandler())
    registry.add("state", ocp.args.PyTreeRestore, ocp.PyTreeCheckpointHandler())  # params-only restore
    return registry


def state_save_handler() -> ocp.PyTreeCheckpointHandler:
    """Orbax's pytree handler (what ``StandardSave`` uses): zarr3, no compression; replica-parallel
    writing only with many processes (see ``trainers.checkpoint.checkpointer``)."""
    arrays = ocp.type_handlers.ArrayHandler(use_replica_parallel=jax.process_count() > 1,
                                            array_metadata_store=compat.array_metadata_store())
    types = [(ty, arrays if ty is jax.Array else ocp.type_handlers.get_type_handler(ty))
             for ty in ocp.type_handlers.supported_types()]
    return ocp.PyTreeCheckpointHandler(type_handler_registry=ocp.type_handlers.create_type_handler_registry(*types),
                                       use_zarr3=True, use_compression=False)


def save_args(state: Any, data_state: dict[str, Any]) -> ocp.args.Composite:
    """Orbax's arguments to save one step."""
    return ocp.args.Composite(state=ocp.args.PyTreeSave(state), data=ocp.args.JsonSave(data_state))


def restore_args(abstract_state: Any) -> ocp.args.Composite:
    """Orbax's arguments to read a whole step onto the shardings of ``abstract_state``."""
    return ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore())


def params_restore_args(abstract_params: Any) -> ocp.args.Composite:
    """Orbax's arguments to read only ``state["params"]`` of a step onto ``abstract_params``."""
    target = {"params": abstract_params}
    restore_args = jax.tree.map(
        lambda a: ocp.ArrayRestoreArgs(sharding=a.sharding, global_shape=a.shape, dtype=a.dtype), target
    )
    return ocp.args.Composite(state=ocp.args.PyTreeRestore(item=target, restore_args=restore_args, partial_restore=True))
