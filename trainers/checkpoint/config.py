"""Checkpoint settings: where steps go, how often and how many are kept, and where a fine-tuning run starts."""

from __future__ import annotations

import dataclasses
import glob
import json
import os


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """How often to checkpoint and how many steps to keep.

    directory: where steps go; ``None`` lets the caller choose (``<run_dir>/checkpoints``,
      see ``resolve_directory``).
    every_steps: save when ``step % every_steps == 0`` (``Checkpointer.should_save``; ``force=True``
      overrides).
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


def resolve_init_from(path: str | os.PathLike[str]) -> tuple[str, int | None]:
    """``(checkpoint directory, step or None)`` for ``checkpoint.init_from``: a directory of steps
    (newest valid step) or one step directory such as ``.../checkpoints/500``."""
    text = os.fspath(path)
    if not os.path.isdir(text):
        raise ValueError(f"checkpoint.init_from={text!r} is not a directory; give a checkpoint directory or one step in it")
    hf = hugging_face_folder(text)
    if hf:
        raise ValueError(f"checkpoint.init_from={text!r} is a Hugging Face folder ({hf}), not a checkpoint directory: "
                         f"give checkpoint.init_from=hf:{text}")
    base = os.path.basename(os.path.normpath(text))
    if base.isdigit() and os.path.isdir(os.path.join(text, "state")):
        return os.path.dirname(os.path.normpath(text)), int(base)
    return text, None


def hugging_face_folder(path: str) -> str:
    """What makes ``path`` a Hugging Face checkpoint folder (a ``config.json`` naming ``architectures``
    beside ``*.safetensors`` files), as words for a message; "" when it is not one."""
    config = os.path.join(path, "config.json")
    tensors = glob.glob(os.path.join(glob.escape(path), "*.safetensors"))
    if not tensors or not os.path.isfile(config):
        return ""
    try:
        with open(config) as f:
            architectures = json.load(f).get("architectures")
    except (OSError, ValueError, AttributeError):
        return ""
    if not architectures:
        return ""
    return f"config.json with architectures {architectures} and {len(tensors)} *.safetensors file(s)"
