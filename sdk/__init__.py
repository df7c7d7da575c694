"""Heron SDK: shared wire format, request/result types and errors.

The Client and AsyncClient arrive with issue #5; the servers import the wire types from here.
"""

from sdk.errors import ErrorCode, HeronError
from sdk.types import EncodeRequest, ExtractRequest, Item, ScoreRequest

__all__ = ["EncodeRequest", "ErrorCode", "ExtractRequest", "HeronError", "Item", "ScoreRequest"]
