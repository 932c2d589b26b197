"""Pretrained models in a run: ``checkpoint.init_from=hf:PATH``, :func:`load_model`, export and text generation.

    cfg = override(recipe("gpt-small"), ["checkpoint.init_from=hf:llama-folder"])  # model.* from its config.json
    model = load_model("runs/x")                      # newest step of a run, sharded as the run shards it
    model = load_model("hf:llama-folder", mesh, "fsdp_tp")
    export_run("runs/x", "out")                       # config.json + safetensors (+ tokenizer.json)

The checkpoint is checked (config, every tensor's name, shape and dtype) in :func:`resolve`, before
the run writes anything or allocates on a device. See docs/pretrained.md.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

import meshes
from spmd.interchange import families, hf_config, load_pretrained, read_params, save_pretrained
from spmd.interchange.loading import plan
from spmd.interchange.safetensors_io import SafetensorsFolder
from spmd.models import GPT, GPTConfig
from spmd.sharding import abstract_module, path_str
from spmd.variables import init_model
from trainers import lora
from trainers.checkpoint import Checkpointer, resolve_init_from
from trainers.checkpoint.config import hugging_face_folder
from trainers.config import Config, override
from trainers.config_files import config_file_overrides
from trainers.logger import CONFIG_FILE

HF = "hf:"


def hf_path(source: str | None) -> str | None:
    """The folder of an ``hf:PATH`` source, or None for anything else."""
    return source[len(HF):] if isinstance(source, str) and source.startswith(HF) else None


def check_checkpoint(path: str, model: GPTConfig) -> None:
    """Every tensor of the Hugging Face folder ``path`` present with the shape and dtype a ``model`` needs
    (abstract shapes only: nothing is allocated); raises ValueError naming the tensor and both shapes."""
    hf = hf_config.read_config(path)
    gpt = abstract_module(lambda: GPT(model, rngs=nnx.Rngs(0)))
    flat = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(nnx.state(gpt, nnx.Param)))[0]
    plan(SafetensorsFolder(path), families.family_of(hf), model, {path_str(p): tuple(x.shape) for p, x in flat})


def resolve(cfg: Config, *, check: bool = True) -> Config:
    """``cfg`` with ``model``'s shapes taken from ``checkpoint.init_from=hf:PATH``'s ``config.json`` (its
    other fields kept) and, with ``check``, every tensor checked (jax-abstract, no device); unchanged otherwise."""
    cfg = lora.resolve(cfg)  # lora.init_from=peft:DIR: lora.rank, alpha and targets from its adapter_config.json
    path = hf_path(cfg.checkpoint.init_from)
    if path is None:
        if cfg.checkpoint.init_from and os.path.isdir(cfg.checkpoint.init_from):
            resolve_init_from(cfg.checkpoint.init_from)  # refuses a Hugging Face folder given without hf:
        return cfg
    if cfg.pipeline.virtual_stages > 1:  # the stacks would be stored in chunk order, the tensors are in natural order
        raise ValueError(f"checkpoint.init_from={cfg.checkpoint.init_from!r} with pipeline.virtual_stages="
                         f"{cfg.pipeline.virtual_stages} (interleaved) is not supported yet; use virtual_stages=1")
    if not os.path.isdir(path):
        raise ValueError(f"checkpoint.init_from={cfg.checkpoint.init_from!r}: {path!r} is not a directory; give a "
                         "Hugging Face checkpoint folder (config.json and *.safetensors)")
    try:
        model = hf_config.gpt_config(hf_config.read_config(path), cfg.model, strict=False)
        if check:
            check_checkpoint(path, model)
    except ValueError as e:
        raise ValueError(f"checkpoint.init_from={cfg.checkpoint.init_from!r}: {e}") from None
    if model.max_length and cfg.data.seq_len > model.max_length:
        raise ValueError(f"data.seq_len={cfg.data.seq_len} exceeds the checkpoint's sliding window {model.max_length} "
                         f"(checkpoint.init_from={cfg.checkpoint.init_from!r}; attention past it does not run here): "
                         f"use data.seq_len <= {model.max_length}")
    if cfg.data.vocab_size > model.vocab_size:
        raise ValueError(f"data.vocab_size={cfg.data.vocab_size} exceeds the checkpoint's vocab_size="
                         f"{model.vocab_size} (checkpoint.init_from={cfg.checkpoint.init_from!r})")
    return dataclasses.replace(cfg, model=model)


def check_overrides(cfg: Config, sets: list[str]) -> None:
    """``--set model.KEY=VALUE`` assignments (as resolved into ``cfg.model``) that contradict the
    ``checkpoint.init_from=hf:PATH`` config.json: one ValueError naming them."""
    path = hf_path(cfg.checkpoint.init_from)
    keys = {s.split("=", 1)[0].strip()[len("model."):] for s in sets if s.strip().startswith("model.")}
    if path is None or not keys or not os.path.isfile(os.path.join(path, "config.json")):
        return
    wrong = hf_config.contradictions(hf_config.read_config(path), {k: getattr(cfg.model, k) for k in keys
                                                                   if hasattr(cfg.model, k)})
    if wrong:
        raise ValueError(f"checkpoint.init_from={cfg.checkpoint.init_from!r} fixes these model settings: "
                         f"{', '.join(wrong)}; leave them unset")


def read_hf_params(cfg: Config, abstract_params: Any) -> Any:
    """The ``hf:PATH`` checkpoint's parameters, each device's shard read from the files (with LoRA: the
    base's, and the adapters of ``lora.init_from`` or as drawn: :func:`trainers.lora.read_with_adapters`)."""
    path = hf_path(cfg.checkpoint.init_from)
    if cfg.lora.enabled:
        return lora.read_with_adapters(cfg, abstract_params, lambda base: read_params(path, cfg.model, base))
    return read_params(path, cfg.model, abstract_params)




def run_config(run_dir: str) -> Config:
    """The config a run directory was trained with (its ``config.json``)."""
    file = os.path.join(run_dir, CONFIG_FILE)
    hf = hugging_face_folder(run_dir)
    if hf:
        raise ValueError(f"{run_dir!r} is a Hugging Face folder ({hf}), not a run directory: give hf:{run_dir}")
    if not os.path.isfile(file):
        raise ValueError(f"{run_dir!r} is not a run directory (no {CONFIG_FILE}); give RUN_DIR, RUN_DIR/STEP or hf:PATH")
    return override(Config(), config_file_overrides(file))


def split_source(source: str) -> tuple[str, int | None]:
    """``(run directory, step or None)`` of ``RUN_DIR``, ``RUN_DIR/STEP`` or ``RUN_DIR/checkpoints/STEP``."""
    path = os.path.normpath(source)
    base = os.path.basename(path)
    if base.isdigit() and not os.path.isfile(os.path.join(path, CONFIG_FILE)):
        parent = os.path.dirname(path)
        if os.path.basename(parent) == "checkpoints" and not os.path.isfile(os.path.join(parent, CONFIG_FILE)):
            parent = os.path.dirname(parent)
        return parent, int(base)
    return path, None


def load_model(source: str, mesh: Mesh | None = None, rules: Any = None, *, peft: str | None = None) -> GPT:
    """A trained or pretrained ``GPT``, its parameters sharded on ``mesh`` by ``rules``.

    ``source``: a run directory (newest valid step), ``RUN_DIR/STEP``, or ``hf:PATH``. Defaults: the
    run's mesh config on this host's devices and its rule set; one device for ``hf:PATH``. ``peft``: a
    PEFT LoRA adapter folder (``spmd-export RUN --to peft``) put on the ``hf:PATH`` model (its base)."""
    path = hf_path(source)
    if path is not None:
        mesh, rules = mesh or meshes.single_device_mesh(), rules or "none"
        return lora.load_adapted(path, peft=peft, mesh=mesh, rules=rules) if peft else \
            load_pretrained(path, mesh, rules)
    if peft:
        raise ValueError(f"load_model(peft={peft!r}) puts a PEFT adapter on a Hugging Face base: give the source as "
                         f"hf:PATH (the base the adapter was trained on), got {source!r}")
    run_dir, step = split_source(source)
    cfg = run_config(run_dir)
    mesh = mesh or cfg.mesh.build()
    rules = rules or cfg.rules
    model_vars = init_model(lambda: GPT(cfg.model, rngs=nnx.Rngs(0), lora=cfg.lora.spec), rules, mesh, abstract=True)
    abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            model_vars.params, model_vars.shardings["params"])
    directory = cfg.checkpoint.resolve_directory(run_dir)
    if not os.path.isdir(directory):
        raise ValueError(f"{run_dir!r} has no checkpoints ({directory} does not exist)")
    with Checkpointer(directory, cfg.checkpoint, read_only=True) as ckpt:
        _, params = ckpt.restore_params(abstract, step=step)
    return model_vars.merge(params, model_vars.other)  # type: ignore[return-value]  # a GPT: model_vars are one's


