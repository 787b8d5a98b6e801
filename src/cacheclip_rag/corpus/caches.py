"""One model's chunk caches: its prompt frame, its store namespace, and the get-or-encode rule.

Both the serving path (prepare, the layer feeder, selectors) and ingest/repair read caches
through a `ChunkCaches`, so "from the store, else encoded from the chunk's text and stored" is
written once. A cache found damaged is discarded and re-encoded, never used.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..config import PromptConfig
from ..models.loading import LoadedModel
from ..storage.backends.base import PREFIX_KEY
from ..storage.codecs import DEFAULT_CODEC
from ..storage.record import ChunkKV, DamagedCacheError, LayerReader
from ..storage.store import KVStore
from .encode import Template, chat_template, encode_prefix, encode_segment, tokenize
from .packets import PacketAdapters, packet_cache



def namespace_of(lm: LoadedModel, prefix_ids: torch.Tensor, storage: torch.dtype | None = None,
                 packets: str | None = None, codec: str = DEFAULT_CODEC) -> str:
    """The store namespace of a model, shared prefix, storage dtype, codec and (packet caches)
    the adapters' digest: caches are valid only for all of them (a storage dtype equal to the
    compute dtype and the bf16 codec add nothing to the hash, so stores written before either
    existed keep their namespaces; plain and packet caches never share one, nor two codecs)."""
    digest = hashlib.sha256(lm.fingerprint.encode())
    digest.update(prefix_ids.numpy().tobytes())
    if storage is not None and storage != lm.dtype:
        digest.update(f"storage={storage}".encode())
    if packets is not None:
        digest.update(f"packets={packets}".encode())
    if codec != DEFAULT_CODEC:
        digest.update(f"codec={codec}".encode())
    return digest.hexdigest()[:32]


@dataclass
class ChunkCaches:
    """A model with its prompt frame (template, shared-prefix ids [P]) and its caches in a store,
    kept in `storage` dtype (every cache this hands out is in it, encoded or read) and stored
    with the store's codec. With `adapters`, the caches are KV Packets: each chunk wrapped in the
    adapters' header and trailer before it is encoded, in a namespace of their own. depth: how
    many layers a stored cache keeps (a callable, asked at each encode: the aux model's deepest
    scoring layer + 1 can change when a profile is written; None or a None answer: every layer);
    a read that needs deeper layers than a stored cache has re-encodes it with them."""

    lm: LoadedModel
    template: Template
    prefix_ids: torch.Tensor
    namespace: str
    store: KVStore
    role: str
    storage: torch.dtype
    adapters: PacketAdapters | None = None
    depth: Callable[[], int | None] | None = None
    _prefix: ChunkKV | None = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def open(cls, lm: LoadedModel, store: KVStore, prompt: PromptConfig, role: str,
             adapters: PacketAdapters | None = None, depth: Callable[[], int | None] | None = None) -> ChunkCaches:
        """Frame `lm` for `prompt`, record its namespace (and codec) in the store and make sure
        the shared prefix's cache is there and current."""
        template = chat_template(lm, prompt)
        prefix_ids, _ = tokenize(lm, template.prefix, special=True)
        storage = store.storage_dtype(lm.dtype)
        digest = adapters.digest() if adapters is not None else None
        codec = store.choose_codec(lambda c: namespace_of(lm, prefix_ids, storage, digest, c))
        caches = cls(lm, template, prefix_ids, namespace_of(lm, prefix_ids, storage, digest, codec), store, role,
                     storage, adapters, depth)
        about = {"role": role, "model": lm.name, "fingerprint": lm.fingerprint, "dtype": _name(lm.dtype),
                 "kv_dtype": _name(storage), "kv_codec": codec}
        if digest is not None:
            about["packets"] = {"adapters": digest, "n_header": adapters.shape[0], "n_trailer": adapters.shape[1]}
        store.describe_namespace(caches.namespace, about)
        caches.prefix()
        return caches

    @property
    def codec(self) -> str:
        """The codec the store keeps these caches with (the store resolved and recorded it)."""
        return self.store.codec_of(self.namespace)

    def get(self, chunk_id: str, text: str | None = None) -> ChunkKV:
        """The cache of a chunk, every layer of the model: from the store, or encoded from its
        text (given, else the stored one) where it is missing or stored shallower."""
        kv = self.store.get_kv(self.namespace, chunk_id)
        if kv is not None and len(kv.keys) >= self.lm.num_layers:
            return kv
        return self.encode(chunk_id, text)

    def prefix(self) -> ChunkKV:
        """The shared prefix's cache: read from the store once (encoded and stored if it is
        missing, damaged or cached under other ids), then kept here, since every request of this
        model uses the same one (so the memory tier's counters are the chunks' alone)."""
        if self._prefix is None:
            kv = self.store.get_kv(self.namespace, PREFIX_KEY)
            if kv is None or not torch.equal(kv.token_ids, self.prefix_ids):
                kv = encode_prefix(self.lm, self.template.prefix).to(self.storage)
                kv = self.store.put_kv(self.namespace, PREFIX_KEY, kv)
            self._prefix = kv
        return self._prefix

    def open_layers(self, chunk_id: str, text: str | None = None) -> ChunkKV | LayerReader:
        """For layer-wise loading: the cache in memory, a reader that loads one layer at a time,
        or (missing or damaged) a fresh encode."""
        source = self.store.open_layers(self.namespace, chunk_id)
        if source is not None and source.token_ids.numel() > 0 and _layers(source) >= self.lm.num_layers:
            return source
        if isinstance(source, LayerReader):
            source.close()
        return self.get(chunk_id, text)

    def get_layers(self, chunk_id: str, text: str | None, layers: int) -> ChunkKV:
        """The cache of a chunk cut to its first `layers` layers: from the memory tier, else only
        those layers read (and verified) from the store and remembered (a partial entry, which
        serves later reads of as many layers), else encoded. What scores with the early layers
        only (the aux pass) need not read, nor keep in memory, the rest."""
        layers = min(layers, self.lm.num_layers)
        source = self.store.open_layers(self.namespace, chunk_id, layers)
        if source is not None and _layers(source) < layers:  # stored shallower than this read needs
            if isinstance(source, LayerReader):
                source.close()
            source = None
        if source is None:
            kv = self.encode(chunk_id, text, remember=False, layers=layers)  # the tier keeps what is read: the cut
            cut = kv.first_layers(layers)
            self.store.remember(self.namespace, chunk_id, cut, whole=cut is kv)
            return cut
        if source.token_ids.numel() == 0:
            source = self.get(chunk_id, text)
        if isinstance(source, LayerReader):
            reader = source
            try:
                n = min(layers, reader.num_layers)
                keys, values = reader.first_layers(n)
                kv = ChunkKV(keys, values, reader.token_ids, reader.offsets, reader.start_pos)
                self.store.remember(self.namespace, chunk_id, kv, whole=n == reader.num_layers)
                return kv
            except DamagedCacheError as err:
                source = self.rebuild(chunk_id, err)
            finally:
                reader.close()
        return source.first_layers(layers)

    def has(self, chunk_id: str) -> bool:
        return self.store.get_kv(self.namespace, chunk_id) is not None

    def stored_depth(self, needed: int | None = None) -> int | None:
        """How many layers an encode stores: `depth` (the deepest layer read, + 1), at least
        `needed`; None for every layer."""
        depth = self.depth() if self.depth is not None else None
        if depth is None:
            return None
        depth = max(depth, needed or 0)
        return depth if depth < self.lm.num_layers else None

    def encode(self, chunk_id: str, text: str | None = None, remember: bool = True, layers: int | None = None
               ) -> ChunkKV:
        """Prefill the chunk (as a packet, with adapters) after the shared prefix and store its
        cache, cut to `stored_depth(layers)` layers (kept whole in the memory tier unless
        `remember` is False, or as a partial entry where it was cut). Returns every layer."""
        if text is None:
            chunk = self.store.get_chunk(chunk_id)
            if chunk is None:
                raise ValueError(f"unknown chunk id {chunk_id!r}: not in the store {self.store.location}")
            text = chunk.text
        if self.adapters is not None:
            ids, offsets = tokenize(self.lm, text)
            kv = packet_cache(self.lm, self.adapters, self.prefix_ids, ids, offsets).to(self.storage)
        else:
            kv = encode_segment(self.lm, self.prefix_ids, text).to(self.storage)
        depth = self.stored_depth(layers)
        cut = kv.first_layers(depth) if depth is not None else kv
        stored = self.store.put_kv(self.namespace, chunk_id, cut, remember=remember and cut is kv)
        if remember and cut is not kv:
            self.store.remember(self.namespace, chunk_id, stored, whole=False)
        if cut is kv:
            return stored
        # as a read serves it: the stored layers as stored, the deeper ones (asked for, not kept) as computed
        return ChunkKV(stored.keys + kv.keys[len(stored.keys):], stored.values + kv.values[len(stored.values):],
                       kv.token_ids, kv.offsets, kv.start_pos)

    def rebuild(self, chunk_id: str, why: Exception) -> ChunkKV:
        """A cache found damaged while loading: drop it and encode it again from the stored text."""
        self.store.discard(self.namespace, chunk_id, why)
        return self.encode(chunk_id)

    def remember(self, chunk_id: str, kv: ChunkKV) -> None:
        """Hand a cache read layer by layer to the store's memory tier."""
        self.store.remember(self.namespace, chunk_id, kv)


def _layers(source: ChunkKV | LayerReader) -> int:
    return source.num_layers if isinstance(source, LayerReader) else len(source.keys)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
