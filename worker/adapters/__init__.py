"""Model families. Adding one is its file here plus one entry in the adapter table
(heron/runtime/adapters.py, ``ADAPTER_FAMILIES``); the worker imports the class from there."""

from __future__ import annotations

import importlib

from heron.runtime.adapters import adapter_family
from heron.worker.adapters.base import (
    Adapter,
    Batch,
    RefusedItem,
    TextInput,
    TokenIds,
    Tokenized,
)


def adapter_class(name: str) -> type[Adapter]:
    """The worker's class for adapter ``name``, imported on first use from the table's
    ``"module:Class"`` path (a model config's adapter loads only its own family's code)."""
    module_name, _, class_name = adapter_family(name).implementation.partition(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    if not (isinstance(cls, type) and issubclass(cls, Adapter) and cls.name == name):
        raise TypeError(f"adapter table: {module_name}:{class_name} is not the Adapter "
                        f"named {name!r}")
    return cls


__all__ = ["Adapter", "Batch", "RefusedItem", "TextInput", "TokenIds", "Tokenized",
           "adapter_class"]
