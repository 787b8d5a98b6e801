"""Corpus: from documents to stored, indexed, recognisable chunks with their caches.

chunking.py (token chunks with content ids), encode.py (prompt frames and cache encoding),
caches.py (`ChunkCaches`: one model's caches of every chunk, read or encoded), packets.py (KV
Packet caches and adapters), ingest.py (chunk, cache, index; catch up with other processes),
index.py (the FAISS chunk index), recognize.py (finding stored chunk texts inside a prompt).
"""
