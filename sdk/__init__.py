"""Heron SDK: the client, the shared wire format, request/result types and errors."""

from sdk.client import Client
from sdk.errors import ErrorCode, HeronError
from sdk.types import EncodeRequest, ExtractRequest, Item, ScoreRequest

__all__ = ["Client", "EncodeRequest", "ErrorCode", "ExtractRequest", "HeronError", "Item",
           "ScoreRequest"]
