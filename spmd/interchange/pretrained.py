"""Pretrained checkpoints in and out: a Hugging Face folder <-> a sharded ``spmd.models.GPT``.

    cfg = pretrained_config("llama-folder")                            # GPTConfig from config.json
    model = load_pretrained("llama-folder", mesh, "fsdp_tp")            # sharded GPT, read slice by slice
    save_pretrained("out", cfg, params)                                 # config.json + safetensors

No torch anywhere: safetensors reads and writes numpy. See docs/pretrained.md.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh

import meshes
from spmd.interchange.families import Family, family_for, family_of
from spmd.interchange.hf_config import checkpoint_dtype, gpt_config, read_config, to_hf_config
from spmd.interchange.loading import hf_tensors, plan, read_tensors
from spmd.interchange.safetensors_io import SafetensorsFolder, write_folder
from spmd.models.gpt import GPT, GPTConfig
from spmd.rules import Rules
from spmd.sharding import path_str
from spmd.variables import init_model

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def pretrained_config(path: str, base: GPTConfig | None = None) -> GPTConfig:
    """The ``GPTConfig`` that runs the checkpoint at ``path`` (other fields from ``base``; see ``gpt_config``)."""
    return gpt_config(read_config(path), base)


def _flat(tree: Any) -> dict[str, Any]:
    return {path_str(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def read_params(path: str, cfg: GPTConfig, abstract_params: Any, *, folder: SafetensorsFolder | None = None) -> Any:
    """The checkpoint's parameters in the structure, shapes and shardings of ``abstract_params`` (a pure
    dict of ``ShapeDtypeStruct`` with shardings, as a train state's ``params``); checked before any read.
    ``folder``: an open reader of ``path`` (its ``bytes_read`` then counts this load's reads)."""
    hf = read_config(path)
    family = family_of(hf)
    checkpoint_dtype(hf)
    folder = folder or SafetensorsFolder(path)
    flat = _flat(abstract_params)
    plan(folder, family, cfg, {k: tuple(v.shape) for k, v in flat.items()})
    try:
        loaded = read_tensors(folder, family, cfg, flat)
    finally:
        folder.close()
    leaves = jax.tree_util.tree_flatten_with_path(abstract_params)
    return jax.tree.unflatten(leaves[1], [loaded[path_str(p)] for p, _ in leaves[0]])


def load_pretrained(path: str, mesh: Mesh | None = None, rules: Rules | str = "none",
                    base: GPTConfig | None = None) -> GPT:
    """A ``GPT`` with the checkpoint's weights, each parameter sharded on ``mesh`` by ``rules`` as a
    training run would shard it (default: one device). Only this process's shards are read."""
    cfg = pretrained_config(path, base)
    mesh = mesh or meshes.single_device_mesh()
    model_vars = init_model(lambda: GPT(cfg, rngs=nnx.Rngs(0)), rules, mesh, abstract=True)
    abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            model_vars.params, model_vars.shardings["params"])
    model = model_vars.merge(read_params(path, cfg, abstract), model_vars.other)
    assert isinstance(model, GPT)
    return model


def save_pretrained(out: str, cfg: GPTConfig, params: Any, *, dtype: str = "float32", family: Family | None = None,
                    tokenizer_dir: str | None = None, max_shard_bytes: int = 2 << 30) -> list[str]:
    """Write ``params`` (a GPT's parameters, pure dict) of a ``cfg`` model as a Hugging Face folder ``out``:
    ``config.json``, safetensors shards in ``dtype``, and the tokenizer files of ``tokenizer_dir`` if given.
    Returns the files written. ``transformers`` loads the folder with no custom code."""
    family = family or family_for(cfg)
    hf = to_hf_config(cfg, dtype, family)
    os.makedirs(out, exist_ok=True)
    files = write_folder(out, hf_tensors(family, cfg, _flat(params), dtype), max_shard_bytes=max_shard_bytes)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(hf, f, indent=2)
    files.append("config.json")
    for name in TOKENIZER_FILES if tokenizer_dir else ():
        if os.path.isfile(os.path.join(tokenizer_dir, name)):
            shutil.copy(os.path.join(tokenizer_dir, name), os.path.join(out, name))
            files.append(name)
    return files
