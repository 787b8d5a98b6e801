"""Chunk recognition in prompts: property tests over random corpora, templates and separators."""

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from cacheclip_rag.corpus.recognize import ANCHOR, ChunkMatcher

ALPHABET = "abcde fgh.\n—é東0123"


def _brute_force_present(prompt, corpus):
    """Every (start, end, id) occurrence of every chunk, by plain search."""
    out = []
    for cid, text in corpus.items():
        i = prompt.find(text)
        while i >= 0:
            out.append((i, i + len(text), cid))
            i = prompt.find(text, i + 1)
    return out


def _check(prompt, corpus, found):
    # Nothing else is claimed: each hit is exactly its chunk's text at that place.
    for s, e, cid in found:
        assert prompt[s:e] == corpus[cid]
    # Hits never overlap and come in order.
    for (s1, e1, _), (s2, e2, _) in zip(found, found[1:]):
        assert e1 <= s2
    # Maximal: every occurrence is either claimed or overlaps a claimed one.
    for s, e, cid in _brute_force_present(prompt, corpus):
        assert (s, e, cid) in found or any(s < fe and fs < e for fs, fe, _ in found)


texts = st.text(alphabet=ALPHABET, min_size=1, max_size=90)


@settings(max_examples=150, deadline=None)
@given(
    corpus=st.lists(texts, min_size=1, max_size=8, unique=True),
    picks=st.lists(st.integers(min_value=0, max_value=7), max_size=10),
    seps=st.lists(st.text(alphabet=ALPHABET + "[]#:*", max_size=12), min_size=11, max_size=11),
    partial=st.booleans(),
)
def test_every_present_chunk_is_found_and_nothing_else(corpus, picks, seps, partial):
    ids = {f"c{i}": t for i, t in enumerate(corpus)}
    matcher = ChunkMatcher()
    for cid, t in ids.items():
        matcher.add(cid, t)
    parts = [seps[0]]
    for j, p in enumerate(picks):
        text = corpus[p % len(corpus)]
        if partial and j == 0 and len(text) > 2:
            text = text[: len(text) // 2]  # a chunk only partly present
        parts += [text, seps[j + 1]]
    prompt = "".join(parts)
    _check(prompt, ids, matcher.find(prompt))


@settings(max_examples=60, deadline=None)
@given(doc=st.text(alphabet=ALPHABET, min_size=40, max_size=400), size=st.integers(8, 120), step=st.integers(3, 100))
def test_overlapping_chunks_of_one_document(doc, size, step):
    """Chunks cut with overlap from one document, the whole document in the prompt."""
    ids = {}
    for i, start in enumerate(range(0, len(doc), step)):
        ids.setdefault(doc[start : start + size], f"c{i}")
    corpus = {cid: t for t, cid in ids.items()}
    matcher = ChunkMatcher()
    for cid, t in corpus.items():
        matcher.add(cid, t)
    prompt = "Context:\n" + doc + "\nQuestion: ?"
    found = matcher.find(prompt)
    _check(prompt, corpus, found)
    assert found, "some chunk of the document must be recognised"


def test_template_order_and_repeats():
    corpus = {f"c{i}": f"Document {i}: " + "lorem ipsum " * (i + 3) for i in range(5)}
    m = ChunkMatcher()
    for cid, t in corpus.items():
        m.add(cid, t)
    prompt = f"<ctx>{corpus['c3']}</ctx>\n---\n{corpus['c0']}\n\n{corpus['c3']}\nQ: why?"
    assert [cid for _, _, cid in m.find(prompt)] == ["c3", "c0", "c3"]
    assert [cid for _, _, cid in m.find(prompt, only={"c0"})] == ["c0"]
    assert m.find("nothing known here") == []


def test_work_does_not_grow_with_the_corpus():
    """Lookups per prompt position are bounded by the number of anchor lengths, not chunks."""
    rng = random.Random(0)
    m = ChunkMatcher()
    for i in range(5000):
        m.add(f"c{i}", "".join(rng.choice("abcdefgh ") for _ in range(ANCHOR + 40)))
    assert len(m._anchors) == 1  # every chunk is at least ANCHOR long: one scan of the prompt
    target = m._texts["c4321"]
    found = m.find("xx" + target + "yy")
    assert found == [(2, 2 + len(target), "c4321")]
