"""Cohere's rerank routes (``POST /v1/rerank``, ``POST /v2/rerank``) and Jina's shape of
``/v1/rerank``, in their own request, response and error shapes, over ``score``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from starlette.routing import BaseRoute

from heron.runtime.openapi import ApiOperation

if TYPE_CHECKING:
    from heron.runtime.front import InferenceFront

RERANK_OPERATIONS: tuple[ApiOperation, ...] = ()


def rerank_routes(front: InferenceFront) -> list[BaseRoute]:
    return []
