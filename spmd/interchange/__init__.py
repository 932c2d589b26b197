"""Model interchange: Hugging Face checkpoints (safetensors + ``config.json``) in and out of the sharded GPT.

Per-family tables (``families``), ``config.json`` translation (``hf_config``), a lazy safetensors
reader and sharded writer (``safetensors_io``), slice-by-slice loading (``loading``), and the
entry points (``pretrained``). Imports nothing from ``trainers``; no torch.
"""

from spmd.interchange.families import FAMILIES, Family, Tensor
from spmd.interchange.pretrained import load_pretrained, pretrained_config, read_params, save_pretrained

__all__ = ["FAMILIES", "Family", "Tensor", "load_pretrained", "pretrained_config", "read_params", "save_pretrained"]
