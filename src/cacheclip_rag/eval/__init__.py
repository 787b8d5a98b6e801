"""Benchmarks and evaluations; each prints a table and can write JSON."""
