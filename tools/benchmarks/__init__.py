"""Benchmark scripts: each runs a named baseline in the same run and prints a table and JSON (docs/benchmarks/)."""
