"""What to train: a :class:`Task` carries the model, the loss, the data and the eval metrics.

    Task(model=lambda rngs: Model(rngs=rngs), loss=loss, data=examples, eval_metrics={...})

``trainers.train(cfg, task)`` trains any task with every feature of the run; the built-in GPT is
one task (:func:`lm_task`). The contract: docs/training.md.
"""

from __future__ import annotations

import dataclasses
import importlib
import traceback
from collections.abc import Callable, Mapping
from typing import Any

from flax import nnx

from trainers.blame import frame_owner
from trainers.checks.issue import name_config_key
from trainers.checks.layout import check_heads
from trainers.config import Config
from trainers.data import TokenWindows, load_corpus
from trainers.data.checks import check_document_ids, check_examples, check_token_ids, check_windows
from trainers.data.config import DOCUMENT_CORPORA
from trainers.data.packing import packed_stream
from trainers.objectives.config import check_objective
from trainers.step import LossFn, MetricFn, lm_loss_fn


@dataclasses.dataclass(frozen=True)
class Task:
    """A model, its loss, its data and its eval metrics: everything a run needs that is not config."""

    model: Callable[[nnx.Rngs], nnx.Module]
    loss: LossFn
    data: Any
    eval_data: Any = None
    eval_metrics: Mapping[str, MetricFn] = dataclasses.field(default_factory=dict)
    flops_per_example: float | None = None
    tokens_per_example: int | None = None  # tokens/s in the log (e.g. seq_len of an LM); None logs examples/s
    path_rules: tuple = ()
    config: Config | None = None
    name: str = "task"
    pipelined: bool = False
    vocab_size: int | None = None  # set: batch[k] for k in token_keys must hold ids in [0, vocab_size), checked per batch
    token_keys: tuple[str, ...] = ("inputs", "targets")
    checks: Callable[[Config, Any, Mapping[str, int]], list] | None = None  # (cfg, rules, mesh sizes) -> layout Issues
    explain: Callable[[Exception], str] | None = None  # a RulesError on the model -> a message naming config keys
    generates: bool = False  # the model is a spmd.models.GPT that spmd.models.generate samples (run.sample_every)
    start: Callable[[Any], Any] | None = None  # a fresh state with loaded params (checkpoint.init_from) -> the start state

    def __post_init__(self) -> None:
        for field in ("model", "loss"):
            if not callable(getattr(self, field)):
                raise TypeError(f"Task.{field} must be callable, got {type(getattr(self, field)).__name__}")
        if self.data is None:
            raise TypeError("Task.data is required: a grain MapDataset of examples, an iterable of batches, or cfg -> one")
        if not isinstance(self.eval_metrics, Mapping) or not all(callable(f) for f in self.eval_metrics.values()):
            raise TypeError(f"Task.eval_metrics must map names to functions (model, batch) -> values[B], "
                            f"got {self.eval_metrics!r}")
        if self.flops_per_example is not None and not self.flops_per_example > 0:
            raise ValueError(f"Task.flops_per_example must be > 0 or None, got {self.flops_per_example!r}")
        if self.vocab_size is not None and (isinstance(self.vocab_size, bool) or not isinstance(self.vocab_size, int)
                                            or self.vocab_size < 1):
            raise ValueError(f"Task.vocab_size must be a positive int or None, got {self.vocab_size!r}")
        if self.config is not None and not isinstance(self.config, Config):
            raise TypeError(f"Task.config must be a trainers.Config, got {type(self.config).__name__}")

    def train_source(self, cfg: Config, *, check: bool = True) -> Any:
        """The train data for ``cfg``; ``check=False`` (the dry run reads one example) skips the check that
        it holds at least one global batch of examples."""
        source = _build(self.data, cfg)
        if check and hasattr(source, "__len__") and hasattr(source, "__getitem__"):  # examples the loader batches
            check_examples(len(source), cfg.data.global_batch, what=f"task {self.name!r}'s data")
        return source

    def eval_source(self, cfg: Config) -> Any:
        return None if self.eval_data is None else _build(self.eval_data, cfg)


def _build(data: Any, cfg: Config) -> Any:
    """``data``, or ``data(cfg)`` when it is a factory (a callable that is not itself a dataset)."""
    is_dataset = hasattr(data, "__getitem__") or hasattr(data, "__iter__")
    return call_user(data, "the task's data function", cfg) if callable(data) and not is_dataset else data


