"""Benchmarks: each prints a table and runs its baseline in the same process. Run one from the
repository root as `python -m bench.NAME`; docs/performance.md has their latest results."""
