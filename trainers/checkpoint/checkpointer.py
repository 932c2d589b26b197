"""Checkpoints of a training run: async save, keep-N, validated resume, restore onto another mesh.

A checkpoint step is one directory, ``<directory>/<step>/``, holding two items written by
orbax's ``CheckpointManager``:

- ``state``: the pytree of ``jax.Array`` (params, optimizer state, step, RNG key data), written
  by orbax's ``PyTreeCheckpointHandler`` (tensorstore/OCDBT), exactly what ``StandardSave``
  writes. Every process writes the shards it owns; nothing is gathered onto one device or one
  host. Plain orbax restores it (``StandardRestore`` with the same tree) without this module.
- ``data``: a small JSON dict (the data iterator position), written with ``JsonSave``.

Restoring onto another mesh or rule set is a matter of the target: ``restore`` takes an
abstract pytree of ``jax.ShapeDtypeStruct(shape, dtype, sharding=...)`` and every process reads
exactly the slices its devices need under the *new* sharding. A checkpoint saved as
``W[D_fsdp, F]`` on an 8-device ``fsdp`` mesh restores as ``W[D, F_tensor]`` on a
``(data, tensor)`` mesh without any collective.

Orbax trusts any finalised step directory, even an empty one, and reports it as the latest
step; restoring it then fails with a misleading error, and deleted or truncated data files
surface as tensorstore NOT_FOUND / OUT_OF_RANGE only when read. So this module never trusts
``latest_step()``:

- ``valid_steps()`` keeps only steps that are finalised, hold both items with their metadata
  files, and whose state metadata (tree, shapes, dtypes) can be read;
- ``restore()`` walks the steps newest first, logs a warning naming each step it skips and why,
  falls back to the next older one, and raises ``NoUsableCheckpointError`` listing every step
  and its reason when none restores. It never silently starts from scratch: ``None`` means the
  directory holds no step at all.
- Before reading arrays, the stored shapes and dtypes are compared with the target; a mismatch
  is a configuration error (``ValueError`` naming the paths), not corruption, so it is raised
  instead of falling back.

Saving a step that already exists: if the existing step is valid, the save is skipped with a
log message and ``save`` returns ``False`` (the step's state is already on disk); if it is
incomplete or unreadable, it is deleted and written again. The decision to save is made here
(``step % every_steps == 0``, ``force=True``, or an orbax preemption sync point), so an
unusable higher-numbered step left behind by a crash never blocks later saves.

Saving without stalling the loop (``async_save``, one process): the one thing ``save`` does that
blocks is to copy each distinct shard of the state to host memory (every transfer started, then
collected; the replicas of a shard are copied once). A background thread then rebuilds
``jax.Array`` s with the state's own shardings from that copy (on CPU they alias it; on
accelerators they live in ``pinned_host`` memory, so no device memory is taken) and calls orbax's
async save on them. The caller may donate, overwrite or delete the state as soon as ``save``
returns: afterwards only the copy, which belongs to this module, is read. On disk the step is what
orbax writes for the original state: same tree, shapes, dtypes, values and shardings (orbax
records no memory kind). For the main job's state (12.8 MiB) ``save`` blocks about as long as a
bare device-to-host copy of it (under 10 ms on a 2-core CPU host), where orbax's own async save
blocks ~90 ms in per-array metadata, tensorstore setup, directory creation and starting its
threads (benchmarks/RESULTS.md, section checkpoint).

One save is in flight at a time, as with orbax's own async save: a ``save`` that finds the
previous one still writing waits for its commit. The copy's host buffers are then free (orbax has
finished reading them) and the new copy reuses them (fresh memory costs a page fault per 4 KiB),
so a CPU run holds one extra host copy of its state's distinct shards. An error in the
background is raised by the next ``save``, ``wait`` or ``close``.

Orbax options: arrays are written as zarr3 (orbax's newer array format; the checkpoint records it,
so plain orbax reads it, and older zarr2 steps still restore) and uncompressed (zstd costs as much
CPU time as the disk write for float states, which barely compress: it doubled the background time
of a 387 MiB save on a 2-core host; zarr3 took ~15 % off the rest); on one process replica-parallel
writing is off (every replica is local, so splitting each shard across its replicas only adds a
slice and a copy per piece).

With many processes, orbax's blocking part stays in the calling thread, on the caller's arrays:
its cross-process barriers there are device collectives (``sync_global_devices``), which every
process must issue in the same order relative to the train step's collectives; from a background
thread they could interleave differently on different processes.

Crash safety: orbax writes a step into ``<step>.orbax-checkpoint-tmp-*`` and renames it into
place only when every item is written, so a process killed mid-save (even SIGKILL) leaves a tmp
directory that is never listed as a step and is removed when the next ``Checkpointer`` starts.
Whatever else a crash or a bad disk leaves (empty or half-deleted step directories) is caught by
the validation above. A process killed while a save is being handed to orbax loses that save the
same way: nothing has been renamed into place, and older steps are untouched. On a normal exit or
an exception, ``close()`` (the training loop calls it in ``finally``) finishes the hand-over and
waits for the commit. Waits are bounded (``timeout_s``): a save that does not commit in time
raises ``CheckpointTimeoutError`` naming the directory instead of hanging the job.

Nothing restored executes code: arrays are tensorstore/zarr data, the data-loader position and
all metadata are JSON; no pickle is written or read.

Fine-tuning: ``restore_params`` reads only the ``params`` subtree of a step (the optimizer state
on disk is not read), for a run that starts at step 0 with a fresh optimizer
(``checkpoint.init_from``).

Many processes: call every method on every process with the same arguments, as with orbax
itself. Decisions that depend on what a process reads (is a step valid, did its restore work)
are agreed across processes, so all of them fall back together.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import os
import threading
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils
from orbax.checkpoint._src.metadata import array_metadata_store  # what orbax's default jax.Array handler uses

from trainers.checkpoint.host_copy import HostCopy as _HostCopy

logger = logging.getLogger(__name__)

_ITEMS = ("state", "data")
# Files each item writes last; their absence means the item never finished or was damaged.
_ITEM_FILES = {"state": "_METADATA", "data": "metadata"}
_MAX_MISMATCHES_SHOWN = 5
_MAX_REASON_CHARS = 300


class NoUsableCheckpointError(RuntimeError):
    """Checkpoint steps exist, but none of them could be restored."""


class CheckpointTimeoutError(TimeoutError):
    """A save did not commit within ``checkpoint.timeout_s``."""


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """How often to checkpoint and how many steps to keep.

    directory: where steps go; ``None`` lets the caller choose (``<run_dir>/checkpoints``,
      see ``resolve_directory``).
    every_steps: save when ``step % every_steps == 0`` (``save(..., force=True)`` overrides).
    keep: number of most recent steps kept on disk; older ones are deleted.
    async_save: ``save()`` returns once the state is copied to host memory and orbax writes it in
      the background; ``Checkpointer.wait()`` blocks until committed.
    timeout_s: longest wait for a save to commit (and for orbax's cross-process barriers).
    init_from: a checkpoint directory (newest valid step) or one step directory
      (``.../checkpoints/500``) whose params start a new run at step 0 with a fresh optimizer.
      Only used when the run has no checkpoint of its own: a restarted fine-tuning run resumes.
    allow_fresh_start: when steps exist but none can be restored, warn and start from scratch
      instead of raising ``NoUsableCheckpointError`` (the unusable steps are replaced as saves reach them).
    """

    directory: str | None = None
    every_steps: int = 100
    keep: int = 3
    async_save: bool = True
    timeout_s: float = 600.0
    init_from: str | None = None
    allow_fresh_start: bool = False

    def __post_init__(self) -> None:
        if self.directory is not None and (not isinstance(self.directory, str) or not self.directory):
            raise ValueError(f"directory must be a non-empty string or None, got {self.directory!r}")
        for name in ("every_steps", "keep"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("async_save", "allow_fresh_start"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)) or not 0 < self.timeout_s < float("inf"):
            raise ValueError(f"timeout_s must be a finite number of seconds > 0, got {self.timeout_s!r}")
        if self.init_from is not None and (not isinstance(self.init_from, str) or not self.init_from):
            raise ValueError(f"init_from must be a non-empty path or None, got {self.init_from!r}")

    def resolve_directory(self, run_dir: str | os.PathLike[str]) -> str:
        """The checkpoint directory: ``directory`` if set, else ``<run_dir>/checkpoints``."""
        if self.directory is not None:
            return self.directory
        return os.path.join(os.fspath(run_dir), "checkpoints")


def _path_str(path: tuple[Any, ...]) -> str:
    return "/".join(str(p) for p in path) or "<root>"


def _flatten_with_paths(tree: Any) -> list[tuple[str, Any]]:
    return [(jax.tree_util.keystr(p), leaf) for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _short(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    return text if len(text) <= _MAX_REASON_CHARS else text[:_MAX_REASON_CHARS] + "..."


def _agree(reason: str | None) -> str | None:
    """A failure on any process is a failure on all (so every process takes the same branch)."""
    if jax.process_count() == 1:
        return reason
    failed = multihost_utils.process_allgather(np.asarray(reason is not None, dtype=np.int32))
    if reason is None and np.any(failed):
        bad = [i for i, f in enumerate(np.ravel(failed)) if f]
        return f"failed on process(es) {bad}"
    return reason


class Checkpointer:
    """Saves and restores ``(step, state, data_state)`` under one directory with orbax."""

    def __init__(self, directory: str | os.PathLike[str], config: CheckpointConfig = CheckpointConfig(), *,
                 read_only: bool = False) -> None:
        """``read_only`` opens another run's checkpoints (``init_from``): nothing is created,
        cleaned up or saved there."""
        if not isinstance(config, CheckpointConfig):
            raise ValueError(f"config must be a CheckpointConfig, got {type(config).__name__}")
        text = os.fspath(directory)
        if not text:
            raise ValueError("directory must be a non-empty path, got ''")
        self.directory = epath.Path(text if "://" in text else os.path.abspath(text))
        self.config = config
        registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
        registry.add("state", ocp.args.PyTreeSave, _state_save_handler())
        registry.add("state", ocp.args.StandardRestore, ocp.StandardCheckpointHandler())
        registry.add("data", ocp.args.JsonSave, ocp.JsonCheckpointHandler())
        registry.add("data", ocp.args.JsonRestore, ocp.JsonCheckpointHandler())
        registry.add("state", ocp.args.PyTreeRestore, ocp.PyTreeCheckpointHandler())  # params-only restore
        options = ocp.CheckpointManagerOptions(
            max_to_keep=config.keep,
            enable_async_checkpointing=config.async_save,
            async_options=ocp.options.AsyncOptions(timeout_secs=max(1, int(config.timeout_s))),
            cleanup_tmp_directories=not read_only,  # leftovers of a save interrupted by a crash
            create=not read_only,
            read_only=read_only,
        )
        self.read_only = read_only
        if read_only and not self.directory.is_dir():
            raise ValueError(f"checkpoint directory {self.directory} does not exist")
        self._manager = ocp.CheckpointManager(self.directory, handler_registry=registry, options=options)
        # One process, async: orbax's blocking part runs here, on a host copy of the state.
        self._background = config.async_save and not read_only and jax.process_count() == 1
        self._executor = (concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-save")
                          if self._background else None)
        self._handoff: concurrent.futures.Future[None] | None = None
        self._last_copy: _HostCopy | None = None  # its host buffers are reused by the next save

    # ----------------------------------------------------------------------------- saving
    def save(self, step: int, state: Any, data_state: dict[str, Any], *, force: bool = False) -> bool:
        """Start saving ``step`` if it is due; returns whether a save was started.

        Due means ``step % every_steps == 0``, ``force``, or an orbax preemption sync point. With
        ``async_save`` this returns once the state is copied to host memory (the caller may then
        donate or overwrite it); ``wait()`` blocks until the step is committed. An existing valid
        step is not overwritten (logged, returns False).
        """
        if self.read_only:
            raise ValueError(f"this Checkpointer of {self.directory} is read-only; saving step {step!r} is not allowed")
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise ValueError(f"step must be an integer >= 0, got {step!r}")
        step = int(step)
        data_state = _check_data_state(data_state)
        state = _standard_state(state)
        due = force or step % self.config.every_steps == 0 or self._manager.reached_preemption(step)
        if not due:
            return False
        # One save in flight at a time, as with orbax's own save: wait for the previous one to commit
        # (normally long done). Its host buffers are then free: orbax has finished reading them.
        self._finish_handoff()
        self._manager.wait_until_finished()
        if step in self._manager.all_steps() or (self.directory / str(step)).exists():
            self._manager.reload()  # the manager's view of the directory becomes what is on disk
            if step in self._manager.all_steps():
                reason = _agree(self._invalid_reason(step)[0])
                if reason is None:
                    logger.info("checkpoint step %d already exists in %s; not saving it again", step, self.directory)
                    return False
                logger.warning("checkpoint step %d in %s is unusable (%s); replacing it", step, self.directory, reason)
                self._manager.delete(step)
        if not self._background:
            return bool(self._manager.save(step, args=_save_args(state, data_state), force=True))
        spare, self._last_copy = (self._last_copy.buffers if self._last_copy else None), None
        copy = _HostCopy(state, spare)  # the only blocking work: from here on the caller's arrays are not used
        self._last_copy = copy
        self._handoff = self._executor.submit(self._hand_off, step, copy, data_state)
        return True

    def _hand_off(self, step: int, copy: _HostCopy, data_state: dict[str, Any]) -> None:
        """Background thread: orbax's blocking part of an async save, on arrays rebuilt from ``copy``."""
        try:
            if not self._manager.save(step, args=_save_args(copy.arrays(), data_state), force=True):
                raise RuntimeError("orbax declined to start the save")
        except Exception as exc:
            raise RuntimeError(f"saving checkpoint step {step} in {self.directory} failed: {_short(exc)}") from exc

    def _finish_handoff(self) -> None:
        """Wait for the pending hand-over to orbax, if any; raise its error (once)."""
        handoff, self._handoff = self._handoff, None
        if handoff is not None:
            handoff.result()

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until every pending save is committed; CheckpointTimeoutError after ``timeout_s``
        (default ``config.timeout_s``) seconds, naming the directory and the steps on disk."""
        timeout_s = self.config.timeout_s if timeout_s is None else timeout_s
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        error: list[BaseException] = []

        def wait() -> None:
            try:
                self._finish_handoff()
                self._manager.wait_until_finished()
            except BaseException as exc:  # re-raised in the caller's thread
                error.append(exc)

        waiter = threading.Thread(target=wait, name="checkpoint-wait", daemon=True)
        waiter.start()
        waiter.join(timeout_s)
        if waiter.is_alive():
            raise CheckpointTimeoutError(
                f"timed out after {timeout_s} s waiting for a checkpoint save to commit in {self.directory} "
                f"(committed steps: {self.all_steps()}); raise checkpoint.timeout_s if the storage is slow"
            )
        if error:
            raise error[0]

    def close(self) -> None:
        """Wait for pending saves and release orbax's background resources."""
        try:
            self._finish_handoff()
        finally:
            self._last_copy = None
            self._manager.close()
            if self._executor is not None:
                self._executor.shutdown(wait=True)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------------------- inspecting
    def all_steps(self) -> list[int]:
        """Every finalised step directory on disk, ascending, valid or not (pending saves excluded)."""
        return sorted(ocp.step.checkpoint_steps(self.directory))

    def valid_steps(self) -> list[int]:
        """Steps that are finalised, hold both items with metadata, and whose state metadata reads."""
        return [s for s in self.all_steps() if self._invalid_reason(s)[0] is None]

    def _invalid_reason(self, step: int) -> tuple[str | None, Any]:
        """(None, state metadata tree) for a usable step, else (reason, None)."""
        self._finish_handoff()  # orbax's manager is not shared with the background thread
        path = self.directory / str(step)
        if not ocp.step.is_path_finalized(path):
            return "not finalised (save still running or interrupted)", None
        for item in _ITEMS:
            if not (path / item).is_dir():
                return f"item '{item}' is missing", None
            if not (path / item / _ITEM_FILES[item]).exists():
                return f"item '{item}' has no '{_ITEM_FILES[item]}' file", None
        try:
            metadata = self._manager.item_metadata(step)["state"]
        except Exception as exc:  # tensorstore NOT_FOUND / OUT_OF_RANGE and friends
            return f"state metadata unreadable: {_short(exc)}", None
        if metadata is None or getattr(metadata, "tree", None) is None:
            return "state metadata unreadable", None
        return None, metadata.tree

    # ----------------------------------------------------------------------------- restoring
    def restore(self, abstract_state: Any, *, step: int | None = None) -> tuple[int, Any, dict[str, Any]] | None:
        """Restore ``(step, state, data_state)`` onto the shardings in ``abstract_state``.

        ``abstract_state`` is a pytree of ``jax.ShapeDtypeStruct`` with ``sharding=`` set; the
        result has its structure and shardings. ``step=None`` tries the newest step and falls
        back to older ones (with a warning per skipped step). Returns None if there are no steps.
        Raises ValueError if stored shapes/dtypes differ from the target, and
        NoUsableCheckpointError if steps exist but none restores.
        """
        _check_abstract(abstract_state)
        self._finish_handoff()
        self._manager.wait_until_finished()
        self._manager.reload()
        steps = self.all_steps()
        if step is not None:
            if step not in steps:
                raise ValueError(f"step {step!r} is not a checkpoint in {self.directory}; steps on disk: {steps}")
            candidates = [step]
        else:
            candidates = sorted(steps, reverse=True)
        if not candidates:
            return None
        failures: list[tuple[int, str]] = []
        for candidate in candidates:
            reason, stored = self._invalid_reason(candidate)
            reason = _agree(reason)
            if reason is None:
                _check_compatible(candidate, stored, abstract_state)
                try:
                    state, data_state = self._read(candidate, abstract_state)
                except Exception as exc:  # corrupt data discovered only while reading
                    reason = f"restore failed: {_short(exc)}"
                reason = _agree(reason)
            if reason is None:
                logger.info("restored checkpoint step %d from %s", candidate, self.directory)
                return candidate, state, data_state
            failures.append((candidate, reason))
            logger.warning("skipping checkpoint step %d in %s: %s", candidate, self.directory, reason)
        listing = "\n".join(f"  step {s}: {r}" for s, r in failures)
        raise NoUsableCheckpointError(
            f"no checkpoint in {self.directory} could be restored; refusing to start from scratch.\n{listing}\n"
            "Delete or repair these step directories, or point the run at another directory."
        )

    def restore_params(self, abstract_params: Any, *, step: int | None = None) -> tuple[int, Any]:
        """Restore only ``state["params"]`` of a step (newest valid when ``step=None``) onto ``abstract_params``.

        For fine-tuning: the optimizer state on disk is not read. Shapes/dtypes are checked
        against the target first (ValueError naming the paths). Raises NoUsableCheckpointError if
        no step restores, including when the directory holds no step at all.
        """
        _check_abstract(abstract_params)
        self._finish_handoff()
        self._manager.wait_until_finished()
        self._manager.reload()
        steps = self.all_steps()
        if step is not None and step not in steps:
            raise ValueError(f"step {step!r} is not a checkpoint in {self.directory}; steps on disk: {steps}")
        failures: list[tuple[int, str]] = []
        for candidate in [step] if step is not None else sorted(steps, reverse=True):
            reason, stored = self._invalid_reason(candidate)
            if reason is None and (not isinstance(stored, dict) or "params" not in stored):
                reason = f"no 'params' in the stored state (top-level keys: {sorted(stored) if isinstance(stored, dict) else type(stored).__name__})"
            reason = _agree(reason)
            if reason is None:
                _check_compatible(candidate, stored["params"], abstract_params)
                try:
                    params = self._read_params(candidate, abstract_params)
                except Exception as exc:
                    reason = f"restore failed: {_short(exc)}"
                reason = _agree(reason)
            if reason is None:
                logger.info("restored params of checkpoint step %d from %s", candidate, self.directory)
                return candidate, params
            failures.append((candidate, reason))
            logger.warning("skipping checkpoint step %d in %s: %s", candidate, self.directory, reason)
        listing = "\n".join(f"  step {s}: {r}" for s, r in failures) or "  (no steps)"
        raise NoUsableCheckpointError(f"no params could be restored from {self.directory}:\n{listing}")

    def _read_params(self, step: int, abstract_params: Any) -> Any:
        target = {"params": abstract_params}
        restore_args = jax.tree.map(
            lambda a: ocp.ArrayRestoreArgs(sharding=a.sharding, global_shape=a.shape, dtype=a.dtype), target
        )
        args = ocp.args.Composite(state=ocp.args.PyTreeRestore(item=target, restore_args=restore_args, partial_restore=True))
        return self._manager.restore(step, args=args)["state"]["params"]

    def _read(self, step: int, abstract_state: Any) -> tuple[Any, dict[str, Any]]:
        args = ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore())
        restored = self._manager.restore(step, args=args)
        data_state = restored["data"]
        if not isinstance(data_state, dict):
            raise ValueError(f"data_state is {type(data_state).__name__}, expected a dict")
        return restored["state"], data_state