class UserCodeError(ValueError):
    """Code outside the toolkit (a task factory, a data function) raised: the message names it and its frame."""


def call_user(fn: Callable, what: str, *args: Any) -> Any:
    """``fn(*args)``; an exception from code outside the toolkit becomes a :class:`UserCodeError` naming
    ``what`` and the innermost frame of that code (the toolkit's own functions are called as they are)."""
    if getattr(fn, "__module__", "").split(".")[0] in ("meshes", "spmd", "trainers"):
        return fn(*args)
    try:
        return fn(*args)
    except Exception as exc:
        if type(exc).__module__.split(".")[0] in ("meshes", "spmd", "trainers"):
            raise  # the toolkit's own error, raised for the user's call: its message already says what is wrong
        raise _user_error(exc, f"{what} {getattr(fn, '__qualname__', fn)!s}") from exc


def _user_error(exc: BaseException, what: str) -> UserCodeError:
    frames = [f for f in traceback.extract_tb(exc.__traceback__)[1:] if _is_user_file(f.filename)]
    at = f" at {frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}" if frames else ""
    return UserCodeError(f"{what} raised {type(exc).__name__}: {exc}{at}; the error is in that code, not in the "
                         "toolkit (--debug shows the traceback)")


def _is_user_file(filename: str) -> bool:
    """Whether a traceback frame is the user's: not the toolkit's packages, not the standard library, not one
    of the toolkit's dependencies (a task installed into site-packages is the user's: :func:`trainers.blame.frame_owner`)."""
    return frame_owner(filename) == "task"


def lm_model(model_cfg: Any, lora: Any = None) -> Callable[[nnx.Rngs], nnx.Module]:
    """The built-in model of a ``spmd.models.GPTConfig``, as a task's ``rngs -> module`` (the one place
    the trainer layer names the GPT class); ``lora``: a ``spmd.models.lora.LoRASpec`` (adapters) or None."""
    from spmd.models import GPT

    return lambda rngs: GPT(model_cfg, rngs=rngs, lora=lora)


def check_validation_split(cfg: Config) -> None:
    """Evals of the built-in task read the corpus's validation split: refuse, before anything runs, a config
    that leaves that split empty (``data.validation_fraction=0``) with evals on."""
    if cfg.run.eval_batches != 0 and cfg.data.validation_fraction == 0 and cfg.data.corpus != "synthetic":
        raise ValueError(f"data.validation_fraction=0 leaves data.corpus={cfg.data.corpus!r} no validation split, but "
                         f"evals are on (run.eval_batches={cfg.run.eval_batches} every run.eval_every="
                         f"{cfg.run.eval_every} steps and at the end): give data.validation_fraction > 0 (e.g. 0.05), "
                         "or turn evals off with run.eval_batches=0")


def lm_task(cfg: Config) -> Task:
    """The built-in task: ``spmd.models.GPT(cfg.model)`` on ``cfg.data``'s token corpus, next-token loss
    (``run.objective=dpo``: DPO on its preference pairs, :func:`trainers.objectives.dpo.dpo_task`)."""
    from spmd.models import flops_per_step

    check_objective(cfg.run.objective)
    if cfg.run.objective == "dpo":
        return dpo_task(cfg)
    from spmd.models.packed import document_count, document_losses

    check_validation_split(cfg)
    model_cfg = cfg.model
    data: Callable[[Config], Any]
    eval_data: Callable[[Config], Any]
    if cfg.data.corpus in DOCUMENT_CORPORA:  # documents packed into rows (trainers.data.packing)
        data, eval_data = (lambda c: checked_documents(c)), (lambda c: packed_stream(c.data, "validation", train=False))
        eval_metrics = {"document_loss": document_losses, "documents": document_count} \
            if cfg.data.packing_mode == "segments" else {}
    else:
        data, eval_data = (lambda c: lm_windows(c, "train")), (lambda c: lm_windows(c, "validation"))
        eval_metrics = {}
    return Task(
        model=lm_model(model_cfg, cfg.lora.spec),
        loss=lm_loss_fn(cfg.run.z_loss, cfg.pipeline),
        data=data,
        eval_data=eval_data,
        eval_metrics=eval_metrics,
        flops_per_example=flops_per_step(model_cfg, 1, cfg.data.seq_len, lora=cfg.lora.spec),
        tokens_per_example=cfg.data.seq_len,
        config=cfg,
        name="lm",
        pipelined=True,
        checks=lambda c, rules, sizes: check_heads(c.model, rules, dict(sizes)),
        explain=name_config_key,
        generates=True,
    )


