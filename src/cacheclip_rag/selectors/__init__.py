"""The built-in KV methods, one file each; importing this package registers them in `plan`.

To add a method: write a file here (or anywhere) with a `Selector` subclass and call
`plan.register(...)` on an instance; it then appears in the API, the CLI and the benches.
"""

from . import full, reuse, ape, cacheblend, epic, random_rows, cacheclip, prophetkv, packet  # noqa: F401
