"""Model families. Adding one is one file: subclass Adapter and list it here."""

from heron.worker.adapters.base import Adapter, Batch, TextInput, Tokenized
from heron.worker.adapters.cross_encoder import CrossEncoderAdapter
from heron.worker.adapters.dense import DenseAdapter
from heron.worker.adapters.multi_vector import MultiVectorAdapter
from heron.worker.adapters.null import NullAdapter
from heron.worker.adapters.sparse import SparseAdapter
from heron.worker.adapters.token_classifier import TokenClassifierAdapter

ADAPTERS: dict[str, type[Adapter]] = {
    cls.name: cls
    for cls in (DenseAdapter, SparseAdapter, MultiVectorAdapter, CrossEncoderAdapter,
                TokenClassifierAdapter, NullAdapter)
}

__all__ = ["ADAPTERS", "Adapter", "Batch", "TextInput", "Tokenized"]
