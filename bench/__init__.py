"""Benchmarks that ship with the package: `tandem bench serve` (serve.py)."""