def dpo_task(cfg: Config) -> Task:
    """The built-in GPT trained with DPO on ``cfg.data``'s preference pairs against a frozen reference
    (``run.objective=dpo``: :mod:`trainers.objectives.dpo`): a copy of the model as it starts, or with LoRA
    (``lora.rank > 0``) the same model with its adapters switched off (no copy)."""
    from spmd.models import flops_per_step
    from spmd.models.dpo import with_reference
    from trainers.objectives import dpo

    dpo.check_dpo(cfg)
    check_validation_split(cfg)
    model_cfg, policy = cfg.model, lm_model(cfg.model, cfg.lora.spec)
    if cfg.lora.enabled:  # the reference is the base without its adapters: the policy's own frozen weights
        model, loss, start = policy, dpo.dpo_loss_fn(cfg.dpo, reference=dpo.base_logps, pipeline=cfg.pipeline), None
    else:
        model, loss, start = (lambda rngs: with_reference(policy(rngs))), \
            dpo.dpo_loss_fn(cfg.dpo, pipeline=cfg.pipeline), dpo.reference_from_params
    return Task(
        model=model,
        loss=loss,
        data=lambda c: dpo.pair_data(c, "train"),
        eval_data=lambda c: dpo.pair_data(c, "validation"),
        flops_per_example=flops_per_step(model_cfg, 1, cfg.data.seq_len, lora=cfg.lora.spec, reference=True),
        tokens_per_example=cfg.data.seq_len,
        config=cfg,
        name="dpo",
        pipelined=True,
        checks=lambda c, rules, sizes: check_heads(c.model, rules, dict(sizes)),
        explain=name_config_key,
        start=start,
    )


def checked_documents(cfg: Config) -> Any:
    """The packed train stream of ``cfg.data``'s document corpus, once every token id of its
    pre-tokenized fields (both splits) is checked inside ``[0, data.vocab_size)``."""
    stream = packed_stream(cfg.data, "train")
    check_document_ids(stream.docs, cfg.data.vocab_size)
    return stream


def lm_windows(cfg: Config, split: str) -> TokenWindows:
    """The windows of one split of ``cfg.data``'s corpus, checked before anything compiles: every id in
    ``[0, data.vocab_size)``, and (train) at least one global batch of windows."""
    data = cfg.data
    tokens = load_corpus(data, split)
    what = f"corpus {data.corpus!r}" + (f" at data.path={data.path!r}" if data.path else "") + f" ({split} split)"
    if data.corpus != "tokens":  # a prepared folder's ids were checked against its vocab when it was read
        check_token_ids(tokens, data.vocab_size, what=what)
    windows = TokenWindows(tokens, data.seq_len)
    if split == "train":
        check_windows(len(windows), data.global_batch, data.seq_len, tokens.shape[0], what=what)
    return windows


def load_task(target: str) -> Task:
    """The :class:`Task` named ``"package.module:attribute"`` (a Task, or a function of no arguments returning one)."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"task {target!r} is not of the form package.module:attribute")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"task {target!r}: cannot import module {module_name!r} ({exc})") from None
    except Exception as exc:  # the module's own code failed while it was imported
        raise _user_error(exc, f"task {target!r}: importing {module_name!r}") from exc
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = sorted(n for n in dir(module) if not n.startswith("_"))
            raise ValueError(f"task {target!r}: module {module_name!r} has no attribute {attr!r}; it has: {', '.join(names)}")
        obj = getattr(obj, part)
    if not isinstance(obj, Task) and callable(obj):
        obj = call_user(obj, f"task {target!r}:")
    if not isinstance(obj, Task):
        raise ValueError(f"task {target!r} is of type {type(obj).__name__}, not a trainers.Task (or a function returning one)")
    return obj
