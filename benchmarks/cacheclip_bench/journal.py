"""Results written as they are measured, so that a long bench stopped halfway resumes there.

A journal is a JSON Lines file: a header line naming the run (models, data, modes, prompt: what
must match for its rows to be pooled), then one line per measured row, each flushed and synced
to disk before the bench goes on. Run the same command with the same journal and it skips what
the file already holds; a journal whose header differs from the run's is refused by name, as
its rows would answer another question. A last line cut off by a kill mid-write is dropped (the
row is measured again), with a warning.

A journal resumed on another machine goes on: the rows that follow a `{"machine": ...}` line were
measured there (written before the first row of a session whose machine is not the last one
recorded), so a table pooled from journals of several machines can say which gave its rows
(`machines`): their quality columns pool, their times do not.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


class Journal:
    """rows: what the file held when opened, then every row appended since."""

    def __init__(self, path: str | Path, header: dict, machine: str | None = None):
        self.path = Path(path)
        self.header = dict(header)
        self.machine = machine
        self.rows: list[dict] = []
        self._last_machine: str | None = None
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
        entries, kept = _entries(lines, self.path)
        self.rows = _rows(entries)
        marks = _machine_spans(entries)
        self._last_machine = marks[-1][0] if marks else None
        if kept != len(lines):
            self.path.write_text("\n".join(lines[:kept]) + "\n", encoding="utf-8")

    def _write_line(self, obj: dict, mode: str = "a") -> None:
        with open(self.path, mode, encoding="utf-8") as f:
            f.write(json.dumps(obj) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def append(self, row: dict) -> None:
        if self.machine is not None and self.machine != self._last_machine:
            self._write_line({"machine": self.machine})
            self._last_machine = self.machine
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
    return _rows(_entries(lines, path)[0])


def machines(path: str | Path) -> list[tuple[str | None, int]]:
    """(machine, rows measured there) per stretch of a journal, in order; None for rows written
    before any machine line (journals of earlier versions). [] for a file that is no journal."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    if not lines or _header(lines[0]) is None:
        return []
    return _machine_spans(_entries(lines, path)[0])


def pooled_machines(specs: Iterable[str | Path]) -> set[str | None]:
    """The machines that measured the rows of these runs ("TAG=PATH" as `pool` takes them); None
    stands for rows whose machine is not recorded (saved JSON runs, older journals)."""
    return {where for spec in specs for where, _ in _spans_of(spec)[1] or [(None, 0)]}


def provenance(specs: Iterable[str | Path]) -> str:
    """Which machine measured the rows of each pooled run ("TAG=PATH" specs as `pool` takes them),
    a line per stretch: for a table's conditions when its rows come from several machines."""
    lines = ["rows measured on:"]
    for spec in specs:
        path, spans = _spans_of(spec)
        if not spans:
            lines.append(f"  {path}: a saved run (machine not recorded)")
        for where, n in spans:
            lines.append(f"  {path}: {n} rows, {where or 'machine not recorded (a journal of an earlier version)'}")
    return "\n".join(lines)


def _spans_of(spec: str | Path) -> tuple[str, list[tuple[str | None, int]]]:
    """A pooled run's path ("TAG=PATH" untagged) and its `machines` ([] where it is no journal)."""
    path = str(spec).rpartition("=")[2]
    return path, machines(path) if Path(path).is_file() else []


def pool(specs: Iterable[str | Path], read: Callable[[str], list[T]], tagged: Callable[[T, str], T],
         key: Callable[[T], tuple], outcome: Callable[[T], tuple], what: str) -> list[T]:
    """The rows of saved runs pooled: runs on disjoint samples, or other modes on the same ones.
    A key seen twice is kept once when both runs gave the same outcome (full attention, which every
    bench runs) and is an error when they differ, as the pool would count it twice.

    "TAG=PATH" puts a run's modes under a tag (`tagged(row, tag)`: "tuned/full"), so a run of
    another model or profile on the same samples sits beside the untagged run, whose `full` stays
    the reference. read(path): the run's rows (raises OSError, ValueError, KeyError or TypeError
    when the file is not one: named with `what`, the kind of run expected)."""
    rows: list[T] = []
    seen: dict[tuple, tuple[str, T]] = {}
    for spec in specs:
        tag, _, path = str(spec).rpartition("=")
        if tag and ("/" in tag or not tag.strip()):
            raise ValueError(f"{spec}: a tag is a name without '/', as in tuned=run.json")
        try:
            loaded = [tagged(r, tag) for r in read(path)] if tag else read(path)
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise ValueError(f"{path}: not {what}: {err}") from err
        for r in loaded:
            k = key(r)
            if k in seen:
                first_path, first = seen[k]
                if outcome(first) != outcome(r):
                    raise ValueError(f"{path}: sample {k} is also in {first_path} with another answer "
                                     f"({outcome(r)[0]!r} vs {outcome(first)[0]!r}); pool runs with disjoint samples")
                continue
            seen[k] = (str(path), r)
            rows.append(r)
    return rows


def _header(line: str) -> dict | None:
    """A journal's first line's settings, or None where the line is no journal header."""
    try:
        head = json.loads(line)
    except json.JSONDecodeError:
        return None
    return head["journal"] if isinstance(head, dict) and isinstance(head.get("journal"), dict) else None


def _entries(lines: list[str], path: str | Path) -> tuple[list[dict], int]:
    """The lines after the header, parsed (rows and machine lines), and how many lines are whole:
    a damaged last line (a kill mid-write) is dropped with a warning, a damaged one before it is
    an error."""
    entries, kept = [], 1
    for n, line in enumerate(lines[1:], 2):
        try:
            entries.append(json.loads(line))
            kept = n
        except json.JSONDecodeError:
            if n != len(lines):
                raise ValueError(f"{path}:{n}: a damaged row before the last; the journal cannot be "
                                 "resumed safely") from None
            log.warning("%s:%d: dropping a row cut off mid-write; it is measured again", path, n)
    return entries, kept


def _rows(entries: list[dict]) -> list[dict]:
    """The measured rows among a journal's entries (its machine lines left out)."""
    return [e for e in entries if not _machine_line(e)]


def _machine_line(obj) -> bool:
    return isinstance(obj, dict) and set(obj) == {"machine"}


def _machine_spans(entries: list[dict]) -> list[tuple[str | None, int]]:
    """(machine, rows) per stretch of a journal's entries: rows grouped by the machine line before
    them (None before any); stretches without rows left out."""
    spans: list[tuple[str | None, int]] = [(None, 0)]
    for obj in entries:
        if _machine_line(obj):
            spans.append((obj["machine"], 0))
        else:
            spans[-1] = (spans[-1][0], spans[-1][1] + 1)
    return [span for span in spans if span[1]]


def _hashable(value):
    return tuple(value) if isinstance(value, list) else value
