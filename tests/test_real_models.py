"""End to end with the embedded default models (Qwen2.5-Coder-0.5B primary, SmolLM2-135M aux).

These load real weights from the converted cache folders (`make models` prepares them; the
first load converts them). No hub access.
"""

import pytest
import torch

from cacheclip_rag import CacheClipEngine, ChunkConfig, EngineConfig
from cacheclip_rag.cli.demo import demo_documents
from cacheclip_rag.corpus.encode import tokenize
from cacheclip_rag.models.loading import DEFAULT_AUX, DEFAULT_PRIMARY, load
from cacheclip_rag.selectors.budget import map_tokens

pytestmark = pytest.mark.real_model

TEXTS = [
    "Order 12345678 shipped on 2026-11-29 at 09:41; total 1,234.56 EUR.",
    "id 123e4567-e89b-12d3-a456-426614174000 / 0xDEADBEEF / v3.14.159",
    "Zürich, 東京, São Paulo — naïve café résumé; emoji 🚀🙂 and Ελληνικά, русский.",
]


@pytest.fixture(scope="module")
def pair():
    return load(DEFAULT_PRIMARY), load(DEFAULT_AUX)


@pytest.mark.parametrize("text", TEXTS)
def test_token_mapping_between_the_default_tokenizers(pair, text):
    primary, aux = pair
    p_ids, p_off = tokenize(primary, text)
    a_ids, a_off = tokenize(aux, text)
    # Selecting every aux token selects every primary token.
    everything = map_tokens(a_off, torch.ones(len(a_ids), dtype=torch.bool), p_off, len(text))
    assert everything.all()
    # Selecting one aux token selects exactly the primary tokens overlapping its characters.
    for i in range(len(a_ids)):
        sel = torch.zeros(len(a_ids), dtype=torch.bool)
        sel[i] = True
        got = map_tokens(a_off, sel, p_off, len(text))
        s, e = a_off[i].tolist()
        e = max(e, s + 1)
        expected = [(ps < e and max(pe, ps + 1) > s) for ps, pe in p_off.tolist()]
        assert got.tolist() == expected
        assert got.any(), f"aux token {i} {text[s:e]!r} maps to no primary token"
    # The digits of a number are covered on both sides.
    if "12345678" in text:
        start = text.index("12345678")
        sel = (a_off[:, 0] < start + 8) & (a_off[:, 1] > start)
        got = map_tokens(a_off, sel, p_off, len(text))
        covered = "".join(text[s:e] for (s, e), g in zip(p_off.tolist(), got.tolist()) if g)
        assert "12345678" in covered


def test_answer_in_one_chunk_with_cacheclip(pair, tmp_path):
    primary, aux = pair
    docs = demo_documents()
    engine = CacheClipEngine(primary, aux, tmp_path / "store", EngineConfig(chunk=ChunkConfig(chunk_tokens=256)))
    ids = engine.ingest(docs[:5], progress=False)
    answer = engine.answer(
        "What is the access code of the Harbor Lab records vault?", mode="cacheclip", recompute_ratio=0.2, max_new_tokens=32
    )
    assert "4721-9930" in answer.text
    assert ids[0] in answer.chunk_ids
    assert 0 < answer.effective_fraction < 0.5
    assert answer.cached_tokens > answer.prompt_tokens / 2
    assert answer.timings["ttft"] > 0


def test_shipped_packet_adapters_load_match_their_pin_and_serve(pair, tmp_path, monkeypatch):
    """A new store uses the shipped adapters with no training; a tampered copy is refused by name."""
    from cacheclip_rag.corpus import packets

    primary, aux = pair
    assert primary.name in packets.SHIPPED
    docs = demo_documents()
    engine = CacheClipEngine(primary, aux, tmp_path / "store", EngineConfig(chunk=ChunkConfig(chunk_tokens=256)))
    assert engine.packets is not None and engine.packets.adapters.shape == (8, 8)
    ids = engine.ingest(docs[:5], progress=False, packets=True)
    question = "What is the access code of the Harbor Lab records vault?"
    plain = engine.answer(question, chunk_ids=ids, mode="reuse", max_new_tokens=4)
    packet = engine.answer(question, chunk_ids=ids, mode="packet", max_new_tokens=24)
    both = engine.answer(question, chunk_ids=ids, mode="packet+cacheclip", recompute_ratio=0.2, max_new_tokens=24)
    assert packet.prompt_tokens == plain.prompt_tokens + 16 * len(ids) and "4721-9930" in both.text
    assert packet.effective_fraction == 0.0 < both.effective_fraction < 0.3
    name, pin = packets.SHIPPED[primary.name]
    tampered = tmp_path / "adapters"
    tampered.mkdir()
    data = bytearray((packets.SHIPPED_DIR / name).read_bytes())
    data[-1] ^= 0x01
    (tampered / name).write_bytes(bytes(data))
    monkeypatch.setattr(packets, "SHIPPED_DIR", tampered)
    with pytest.raises(ValueError, match=f"{name}.*pinned {pin}"):
        packets.resolve_adapters("auto", primary)
    (tampered / name).unlink()
    with pytest.raises(ValueError, match=f"{name}: the shipped KV Packet adapters are missing"):
        packets.resolve_adapters("auto", primary)


