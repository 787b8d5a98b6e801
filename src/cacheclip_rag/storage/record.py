"""The record a chunk cache is kept as: its tensors, their checksums, and a verifying reader.

`ChunkKV` is the in-memory cache of one text segment (every stage passes it: encode makes it,
assemble and select read it, the store keeps it). On a backend it is a record of named tensors
(token ids, offsets, and each layer's K and V as its codec stores them: `codecs/`) with one
checksum per stored tensor in its metadata, so a single layer can be read, verified and decoded
without the others (`LayerReader`). A record that fails to parse or to match its
sums raises `DamagedCacheError`; the store then drops it and the cache is rebuilt from its text.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch
import xxhash

from . import codecs
from .backends.base import Record, StoreUnavailableError


@dataclass
class ChunkKV:
    """The KV cache of one text segment as prefilled after the shared prefix.

    keys, values: one tensor per layer, [kv_heads, T, head_dim], keys rotated for positions
        [start_pos, start_pos + T).
    token_ids: [T] int64.
    offsets: [T, 2] int64 character span of each token inside the segment's text.
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    token_ids: torch.Tensor
    offsets: torch.Tensor
    start_pos: int

    def __post_init__(self) -> None:
        assert len(self.keys) == len(self.values) and self.keys, "one K and one V per layer"
        t = self.token_ids.shape[0]
        assert self.offsets.shape == (t, 2), f"offsets {tuple(self.offsets.shape)} for {t} tokens"
        assert all(k.shape[1] == t and v.shape[1] == t for k, v in zip(self.keys, self.values))

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def nbytes(self) -> int:
        kv = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in zip(self.keys, self.values))
        return kv + self.token_ids.numel() * 8 + self.offsets.numel() * 8

    def to(self, dtype: torch.dtype) -> ChunkKV:
        """The same cache with K/V in `dtype` (itself when they already are)."""
        if self.keys[0].dtype == dtype:
            return self
        return ChunkKV([k.to(dtype) for k in self.keys], [v.to(dtype) for v in self.values], self.token_ids,
                       self.offsets, self.start_pos)

    def first_layers(self, layers: int) -> ChunkKV:
        """The same cache cut to its first `layers` layers, sharing the tensors (itself when it
        has no more)."""
        if layers >= len(self.keys):
            return self
        return ChunkKV(self.keys[:layers], self.values[:layers], self.token_ids, self.offsets, self.start_pos)

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {"token_ids": self.token_ids, "offsets": self.offsets}
        for layer, (k, v) in enumerate(zip(self.keys, self.values)):
            out[f"k.{layer}"] = k.contiguous()
            out[f"v.{layer}"] = v.contiguous()
        return out


CHECKSUM = "xxh3_128"
"""The checksum new caches carry per tensor. It guards against damage (torn writes, bad disks,
truncation), not against someone who can write the store (who could rewrite the sums too), so
a fast non-cryptographic hash does: XXH3-128 reads ~10 GB/s where sha256 reads ~1.2 GB/s, and
every reuse request verifies each tensor it reads (~100 MB at 4K tokens for the default pair)."""

HASHES = {"xxh3_128": xxhash.xxh3_128, "sha256": hashlib.sha256}
"""Checksum name (the metadata key of a record's sums) -> hash constructor. sha256: stores
written before XXH3 (format 1 either way: the record says which it carries)."""


def tensor_sum(name: str, t: torch.Tensor, algorithm: str = CHECKSUM) -> str:
    digest = HASHES[algorithm]()
    t = t.contiguous()
    digest.update(name.encode())
    digest.update(str(tuple(t.shape)).encode())
    digest.update(str(t.dtype).encode())
    digest.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))  # hashed in place, no copy
    return digest.hexdigest()[:32]


