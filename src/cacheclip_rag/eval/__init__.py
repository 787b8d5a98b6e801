"""Benchmarks and evaluations; each prints a table and can write JSON.

Importing this package registers the analysis-only selectors (`oracle`) beside the product's.
"""

from . import oracle  # noqa: F401
