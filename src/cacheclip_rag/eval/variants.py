"""Analysis variants of product selectors, registered for benches so that a choice a method's
paper leaves open can be compared with the default on the same samples.

`prophetkv-max`: ProphetKV with its per-layer query attention fused by max over layers instead
of the mean (`selectors/prophetkv.py`). Registered when `cacheclip_rag.eval` is imported.
"""

from __future__ import annotations

from ..plan import register
from ..selectors.prophetkv import ProphetKV


class ProphetKVMax(ProphetKV):
    name = "prophetkv-max"
    fuse = "max"


register(ProphetKVMax())
