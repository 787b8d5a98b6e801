"""`packet` and `packet+cacheclip`: KV Packet (arXiv:2604.13226) and its union
with CacheClip selection.

`packet` concatenates the chunks' packet caches (each chunk encoded between the trained header
and trailer, `cacheclip_rag.corpus.packets`) behind the shared prefix and recomputes nothing but plain
text, like `reuse`. `packet+cacheclip` also recomputes the rows the aux model picks at the
requested ratio (CacheClip's selection mapped onto the packet's token rows; the soft rows are
never picked, they have no text): the adapters repair what they can without compute, and the
recompute budget goes to what they cannot. At ratio 0 it is `packet`; at ratio 1 it recomputes
every row, soft rows included, which equals a full prefill of the wrapped sequence.
"""

from __future__ import annotations

from ..request.plan import Plan
from ..request.selector import Selector, register
from .cacheclip import CacheClip


class Packet(Selector):
    name = "packet"
    fixed_ratio = 0.0
    packets = True

    def plan(self, prepared) -> Plan:
        return Plan()


class PacketCacheClip(CacheClip):
    name = "packet+cacheclip"
    packets = True


register(Packet())
register(PacketCacheClip())
