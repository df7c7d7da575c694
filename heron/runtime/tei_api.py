"""Text Embeddings Inference's routes (``/embed``, ``/rerank``, ``/info``, ...) in TEI's own
request, response and error shapes, over the same backend as Heron's routes, for the tools
that speak TEI."""

from __future__ import annotations

from typing import TYPE_CHECKING

from starlette.routing import BaseRoute

from heron.runtime.openapi import ApiOperation

if TYPE_CHECKING:
    from heron.runtime.front import InferenceFront

TEI_OPERATIONS: tuple[ApiOperation, ...] = ()


def tei_routes(front: InferenceFront) -> list[BaseRoute]:
    return []