def model_changes(model: GPTConfig) -> list[str]:
    """How the exported Hugging Face model would compute differently from ``model`` (words for a message;
    empty when it computes the same)."""
    changes = []
    if model.n_experts and model.capacity_factor > 0:
        changes.append(f"model.capacity_factor={model.capacity_factor:g}: each expert took at most "
                       f"ceil({model.capacity_factor:g} x tokens x {model.experts_per_token} / {model.n_experts}) "
                       f"tokens per device and the rest were dropped, while {families.family_for(model).architecture} "
                       "is dropless: the exported model routes every token, so its outputs differ wherever a token "
                       "was dropped")
    return changes


def export_run(source: str, out: str, *, dtype: str = "float32", max_shard_bytes: int = 2 << 30,
               allow_model_change: bool = False, to: str = "hf") -> list[str]:
    """Write a run's step (``RUN_DIR[/STEP]``) as a Hugging Face folder ``out`` (its tokenizer.json too when
    the run used one); restored on this host's first device, written one parameter at a time. A model the
    Hugging Face family computes differently (:func:`model_changes`) is refused unless ``allow_model_change``.
    A LoRA run's adapters are merged into the weights; ``to="peft"`` writes them alone, as PEFT's adapter."""
    if to not in ("hf", "peft"):
        raise ValueError(f"export format {to!r} is not one of hf, peft")
    if hf_path(source) is not None:
        raise ValueError(f"{source!r} is already a Hugging Face folder: spmd-export writes a run directory "
                         f"(RUN_DIR or RUN_DIR/STEP) as one; to use the folder, give it as {source} to spmd-generate "
                         f"or as checkpoint.init_from={source} to spmd-train")
    if os.path.exists(os.path.join(out, "config.json")):
        raise ValueError(f"{out!r} already holds a config.json; export into a new or empty directory")
    run_dir, _ = split_source(source)
    cfg = run_config(run_dir)
    hf_config.to_hf_config(cfg.model, dtype)  # refuses what has no Hugging Face family before any read
    changes = model_changes(cfg.model)
    if changes and not allow_model_change:
        raise ValueError(f"exporting {source!r} would change the model: {'; '.join(changes)}. Pass "
                         "--allow-model-change to export it anyway (export_run(..., allow_model_change=True)), "
                         "or export a run trained with model.capacity_factor=0 (dropless)")
    if to == "peft" and not cfg.lora.enabled:
        raise ValueError(f"{source!r} was trained without LoRA (lora.rank=0): it has no adapters to export as "
                         "PEFT's; export it with --to hf")
    model = load_model(source, meshes.single_device_mesh(), "none")
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    spec = cfg.lora.spec
    if to == "peft" and spec is not None:
        return lora.save_peft(out, spec, params, base=hf_path(cfg.checkpoint.init_from) or "")
    if spec is not None:
        params = lora.merged(params, spec)
    files = save_pretrained(out, cfg.model, params, dtype=dtype, max_shard_bytes=max_shard_bytes)
    if cfg.data.tokenizer:
        shutil.copy(cfg.data.tokenizer, os.path.join(out, "tokenizer.json"))
        files.append("tokenizer.json")
    return files


