"""Heron worker: model registry, token-budget batcher, adapters and the HTTP API."""