# --------------------------------------------------------------------------------- saving
def _state_save_handler() -> ocp.PyTreeCheckpointHandler:
    """Orbax's pytree handler (what ``StandardSave`` uses): zarr3, no compression; replica-parallel
    writing only with many processes (see the module docstring)."""
    arrays = ocp.type_handlers.ArrayHandler(use_replica_parallel=jax.process_count() > 1,
                                            array_metadata_store=array_metadata_store.Store())
    types = [(ty, arrays if ty is jax.Array else ocp.type_handlers.get_type_handler(ty))
             for ty in ocp.type_handlers.supported_types()]
    return ocp.PyTreeCheckpointHandler(type_handler_registry=ocp.type_handlers.create_type_handler_registry(*types),
                                       use_zarr3=True, use_compression=False)


def _save_args(state: Any, data_state: dict[str, Any]) -> ocp.args.Composite:
    return ocp.args.Composite(state=ocp.args.PyTreeSave(state), data=ocp.args.JsonSave(data_state))


def _check_data_state(data_state: Any) -> dict[str, Any]:
    """A copy of ``data_state`` (a JSON round trip), or ValueError."""
    if not isinstance(data_state, dict):
        raise ValueError(f"data_state must be a JSON-serialisable dict, got {type(data_state).__name__}")
    try:
        return json.loads(json.dumps(data_state))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"data_state must be JSON-serialisable: {exc}") from None