def max_positions(source: str) -> tuple[int, str]:
    """``(positions, where that bound comes from)``: the longest sequence (prompt + generated tokens) the
    model of ``source`` is defined for: its sliding window (``model.max_length``), else its Hugging Face
    ``max_position_embeddings``, else what an export of the run would write (4096)."""
    path = hf_path(source)
    if path is not None:
        hf = hf_config.read_config(path)
        model = hf_config.gpt_config(hf, strict=False)
        if model.max_length:
            return model.max_length, f"the sliding window of {path}/config.json"
        if hf.get("max_position_embeddings"):
            return int(hf["max_position_embeddings"]), f"max_position_embeddings of {path}/config.json"
        return EXPORTED_POSITIONS, "the default max_position_embeddings"
    cfg = run_config(split_source(source)[0])
    if cfg.model.max_length:
        return cfg.model.max_length, f"the run's model.max_length={cfg.model.max_length}"
    return EXPORTED_POSITIONS, "the max_position_embeddings an export of the run writes"


EXPORTED_POSITIONS = 4096  # max_position_embeddings written for a model without max_length (hf_config.to_hf_config)


def tokenizer_for(source: str):
    """The tokenizer of a run (``data.tokenizer``) or an ``hf:PATH`` folder (its tokenizer.json), or None
    for bytes (token id = byte value)."""
    from trainers.data.tokenizer import load_tokenizer

    path = hf_path(source)
    if path is not None:
        file = os.path.join(path, "tokenizer.json")
        return load_tokenizer(file)[0] if os.path.isfile(file) else None
    return tokenizer_for_config(run_config(split_source(source)[0]))


