"""Heron: inference engine for embeddings, reranking and extraction."""

__version__ = "0.1.0"
