"""Data: corpora, per-process loaders of the global batch that resume exactly, and batch assembly;
document corpora packed into rows (segment ids, positions, loss weights).

    from trainers.data import DataConfig, ExampleLoader, make_loader, packed_stream, to_global
"""

from trainers.data.batches import process_rows, to_global
from trainers.data.config import DataConfig, load_corpus, make_loader
from trainers.data.corpus import npy_corpus, stdlib_corpus, synthetic_corpus, text_corpus
from trainers.data.loader import ExampleLoader, IterLoader, Loader, TokenWindows
from trainers.data.packing import PackedStream, packed_stream

__all__ = [
    "DataConfig", "ExampleLoader", "IterLoader", "Loader", "PackedStream", "TokenWindows", "load_corpus", "make_loader",
    "npy_corpus", "packed_stream", "process_rows", "stdlib_corpus", "synthetic_corpus", "text_corpus", "to_global",
]