def encode(tokenizer, text: str) -> np.ndarray:
    return np.asarray(tokenizer.encode(text).ids if tokenizer else list(text.encode("utf-8")), np.int32)


def decode(tokenizer, ids) -> str:
    ids = [int(i) for i in ids]
    if tokenizer:
        return tokenizer.decode(ids)
    return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def sampling_hook(cfg: Config, task: Any, sharded: Any, mesh: Mesh, rules: Any, logger: Any, step_hook: Any,
                  current_state: Any) -> Any:
    """``step_hook`` followed, every ``run.sample_every`` steps, by a few continuations of
    ``run.sample_prompt`` from the current parameters (``generate`` under the run's mesh and rules,
    temperature 0.8, seeded by the step), written to the log and TensorBoard's text tab."""
    every = cfg.run.sample_every
    if not every or not task.generates or cfg.pipeline.enabled or cfg.local_sgd.enabled:
        return step_hook
    from spmd.models import generate

    tokenizer = tokenizer_for_config(cfg)
    prompt = encode(tokenizer, cfg.run.sample_prompt)
    rows = max(2, int(np.prod([mesh.shape[a] for a in mesh.axis_names if a != "tensor"])))

    def hook(step: int) -> None:
        if step_hook is not None:
            step_hook(step)
        if step % every:
            return
        state = current_state()
        model = sharded.model.merge(state.params, state.model_state or {})
        out = np.asarray(jax.device_get(generate(model, np.tile(prompt, (rows, 1)), 32, 0.8, 0, 1.0, step,
                                                 mesh=mesh, rules=rules)))
        texts = [cfg.run.sample_prompt + decode(tokenizer, row) for row in out[:3]]
        logger.message(f"samples at step {step}: " + " | ".join(repr(t) for t in texts))
        logger.text("samples", "\n\n".join(texts), step)

    return hook


def tokenizer_for_config(cfg: Config):
    """The run's ``data.tokenizer``, or None for bytes."""
    from trainers.data.tokenizer import load_tokenizer

    return load_tokenizer(cfg.data.tokenizer)[0] if cfg.data.tokenizer else None
