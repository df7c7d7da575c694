"""Cached Prometheus children: ``metric.labels(*values)`` looked up once per label set.

prometheus_client's ``labels()`` validates and joins its arguments on every call (about
0.9 µs, against 0.74 µs for the ``observe`` it precedes), and the request path of a
gateway or worker makes several a request. Label sets are few (routes, models, pools,
phases), so each child is kept.
"""

from __future__ import annotations

from typing import Any


class MetricChildren:
    """A metrics holder's cache of its metrics' labelled children."""

    def __init__(self) -> None:
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}

    def of(self, metric: Any, *labels: str) -> Any:
        """``metric.labels(*labels)``, cached."""
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child
