"""Benchmarks for locomesh components; run each as ``python -m benchmarks.<name> --help``."""
