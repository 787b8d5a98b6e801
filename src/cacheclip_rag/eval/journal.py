"""Results written as they are measured, so that a long bench stopped halfway resumes there.

A journal is a JSON Lines file: a header line naming the run (models, data, modes, prompt: what
must match for its rows to be pooled), then one line per measured row, each flushed and synced
to disk before the bench goes on. Run the same command with the same journal and it skips what
the file already holds; a journal whose header differs from the run's is refused by name, as
its rows would answer another question. A last line cut off by a kill mid-write is dropped (the
row is measured again), with a warning.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path

log = logging.getLogger(__name__)


class Journal:
    """rows: what the file held when opened, then every row appended since."""

    def __init__(self, path: str | Path, header: dict):
        self.path = Path(path)
        self.header = dict(header)
        self.rows: list[dict] = []
        if self.path.exists() and self.path.stat().st_size:
            self._read()
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._write_line({"journal": self.header}, mode="w")

    def _read(self) -> None:
        lines = self.path.read_text(encoding="utf-8").splitlines()
        first = _header(lines[0] if lines else "")
        if first is None:
            raise ValueError(f"{self.path} is not a bench journal (its first line is no header); "
                             "give another --results path")
        differ = sorted(k for k in set(first) | set(self.header) if first.get(k) != self.header.get(k))
        if differ:
            shown = "; ".join(f"{k}: {first.get(k)!r} there, {self.header.get(k)!r} here" for k in differ)
            raise ValueError(f"{self.path} holds another run ({shown}); resume it with the same settings "
                             "or give another --results path")
        self.rows, kept = _rows(lines, self.path)
        if kept != len(lines):
            self.path.write_text("\n".join(lines[:kept]) + "\n", encoding="utf-8")

    def _write_line(self, obj: dict, mode: str = "a") -> None:
        with open(self.path, mode, encoding="utf-8") as f:
            f.write(json.dumps(obj) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def append(self, row: dict) -> None:
        self._write_line(row)
        self.rows.append(row)

    def keys(self, fields: Iterable[str]) -> set[tuple]:
        """The rows' values of `fields`, as tuples: what has been measured."""
        fields = tuple(fields)
        return {tuple(_hashable(r.get(f)) for f in fields) for r in self.rows}


def read_rows(path: str | Path) -> list[dict] | None:
    """The measured rows of a journal file, read only (a last row cut off mid-write is left out);
    None when the file is no journal (its first line is no header)."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    if not lines or _header(lines[0]) is None:
        return None
    return _rows(lines, path)[0]


def _header(line: str) -> dict | None:
    """A journal's first line's settings, or None where the line is no journal header."""
    try:
        head = json.loads(line)
    except json.JSONDecodeError:
        return None
    return head["journal"] if isinstance(head, dict) and isinstance(head.get("journal"), dict) else None


def _rows(lines: list[str], path: str | Path) -> tuple[list[dict], int]:
    """The rows after the header and how many lines are whole: a damaged last line (a kill
    mid-write) is dropped with a warning, a damaged one before it is an error."""
    rows, kept = [], 1
    for n, line in enumerate(lines[1:], 2):
        try:
            rows.append(json.loads(line))
            kept = n
        except json.JSONDecodeError:
            if n != len(lines):
                raise ValueError(f"{path}:{n}: a damaged row before the last; the journal cannot be "
                                 "resumed safely") from None
            log.warning("%s:%d: dropping a row cut off mid-write; it is measured again", path, n)
    return rows, kept


def _hashable(value):
    return tuple(value) if isinstance(value, list) else value
