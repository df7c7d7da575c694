"""Heron's config service: the single writer of model configs (see docs/config.md)."""
