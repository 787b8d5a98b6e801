"""Find stored chunk texts inside an arbitrary prompt string.

RAG frameworks hand an LLM only the final prompt; the chunks are in it, wrapped in whatever
template, order and separators the pipeline uses. Each chunk is indexed by its first ANCHOR
characters (its whole text when shorter). A prompt is scanned once per distinct anchor length:
at every position the next ANCHOR characters are looked up in a dict, and a hit is confirmed by
comparing the full chunk text. The work is linear in the prompt length and does not grow with
the corpus; confirmations cost the length of chunks that really start there.
"""

from __future__ import annotations

import bisect
import threading

ANCHOR = 32


class ChunkMatcher:
    """Chunk texts by anchor; `find` returns non-overlapping occurrences in a prompt."""

    def __init__(self) -> None:
        self._anchors: dict[int, dict[str, list[str]]] = {}  # anchor length -> anchor -> chunk ids
        self._texts: dict[str, str] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._texts)

    def add(self, chunk_id: str, text: str) -> None:
        if not text:
            return
        with self._lock:
            if chunk_id in self._texts:
                return
            self._texts[chunk_id] = text
            n = min(ANCHOR, len(text))
            self._anchors.setdefault(n, {}).setdefault(text[:n], []).append(chunk_id)

    def find(self, prompt: str, only: set[str] | None = None) -> list[tuple[int, int, str]]:
        """(start, end, chunk id) of chunk occurrences in the prompt, in order, never overlapping.

        Where occurrences overlap, the longer one wins, then the earlier one. only: restrict
        the search to these chunk ids.
        """
        with self._lock:  # copy only the outer dict (<= ANCHOR entries); lookups need no lock
            anchors = list(self._anchors.items())
        texts = self._texts
        hits: list[tuple[int, int, str]] = []
        for n, table in anchors:
            for start in range(len(prompt) - n + 1):
                ids = table.get(prompt[start : start + n])
                if ids is None:
                    continue
                for cid in ids:
                    text = texts[cid]
                    if (only is None or cid in only) and prompt.startswith(text, start):
                        hits.append((start, start + len(text), cid))
        return _non_overlapping(hits)


def _non_overlapping(hits: list[tuple[int, int, str]]) -> list[tuple[int, int, str]]:
    """Greedy: longest first, then leftmost; keep a hit only if it overlaps no kept one."""
    hits.sort(key=lambda h: (-(h[1] - h[0]), h[0], h[2]))
    starts: list[int] = []
    kept: list[tuple[int, int, str]] = []  # sorted by start, pairwise disjoint
    for hit in hits:
        i = bisect.bisect_right(starts, hit[0])
        if i > 0 and kept[i - 1][1] > hit[0]:
            continue  # the kept interval starting before overlaps
        if i < len(kept) and kept[i][0] < hit[1]:
            continue  # the kept interval starting after overlaps
        starts.insert(i, hit[0])
        kept.insert(i, hit)
    return kept
