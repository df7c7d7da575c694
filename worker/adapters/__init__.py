"""Model families. Adding one is one file: subclass Adapter and list it here."""

from worker.adapters.base import Adapter, Batch, TextInput, Tokenized
from worker.adapters.cross_encoder import CrossEncoderAdapter
from worker.adapters.dense import DenseAdapter
from worker.adapters.multi_vector import MultiVectorAdapter
from worker.adapters.null import NullAdapter
from worker.adapters.sparse import SparseAdapter
from worker.adapters.token_classifier import TokenClassifierAdapter

ADAPTERS: dict[str, type[Adapter]] = {
    cls.name: cls
    for cls in (DenseAdapter, SparseAdapter, MultiVectorAdapter, CrossEncoderAdapter,
                TokenClassifierAdapter, NullAdapter)
}

__all__ = ["ADAPTERS", "Adapter", "Batch", "TextInput", "Tokenized"]