# ----- Gemma 3 270M: the second family (sliding-window layers, two RoPE thetas, sandwich norms) ----


@pytest.fixture(scope="module")
def gemma():
    from cacheclip_rag.models.loading import GEMMA3

    return load(GEMMA3)


def test_gemma3_full_recompute_reproduces_its_prefill_past_the_window(gemma):
    """The oracle on the real model, on a request longer than its 512-token sliding window."""
    from transformers import DynamicCache

    from cacheclip_rag.corpus.encode import encode_prefix, encode_segment
    from cacheclip_rag.request.assemble import build_layout
    from cacheclip_rag.request.pipeline import assemble
    from cacheclip_rag.request.recompute import recompute_rows

    docs = demo_documents()
    texts = [d["text"] for d in docs]
    prefix = encode_prefix(gemma, "<bos>Answer from the context.\n\n")
    kvs = {f"c{i}": encode_segment(gemma, prefix.token_ids, t) for i, t in enumerate(texts)}
    pieces = [(t, f"c{i}") for i, t in enumerate(texts)] + [("\nQuestion: what is the access code?\nAnswer:", None)]
    layout = build_layout(prefix.token_ids, pieces, lambda s, special: tokenize(gemma, s, special))
    assert layout.num_tokens > 1.5 * gemma.config.sliding_window  # early keys fall out of the local layers
    cache = assemble(gemma, layout, prefix, kvs)
    logits = recompute_rows(gemma, cache, layout.input_ids, torch.arange(layout.prefix_len, layout.num_tokens)).logits
    with torch.inference_mode():
        ref = gemma.model(input_ids=layout.input_ids[None], cache=DynamicCache(), use_cache=True).logits[0, -1].float()
    assert int(logits.argmax()) == int(ref.argmax())
    torch.testing.assert_close(logits, ref, atol=2e-2 * float(ref.abs().max()), rtol=0)


def test_gemma3_as_primary_and_as_aux(gemma, pair, tmp_path):
    """Gemma answers over its own chunk caches (full and cacheclip with the default aux), and
    selects for the default primary as aux."""
    primary, aux = pair
    docs = demo_documents()
    question = "What is the access code of the Harbor Lab records vault?"
    config = EngineConfig(chunk=ChunkConfig(chunk_tokens=256))

    as_primary = CacheClipEngine(gemma, aux, tmp_path / "g-primary", config)
    as_primary.ingest(docs[:5], progress=False)
    full = as_primary.answer(question, mode="full", max_new_tokens=16)
    clip = as_primary.answer(question, mode="cacheclip", recompute_ratio=0.2, max_new_tokens=16)
    assert "4721" in full.text
    assert clip.cached_tokens > 0 and 0 < clip.effective_fraction < 0.5

    as_aux = CacheClipEngine(primary, gemma, tmp_path / "g-aux", config)
    as_aux.ingest(docs[:5], progress=False)
    answer = as_aux.answer(question, mode="cacheclip", recompute_ratio=0.2, max_new_tokens=32)
    assert "4721-9930" in answer.text
    assert 0 < answer.effective_fraction < 0.5


def test_a_new_store_uses_the_shipped_calibrated_profile(pair, tmp_path):
    """Calibrated out of the box: no calibration run, the package's profile for the default pair."""
    import json

    from cacheclip_rag.request.profile_source import SHIPPED_DIR

    primary, aux = pair
    engine = CacheClipEngine(primary, aux, tmp_path / "store", EngineConfig())
    shipped = json.loads((SHIPPED_DIR / f"{primary.name}+{aux.name}.json").read_text())["profiles"]
    assert engine.store.read_profiles() == [] and all(p.source == "shipped" for p in engine.profiles.all())
    assert [list(p.lengths) for p in engine.profiles.all()] == sorted(p["lengths"] for p in shipped)
    for profile in shipped:  # each request length takes the profile calibrated nearest it
        (length,) = profile["lengths"]
        assert engine.profiles.settings(length).score_layers == tuple(profile["aux_layers"])
        assert engine.profiles.settings(length).head_agg == profile["head_agg"]


def test_the_demo_asks_one_question_over_4k_tokens_whose_answer_the_long_documents_hold(pair):
    """`cacheclip demo`'s whole-corpus question: long enough for reuse's saving to show with the
    default primary's tokenizer, and answerable from the documents."""
    from cacheclip_rag.cli.demo import demo_long_documents, demo_questions

    primary, _ = pair
    docs = demo_documents() + demo_long_documents()
    assert sum(len(tokenize(primary, d["text"])[0]) for d in docs) >= 4000
    whole = [q for q in demo_questions() if q.get("context") == "all"]
    assert len(whole) == 1
    text = " ".join(d["text"] for d in docs)
    assert "Marta Solheim led the work" in text and "she commanded the ferry Nordlys" in text
    assert all(a in text for a in whole[0]["answers"])
