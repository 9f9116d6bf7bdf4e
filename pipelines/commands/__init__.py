"""Subcommands of `freescale` that are not training or benchmarks."""
