"""Benchmarks of the decoding modes (offline: HF reference engine)."""
