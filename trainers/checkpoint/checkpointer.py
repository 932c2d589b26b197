"""Checkpoints of a training run: async save, keep-N, validated resume, restore onto another mesh.

    ckpt = Checkpointer(directory, CheckpointConfig(every_steps=100, keep=3))
    ckpt.save(step, state, data_state)
    step, state, data_state = ckpt.restore(abstract_state)   # None: no step on disk

Steps are orbax ``CheckpointManager`` directories with a ``state`` and a ``data`` item; restore
validates every step and falls back to older ones. See docs/checkpoints.md.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from trainers.checkpoint import layer_order, storage, upgrade
from trainers.checkpoint.config import CheckpointConfig
from trainers.checkpoint.host_copy import HostCopy
from trainers.checkpoint.validation import (
    agree,
    check_abstract,
    check_compatible,
    check_data_state,
    short,
    standard_state,
)
from trainers.state import TrainState

logger = logging.getLogger(__name__)


class NoUsableCheckpointError(RuntimeError):
    """Checkpoint steps exist, but none of them could be restored."""


class CheckpointTimeoutError(TimeoutError):
    """A save did not commit within ``checkpoint.timeout_s``."""


class Checkpointer:
    """Saves and restores ``(step, state, data_state)`` under one directory with orbax."""

    def __init__(self, directory: str | os.PathLike[str], config: CheckpointConfig = CheckpointConfig(), *,
                 read_only: bool = False, layer_orders: layer_order.StackOrders = ()) -> None:
        """``read_only`` opens another run's checkpoints (``init_from``): nothing is created,
        cleaned up or saved there. ``layer_orders``: the run's stacks not stored in natural order
        (``ShardedState.layer_orders``); steps hold them in natural order (:mod:`.layer_order`)."""
        if not isinstance(config, CheckpointConfig):
            raise ValueError(f"config must be a CheckpointConfig, got {type(config).__name__}")
        text = os.fspath(directory)
        if not text:
            raise ValueError("directory must be a non-empty path, got ''")
        self.directory = epath.Path(text if "://" in text else os.path.abspath(text))
        self.config = config
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None,  # keep-N counts valid steps only: :meth:`_retain`
            enable_async_checkpointing=config.async_save,
            async_options=ocp.options.AsyncOptions(timeout_secs=max(1, int(config.timeout_s))),
            cleanup_tmp_directories=not read_only,  # leftovers of a save interrupted by a crash
            create=not read_only,
            read_only=read_only,
        )
        self.read_only = read_only
        self.layer_orders = layer_orders
        if read_only and not self.directory.is_dir():
            raise ValueError(f"checkpoint directory {self.directory} does not exist")
        self._manager = ocp.CheckpointManager(self.directory, handler_registry=storage.handler_registry(),
                                              options=options)
        # One process, async: orbax's blocking part runs here, on a host copy of the state.
        self._background = config.async_save and not read_only and jax.process_count() == 1
        self._executor = (concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-save")
                          if self._background else None)
        self._handoff: concurrent.futures.Future[None] | None = None
        self._last_copy: HostCopy | None = None  # its host buffers are reused by the next save

    # ----------------------------------------------------------------------------- saving
    def should_save(self, step: int, *, force: bool = False) -> bool:
        """Whether ``step`` is due for a checkpoint: ``force`` (the caller's last step, a preemption
        stop), ``step % every_steps == 0``, or an orbax preemption sync point. The one place the
        cadence is decided; call it once per step (the sync point is a per-step query)."""
        return force or step % self.config.every_steps == 0 or self._manager.reached_preemption(step)

    def save(self, step: int, state: Any, data_state: dict[str, Any], *, force: bool = False) -> bool:
        """Start saving ``step`` if it is due (:meth:`should_save`); returns whether a save was started.

        A caller that already asked :meth:`should_save` passes ``force=True``. With ``async_save``
        this returns once the state is copied to host memory (the caller may then donate or
        overwrite it); ``wait()`` blocks until the step is committed. An existing valid step is not
        overwritten (logged, returns False).
        """
        if self.read_only:
            raise ValueError(f"this Checkpointer of {self.directory} is read-only; saving step {step!r} is not allowed")
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise ValueError(f"step must be an integer >= 0, got {step!r}")
        step = int(step)
        data_state = check_data_state(data_state)
        state = standard_state(state.as_dict() if isinstance(state, TrainState) else state)  # on disk: a dict
        if not self.should_save(step, force=force):
            return False
        # One save in flight at a time, as with orbax's own save: wait for the previous one to commit
        # (normally long done). Its host buffers are then free: orbax has finished reading them.
        self._finish_handoff()
        self._manager.wait_until_finished()
        self._retain()
        if step in self._manager.all_steps() or (self.directory / str(step)).exists():
            self._manager.reload()  # the manager's view of the directory becomes what is on disk
            if step in self._manager.all_steps():
                reason = agree(self._invalid_reason(step)[0])
                if reason is None:
                    logger.info("checkpoint step %d already exists in %s; not saving it again", step, self.directory)
                    return False
                logger.warning("checkpoint step %d in %s is unusable (%s); replacing it", step, self.directory, reason)
                self._manager.delete(step)
        state = layer_order.to_natural(state, self.layer_orders)
        if not self._background:
            saved = bool(self._manager.save(step, args=storage.save_args(state, data_state), force=True))
            if not self.config.async_save:
                self._retain()
            return saved
        spare, self._last_copy = (self._last_copy.buffers if self._last_copy else None), None
        copy = HostCopy(state, spare)  # the only blocking work: from here on the caller's arrays are not used
        self._last_copy = copy
        self._handoff = self._executor.submit(self._hand_off, step, copy, data_state)
        return True

    def _hand_off(self, step: int, copy: HostCopy, data_state: dict[str, Any]) -> None:
        """Background thread: orbax's blocking part of an async save, on arrays rebuilt from ``copy``."""
        try:
            if not self._manager.save(step, args=storage.save_args(copy.arrays(), data_state), force=True):
                raise RuntimeError("orbax declined to start the save")
        except Exception as exc:
            raise RuntimeError(f"saving checkpoint step {step} in {self.directory} failed: {short(exc)}") from exc

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
        self._retain()

    def _retain(self) -> None:
        """Delete the oldest valid steps beyond ``config.keep``. A step that is not valid (empty, partial,
        unreadable) neither counts nor is deleted: restore skips it, and it stays for inspection."""
        if self.read_only:
            return
        # no more than keep steps on disk: none to delete, and no step's metadata is read (each read costs ~0.1 s)
        doomed = self.valid_steps()[:-self.config.keep] if len(self.all_steps()) > self.config.keep else []
        if jax.process_count() > 1:  # every process deletes the same steps (orbax's delete is a barrier)
            from jax.experimental import multihost_utils

            padded = np.full((64,), -1, np.int64)
            padded[:min(len(doomed), 64)] = doomed[:64]
            doomed = [int(s) for s in multihost_utils.broadcast_one_to_all(padded) if s >= 0]
        if doomed:
            self._manager.reload()  # its view of the directory becomes what is on disk
        for step in doomed:
            self._manager.delete(step)

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

    def newest_tree(self) -> tuple[int, Any] | None:
        """``(step, stored state tree)`` of the newest valid step: shapes and dtypes, no data (None: no valid step)."""
        steps = self.valid_steps()
        return (steps[-1], self._invalid_reason(steps[-1])[1]) if steps else None

    def _invalid_reason(self, step: int) -> tuple[str | None, Any]:
        """(None, state metadata tree) for a usable step, else (reason, None)."""
        self._finish_handoff()  # orbax's manager is not shared with the background thread
        path = self.directory / str(step)
        if not ocp.step.is_path_finalized(path):
            return "not finalised (save still running or interrupted)", None
        for item in storage.ITEMS:
            if not (path / item).is_dir():
                return f"item '{item}' is missing", None
            if not (path / item / storage.ITEM_FILES[item]).exists():
                return f"item '{item}' has no '{storage.ITEM_FILES[item]}' file", None
        try:
            metadata = self._manager.item_metadata(step)["state"]
        except Exception as exc:  # tensorstore NOT_FOUND / OUT_OF_RANGE and friends
            return f"state metadata unreadable: {short(exc)}", None
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
        typed = isinstance(abstract_state, TrainState)
        abstract_state = abstract_state.as_dict() if typed else abstract_state
        check_abstract(abstract_state)
        found, restored, failures = self._restore_newest(abstract_state, step, lambda stored: (None, stored),
                                                         self._read, "checkpoint")
        if found is not None:
            state, data_state = restored
            return found, TrainState.from_dict(state) if typed else state, data_state
        if not failures:
            return None
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
        check_abstract(abstract_params)

        def params_of(stored: Any) -> tuple[str | None, Any]:
            if isinstance(stored, dict) and "params" in stored:
                return None, stored["params"]
            keys = sorted(stored) if isinstance(stored, dict) else type(stored).__name__
            return f"no 'params' in the stored state (top-level keys: {keys})", None

        found, params, failures = self._restore_newest(abstract_params, step, params_of, self._read_params,
                                                       "params of checkpoint")
        if found is not None:
            return found, params
        listing = "\n".join(f"  step {s}: {r}" for s, r in failures) or "  (no steps)"
        raise NoUsableCheckpointError(f"no params could be restored from {self.directory}:\n{listing}")

    def _restore_newest(self, abstract: Any, step: int | None, select: Callable[[Any], tuple[str | None, Any]],
                        read: Callable[[int, Any], Any], what: str) -> tuple[int | None, Any, list[tuple[int, str]]]:
        """``(step, read(step, abstract), failures)`` for ``step``, or else the newest step that is valid,
        holds what ``select`` picks from its stored tree, matches ``abstract`` and reads; each step
        skipped is logged with its reason and listed in ``failures`` (``(None, None, failures)`` when
        none restores). Every process takes the same branch."""
        self._finish_handoff()
        self._manager.wait_until_finished()
        self._manager.reload()
        steps = self.all_steps()
        if step is not None and step not in steps:
            raise ValueError(f"step {step!r} is not a checkpoint in {self.directory}; steps on disk: {steps}")
        failures: list[tuple[int, str]] = []
        for candidate in [step] if step is not None else sorted(steps, reverse=True):
            reason, stored = self._invalid_reason(candidate)
            if reason is None:
                reason, stored = select(stored)
            reason = agree(reason)
            if reason is None:
                target, finish = upgrade.plan(stored, abstract)  # an older parameter layout: converted on load
                check_compatible(candidate, stored, target)
                try:
                    value = finish(read(candidate, target))
                except Exception as exc:  # corrupt data discovered only while reading
                    reason = f"restore failed: {short(exc)}"
                reason = agree(reason)
            if reason is None:
                logger.info("restored %s step %d from %s", what, candidate, self.directory)
                return candidate, value, failures
            failures.append((candidate, reason))
            logger.warning("skipping checkpoint step %d in %s: %s", candidate, self.directory, reason)
        return None, None, failures

    def _read_params(self, step: int, abstract_params: Any) -> Any:
        params = self._manager.restore(step, args=storage.params_restore_args(abstract_params))["state"]["params"]
        return layer_order.from_natural(params, self.layer_orders)

    def _read(self, step: int, abstract_state: Any) -> tuple[Any, dict[str, Any]]:
        restored = self._manager.restore(step, args=storage.restore_args(abstract_state))
        data_state = restored["data"]
        if not isinstance(data_state, dict):
            raise ValueError(f"data_state is {type(data_state).__name__}, expected a dict")
        return layer_order.from_natural(restored["state"], self.layer_orders), data_state
