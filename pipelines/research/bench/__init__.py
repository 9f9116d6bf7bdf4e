"""Benchmarks: each prints one table and writes JSON (--json PATH)."""
