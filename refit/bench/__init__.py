"""Benchmarks (refit bench ...) and the family tables, each ending in one JSON line."""
