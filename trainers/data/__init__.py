"""Data: corpora, per-process loaders of the global batch that resume exactly, and batch assembly.

    from trainers.data import DataConfig, ExampleLoader, make_loader, to_global
"""

from trainers.data.batches import process_rows, to_global
from trainers.data.config import DataConfig, load_corpus, make_loader
from trainers.data.corpus import npy_corpus, stdlib_corpus, synthetic_corpus, text_corpus
from trainers.data.loader import ExampleLoader, IterLoader, Loader, TokenWindows

__all__ = [
    "DataConfig", "ExampleLoader", "IterLoader", "Loader", "TokenWindows", "load_corpus", "make_loader",
    "npy_corpus", "process_rows", "stdlib_corpus", "synthetic_corpus", "text_corpus", "to_global",
]
