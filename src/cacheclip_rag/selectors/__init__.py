"""The built-in KV methods, one file each; importing this package registers them
(`request.selector`'s registry).

To add a method: write a file here (or anywhere) with a `Selector` subclass and call
`register(...)` on an instance; it then appears in the API, the CLI and the benches. Beside the
methods: aux_scores.py (the aux model's scoring passes), budget.py (candidates, grouping, the
budget, `row_count`), primary_attention.py (probes of the primary's own attention, for ProphetKV and the oracle).
"""

from . import (  # noqa: F401
    ape,
    aux_staleness,
    cacheblend,
    cacheclip,
    epic,
    full,
    packet,
    prophetkv,
    random_rows,
    reuse,
)
