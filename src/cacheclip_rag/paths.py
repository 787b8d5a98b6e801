"""The user's cache folder: converted models, demo and bench stores, working copies of shared
stores' indexes (one place reads the environment for it); and reading a file the user names."""

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


def read_user_text(path: str | Path, what: str) -> str:
    """A file the user named (documents, a QA dataset) as UTF-8 text; a ValueError naming it and
    `what` it was meant to be when it is missing or not UTF-8."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{what} {str(path)!r} does not exist")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not valid UTF-8 text ({err.reason} at byte {err.start})") from None
