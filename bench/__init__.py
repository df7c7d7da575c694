"""Heron benchmarks. ``python -m bench.serve_bench``: serving throughput and latency against
the raw-model ceiling (see bench/README.md)."""