def _standard_state(state: Any) -> Any:
    """``state`` if its leaves are what ``StandardSave`` takes (arrays, ints, floats), with numpy
    scalars made 0-d arrays as ``StandardSave`` stores them; else ValueError naming the leaf."""
    numpy_scalars = False
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        if isinstance(leaf, (jax.Array, np.ndarray, np.generic)):
            if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
                raise ValueError(
                    f"state{jax.tree_util.keystr(path)} is a typed PRNG key array ({leaf.dtype}); save "
                    "jax.random.key_data(key) and rebuild it with jax.random.wrap_key_data after restore"
                )
            numpy_scalars |= isinstance(leaf, np.generic)
        elif not isinstance(leaf, (int, float)):
            raise ValueError(f"state{jax.tree_util.keystr(path)} is a {type(leaf).__name__}; a checkpoint "
                             "holds arrays, ints and floats")
    return jax.tree.map(lambda x: np.asarray(x) if isinstance(x, np.generic) else x, state) if numpy_scalars else state


def _check_abstract(abstract_state: Any) -> None:
    leaves = _flatten_with_paths(abstract_state)
    if not leaves:
        raise ValueError("abstract_state has no leaves; pass a pytree of jax.ShapeDtypeStruct")
    for path, leaf in leaves:
        if not isinstance(leaf, jax.ShapeDtypeStruct) or leaf.sharding is None:
            raise ValueError(
                f"abstract_state{path} must be jax.ShapeDtypeStruct(shape, dtype, sharding=...) with a "
                f"sharding, got {leaf!r}"
            )


