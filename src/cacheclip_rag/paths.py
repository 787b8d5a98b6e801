"""The user's cache folder: converted models, demo and bench stores, working copies of shared
stores' indexes. One place reads the environment for it."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$CACHECLIP_CACHE_DIR, else $XDG_CACHE_HOME/cacheclip-rag (~/.cache/cacheclip-rag)."""
    explicit = os.environ.get("CACHECLIP_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "cacheclip-rag"
