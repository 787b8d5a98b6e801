"""Benchmarks and evaluations; each prints a table and can write JSON.

Importing this package registers the analysis-only selectors (`oracle`) and the analysis
variants of product selectors (`prophetkv-max`, `cacheclip+prophetkv`) beside the product's.
"""

from . import oracle, variants  # noqa: F401