def _check_compatible(step: int, stored_tree: Any, abstract_state: Any) -> None:
    """Raise ValueError naming the first paths whose stored shape/dtype differ from the target."""
    stored = ocp.tree.to_flat_dict(stored_tree)
    expected = ocp.tree.to_flat_dict(ocp.tree.serialize_tree(abstract_state, keep_empty_nodes=True))
    problems = []
    for key in sorted(set(stored) | set(expected), key=_path_str):
        if key not in stored:
            problems.append(f"{_path_str(key)}: not in checkpoint, expected {_describe(expected[key])}")
        elif key not in expected:
            problems.append(f"{_path_str(key)}: in checkpoint as {_describe(stored[key])}, not in target")
        else:
            if _describe(stored[key]) != _describe(expected[key]):
                problems.append(
                    f"{_path_str(key)}: checkpoint {_describe(stored[key])} vs expected {_describe(expected[key])}"
                )
    if problems:
        shown = "\n  ".join(problems[:_MAX_MISMATCHES_SHOWN])
        more = len(problems) - _MAX_MISMATCHES_SHOWN
        tail = f"\n  ... and {more} more" if more > 0 else ""
        raise ValueError(
            f"checkpoint step {step} does not match the restore target ({len(problems)} path(s)):\n  "
            f"{shown}{tail}\nThe model or optimizer config differs from the one that wrote this checkpoint."
        )


def _describe(leaf: Any) -> str:
    dtype = getattr(leaf, "dtype", None)
    return f"{tuple(getattr(leaf, 'shape', ()))} {np.dtype(dtype).name if dtype is not None else type(leaf).__name__}"


def resolve_init_from(path: str | os.PathLike[str]) -> tuple[str, int | None]:
    """``(checkpoint directory, step or None)`` for ``checkpoint.init_from``: a directory of steps
    (newest valid step) or one step directory such as ``.../checkpoints/500``."""
    text = os.fspath(path)
    if not os.path.isdir(text):
        raise ValueError(f"checkpoint.init_from={text!r} is not a directory; give a checkpoint directory or one step in it")
    base = os.path.basename(os.path.normpath(text))
    if base.isdigit() and os.path.isdir(os.path.join(text, "state")):
        return os.path.dirname(os.path.normpath(text)), int(base)
    return text, None