def checksums(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """One checksum per tensor, so a single layer can be read and verified without the others."""
    return {name: tensor_sum(name, t) for name, t in tensors.items()}


FORMAT_VERSION = 1
"""The store format: its manifest and every record it writes carry it (metadata keys, tensor names)."""


def to_record(kv: ChunkKV, namespace: str, key: str, codec: str = codecs.DEFAULT_CODEC
              ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The named tensors (on the host) and the metadata a cache is stored as: where it belongs,
    its start position, layer count, codec (with the head_dim and dtype it decodes to), and one
    checksum per stored tensor (so the sums cover the bytes as stored, encoded)."""
    coder = codecs.get(codec)
    tensors = {"token_ids": kv.token_ids.detach().cpu().contiguous(), "offsets": kv.offsets.detach().cpu().contiguous()}
    for layer, (k, v) in enumerate(zip(kv.keys, kv.values)):
        tensors[f"k.{layer}"] = coder.encode("k", k.detach().cpu()).contiguous()
        tensors[f"v.{layer}"] = coder.encode("v", v.detach().cpu()).contiguous()
    meta = {
        "format": str(FORMAT_VERSION),
        "key": key,
        "namespace": namespace,
        "start_pos": str(kv.start_pos),
        "num_layers": str(len(kv.keys)),
        CHECKSUM: json.dumps(checksums(tensors), sort_keys=True),
    }
    if codec != codecs.DEFAULT_CODEC:  # records of the default codec stay as they always were
        meta.update(codec=codec, codec_layout=str(coder.layout), head_dim=str(kv.keys[0].shape[-1]),
                    dtype=str(kv.keys[0].dtype).removeprefix("torch."))
    return tensors, meta


def record_codec(meta: dict[str, str]) -> str:
    """The codec a record was written with (records written before codecs name none: bf16)."""
    return meta.get("codec", codecs.DEFAULT_CODEC)


class DamagedCacheError(ValueError):
    """A cache file failed to parse or to match its checksums."""



class LayerReader:
    """Reads one stored cache layer by layer, verifying each stored tensor's checksum and decoding
    it with the record's codec. codec: the one the namespace holds; a record of another is
    refused as damaged (a namespace never mixes codecs); None takes the record's own."""

    def __init__(self, record: Record, namespace: str, key: str, codec: str | None = None):
        self._record = record
        meta = record.meta
        if meta.get("key") != key or meta.get("namespace") != namespace:
            raise DamagedCacheError(f"record holds {meta.get('key')!r}/{meta.get('namespace')!r}")
        self.codec = record_codec(meta)
        if codec is not None and self.codec != codec:
            raise DamagedCacheError(f"record written with codec {self.codec!r} in a namespace of {codec!r} caches")
        try:
            self._coder = codecs.get(self.codec)
            self._head_dim = int(meta.get("head_dim", 0))
            self._dtype = getattr(torch, meta["dtype"]) if "dtype" in meta else None
            layout = int(meta.get("codec_layout", 1))
        except (ValueError, AttributeError) as err:
            raise DamagedCacheError(f"bad codec metadata ({err})") from err
        if layout != self._coder.layout:
            raise DamagedCacheError(f"a {self.codec!r} record of layout {layout}; this release reads layout "
                                    f"{self._coder.layout}")
        if self.codec != codecs.DEFAULT_CODEC and (self._head_dim <= 0 or not isinstance(self._dtype, torch.dtype)):
            raise DamagedCacheError(f"a {self.codec!r} record without its head_dim and dtype")
        self._algorithm = next((name for name in HASHES if name in meta), None)
        if self._algorithm is None:
            raise DamagedCacheError(f"no checksums in its metadata (expected one of {sorted(HASHES)})")
        try:
            self._sums = json.loads(meta[self._algorithm])
            self.num_layers = int(meta["num_layers"])
            self.start_pos = int(meta["start_pos"])
        except (KeyError, ValueError, TypeError) as err:
            raise DamagedCacheError(f"bad metadata ({err})") from err
        expected = {"token_ids", "offsets"} | {f"{kv}.{i}" for kv in "kv" for i in range(self.num_layers)}
        if record.names() != expected or set(self._sums) != expected:
            raise DamagedCacheError("tensor names do not match the metadata")
        self.token_ids = self._get("token_ids")
        self.offsets = self._get("offsets")

    def _get(self, name: str) -> torch.Tensor:
        try:
            tensor = self._record.tensor(name)
        except StoreUnavailableError:
            raise
        except (OSError, ValueError, KeyError) as err:
            raise DamagedCacheError(f"unreadable {name} ({err})") from err
        if tensor_sum(name, tensor, self._algorithm) != self._sums[name]:
            raise DamagedCacheError(f"checksum mismatch in {name}")
        return tensor

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def compressed(self) -> bool:
        """Whether its layers are decoded on read (any codec but the default's bf16)."""
        return self.codec != codecs.DEFAULT_CODEC

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of layer i: [kv_heads, T, head_dim] each, decoded (a stored tensor that does not
        fit the codec's layout is damage)."""
        keys, values = self.layers(i, i + 1)
        return keys[0], values[0]

    def layers(self, start: int, stop: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """K and V of layers start..stop-1 (stop clipped to the record's depth), each
        [kv_heads, T, head_dim]; a compressed record's are decoded together (`block`)."""
        picked = self._picked(start, stop)
        if not self.compressed:  # stored as they are used: no copy
            return [self._get(f"k.{i}") for i in picked], [self._get(f"v.{i}") for i in picked]
        keys, values = self.block(start, stop)
        return list(keys.unbind(0)), list(values.unbind(0))

    def block(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of layers start..stop-1 (stop clipped to the record's depth) as one tensor each,
        [layers, kv_heads, T, head_dim], so that what follows (re-rotation) is one call for all
        of them too. A compressed record's layers are decoded together: one decode over the layers
        side by side costs about half of stop - start decodes of one (the per-op overhead of small
        tensors dominates on CPUs); a bf16 record's are stacked (a copy)."""
        picked = self._picked(start, stop)
        keys = [self._get(f"k.{i}") for i in picked]
        values = [self._get(f"v.{i}") for i in picked]
        if not self.compressed:
            return torch.stack(keys), torch.stack(values)
        what = f"layers {picked.start}-{picked.stop - 1}"
        try:
            heads = keys[0].shape[0]
            out = []
            for kind, stored in (("k", keys), ("v", values)):
                both = stored[0] if len(stored) == 1 else torch.cat(stored)
                decoded = self._coder.decode(kind, both, self.num_tokens, self._head_dim, self._dtype)
                out.append(decoded.view(len(picked), heads, *decoded.shape[1:]))
            return out[0], out[1]
        except (ValueError, RuntimeError) as err:
            raise DamagedCacheError(f"{what}: not decodable with codec {self.codec!r} ({err})") from err

    def _picked(self, start: int, stop: int) -> range:
        stop = min(stop, self.num_layers)
        if not 0 <= start < stop:
            raise ValueError(f"layers({start}, {stop}) of a record of {self.num_layers} layers")
        return range(start, stop)

    def first_layers(self, n: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """K and V of layers 0..n-1 (`layers`), for reads that need them all."""
        return self.layers(0, n)

    def read_all(self) -> ChunkKV:
        try:
            keys, values = self.first_layers(self.num_layers)
        finally:
            self.close()
        return ChunkKV(keys, values, self.token_ids, self.offsets, self.start_pos)

    def close(self) -> None:
        self._record.close()


@dataclass(frozen=True, slots=True)
class Chunk:
    """A piece of a document whose KV cache is stored and reused.

    id: derived from the text alone, so the same text always maps to the same cache.
    source: the caller's name for the document (index in the ingest call by default).
    start, end: character span of the text inside its document.
    """

    id: str
    text: str
    source: str
    start: int
    end: int
