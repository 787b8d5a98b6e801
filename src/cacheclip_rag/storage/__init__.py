"""Storage: where chunk texts, chunk caches and calibrated profiles live; it knows no model.

store.py (the `KVStore` facade: namespaces, atomic writes, damage detection, counters),
record.py (the on-disk cache record and its checksums; the `Chunk` a store holds),
memory_tier.py (the LRU tier in front of the backend), profiles.py (the stored profile format),
backends/ (files, memory, Redis behind one protocol).
"""
