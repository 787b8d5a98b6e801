"""Token-based chunking with stable, content-derived chunk ids."""

from __future__ import annotations

import hashlib
import threading

from ..config import ChunkConfig
from ..storage.record import Chunk

_TOKENIZER_LOCK = threading.Lock()
"""Fast tokenizers are not safe to call from several threads at once (and split_special_tokens
toggles state on the tokenizer), so every call in the library goes through this lock."""


def encode_text(tokenizer, text: str, special: bool = False) -> tuple[list[int], list[tuple[int, int]]]:
    """Token ids and character offsets of text, without added special tokens.

    special=False (user content: documents, chunks, questions): special-token strings in the
    text, such as "<|im_end|>", are split as plain text, so a document cannot forge a turn of the
    chat template. special=True is for the template's own pieces.
    """
    with _TOKENIZER_LOCK:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, split_special_tokens=not special)
    return list(enc["input_ids"]), [(int(s), int(e)) for s, e in enc["offset_mapping"]]


def decode_ids(tokenizer, ids: list[int]) -> str:
    with _TOKENIZER_LOCK:
        return tokenizer.decode(ids, skip_special_tokens=True)


def chunk_id(text: str) -> str:
    """Stable id of a chunk text: 'c' + the first 24 hex digits of its sha256."""
    return "c" + hashlib.sha256(text.encode("utf-8")).hexdigest()[:24]


def split_document(text: str, tokenizer, cfg: ChunkConfig, source: str = "") -> list[Chunk]:
    """Split one document into chunks of at most cfg.chunk_tokens primary tokens.

    Consecutive chunks share cfg.overlap_tokens tokens. Chunk boundaries fall on token
    boundaries of the whole document's tokenization and each chunk's text is the exact
    character span those tokens cover, so offsets stay meaningful. A document shorter than
    the chunk size is one chunk.
    """
    if not isinstance(text, str):
        raise ValueError(f"a document must be a str, got {type(text).__name__}")
    if not text.strip():
        raise ValueError(f"document {source!r} is empty or whitespace only")
    _, offsets = encode_text(tokenizer, text)
    n = len(offsets)
    if n <= cfg.chunk_tokens:
        return [Chunk(chunk_id(text), text, source, 0, len(text))]
    step = cfg.chunk_tokens - cfg.overlap_tokens
    chunks: list[Chunk] = []
    start_tok = 0
    while True:
        end_tok = min(start_tok + cfg.chunk_tokens, n)
        # Spans start where the first token starts and end where the next chunk's would
        # start, so that no character between tokens (whitespace) is lost.
        c_start = offsets[start_tok][0]
        c_end = offsets[end_tok][0] if end_tok < n else len(text)
        piece = text[c_start:c_end]
        if piece.strip():
            chunks.append(Chunk(chunk_id(piece), piece, source, c_start, c_end))
        if end_tok >= n:
            break
        start_tok += step
    return chunks
