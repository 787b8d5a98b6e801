"""Codecs for chunk caches: how a layer's K and V are kept in a record (bf16, int8, int4), one
file each behind `base.Codec`, chosen by `StoreConfig.kv_codec` and recorded per namespace."""

from . import bf16, int4, int8  # noqa: F401  (each registers itself)
from .base import AUTO, AUTO_CODEC, DEFAULT_CODEC, Codec, Kind, check, get, names, register

__all__ = ["AUTO", "AUTO_CODEC", "DEFAULT_CODEC", "Codec", "Kind", "check", "get", "names", "register"]
