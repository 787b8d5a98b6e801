import pytest
from conftest import CORPUS

from cacheclip_rag.config import ChunkConfig
from cacheclip_rag.corpus.chunking import chunk_id, split_document


def test_short_document_is_one_chunk(tiny_tokenizer):
    chunks = split_document(CORPUS[0], tiny_tokenizer, ChunkConfig(chunk_tokens=256, overlap_tokens=8), "d")
    assert len(chunks) == 1 and chunks[0].text == CORPUS[0] and chunks[0].id == chunk_id(CORPUS[0])


def test_chunks_cover_the_document_with_overlap(tiny_tokenizer):
    doc = " ".join(CORPUS * 3)
    cfg = ChunkConfig(chunk_tokens=20, overlap_tokens=5)
    chunks = split_document(doc, tiny_tokenizer, cfg, "d")
    assert len(chunks) > 3
    assert chunks[0].start == 0 and chunks[-1].end == len(doc)
    for a, b in zip(chunks, chunks[1:]):
        assert b.start < a.end  # overlap
        assert doc[a.start : a.end] == a.text
    for c in chunks:
        n = len(tiny_tokenizer(c.text, add_special_tokens=False)["input_ids"])
        assert n <= cfg.chunk_tokens + 2  # re-tokenizing a span may merge differently at its edges


def test_ids_are_stable_and_content_derived(tiny_tokenizer):
    cfg = ChunkConfig(chunk_tokens=20, overlap_tokens=5)
    a = split_document(" ".join(CORPUS), tiny_tokenizer, cfg)
    b = split_document(" ".join(CORPUS), tiny_tokenizer, cfg, source="other")
    assert [c.id for c in a] == [c.id for c in b]
    assert len({c.id for c in a}) == len(a)


@pytest.mark.parametrize("bad", ["", "   \n"])
def test_empty_document_is_refused(tiny_tokenizer, bad):
    with pytest.raises(ValueError, match="empty"):
        split_document(bad, tiny_tokenizer, ChunkConfig())


def test_config_validation():
    with pytest.raises(ValueError, match="overlap_tokens"):
        ChunkConfig(chunk_tokens=10, overlap_tokens=10)
    with pytest.raises(ValueError, match="chunk_tokens"):
        ChunkConfig(chunk_tokens=0)
