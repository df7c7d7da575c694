"""Heron SDK: ``Client``/``AsyncClient``, typed results and errors, and the wire format and
request types the servers share (docs/sdk.md)."""

from heron_sdk.aio import AsyncClient, AsyncPool
from heron_sdk.chunking import ChunkingOptions
from heron_sdk.client import Client, Pool
from heron_sdk.errors import (
    ConnectionError,
    ErrorCode,
    HeronError,
    ModelNotFound,
    PoolError,
    ProvisioningTimeout,
    RequestError,
    ServerError,
)
from heron_sdk.results import (
    Embedding,
    EncodedChunk,
    EncodeResult,
    Entity,
    ExtractedItem,
    ExtractResult,
    ScoredItem,
    ScoreResult,
    SparseVector,
    TextChunk,
)
from heron_sdk.types import EncodeRequest, ExtractRequest, Item, ScoreRequest

__all__ = ["AsyncClient", "AsyncPool", "ChunkingOptions", "Client", "ConnectionError", "Embedding",
           "EncodeRequest", "EncodeResult", "EncodedChunk", "Entity", "ErrorCode",
           "ExtractRequest", "ExtractResult", "ExtractedItem", "HeronError", "Item",
           "ModelNotFound", "Pool", "PoolError", "ProvisioningTimeout", "RequestError",
           "ScoreRequest", "ScoreResult", "ScoredItem", "ServerError", "SparseVector", "TextChunk"]
