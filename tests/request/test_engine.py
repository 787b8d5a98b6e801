"""The engine on tiny random models: modes, oracles end to end, streaming, healing, bad input."""

import copy

import pytest
import torch
from conftest import CORPUS, tiny_model

from cacheclip_rag import CacheClipEngine, ChunkConfig, EngineConfig
from cacheclip_rag.models.loading import wrap

QUESTION = "what is the code in the kitchen drawer?"


@pytest.fixture()
def engine(tiny_pair, tmp_path):
    primary, aux = tiny_pair
    cfg = EngineConfig(chunk=ChunkConfig(chunk_tokens=24, overlap_tokens=4), top_k=3)
    eng = CacheClipEngine(primary, aux, tmp_path / "store", cfg)
    eng.ids = eng.ingest(CORPUS, progress=False)
    return eng


def _first_logits_equal(engine, ids, **a):
    """Greedy text of two configurations must agree; compared on several tokens."""
    return engine.answer(QUESTION, chunk_ids=ids, max_new_tokens=8, **a).text


def test_ingest_returns_ids_in_document_order(engine):
    assert len(engine.ids) >= len(CORPUS)
    again = engine.ingest([CORPUS[0]], progress=False)  # idempotent: same ids, nothing new
    assert again == engine.ids[: len(again)]
    assert len(engine.index) == len(set(engine.ids))


def test_ratio_one_equals_full_and_ratio_zero_equals_reuse(engine):
    ids = engine.ids[:4]
    full = engine.answer(QUESTION, chunk_ids=ids, mode="full", max_new_tokens=8)
    clip1 = engine.answer(QUESTION, chunk_ids=ids, mode="cacheclip", recompute_ratio=1.0, max_new_tokens=8)
    assert clip1.text == full.text and clip1.effective_fraction == 1.0
    reuse = engine.answer(QUESTION, chunk_ids=ids, mode="reuse", max_new_tokens=8)
    clip0 = engine.answer(QUESTION, chunk_ids=ids, mode="cacheclip", recompute_ratio=0.0, max_new_tokens=8)
    assert clip0.text == reuse.text and clip0.recomputed == reuse.recomputed
    assert reuse.effective_fraction == 0.0 and reuse.cached_tokens > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_full_by_the_layer_loop_equals_full_by_the_model(tiny_pair, tmp_path, dtype):
    """`full_prefill="loop"` computes every row through the recompute loop: the model's own full
    prefill, the same greedy text and first logits (within the dtype's rounding)."""
    primary, aux = tiny_pair
    primary = wrap(copy.deepcopy(primary.model).to(dtype), primary.tokenizer, f"tiny-{dtype}")
    answers = {}
    for how in ("model", "loop"):
        cfg = EngineConfig(chunk=ChunkConfig(chunk_tokens=24, overlap_tokens=4), full_prefill=how)
        eng = CacheClipEngine(primary, aux, tmp_path / how, cfg)
        ids = eng.ingest(CORPUS, progress=False)[:4]
        answers[how] = eng.answer(QUESTION, chunk_ids=ids, mode="full", max_new_tokens=8)
    assert answers["loop"].text == answers["model"].text
    assert answers["loop"].recomputed == answers["model"].recomputed and answers["loop"].cached_tokens == 0


def test_full_prefill_auto_takes_the_loop_only_where_its_attention_is_faster():
    from cacheclip_kernels import default_kind

    from cacheclip_rag.request.recompute import loop_prefills_faster

    cpu = torch.device("cpu")
    assert not loop_prefills_faster("auto", cpu, torch.float32)  # split blocks: the model's forward
    assert loop_prefills_faster("auto", cpu, torch.bfloat16) == (default_kind(cpu, torch.bfloat16, None) == "matmul")
    assert not loop_prefills_faster("auto", torch.device("cuda"), torch.bfloat16)  # the Triton kernel's device
    with pytest.raises(ValueError, match="full_prefill must be one of"):
        EngineConfig(full_prefill="fast")


def test_cacheclip_answer_metadata(engine):
    ids = engine.ids[:4]
    ans = engine.answer(QUESTION, chunk_ids=ids, recompute_ratio=0.5, max_new_tokens=4)
    assert ans.chunk_ids == ids and ans.mode == "cacheclip"
    assert {"selection", "load", "recompute", "ttft", "total"} <= set(ans.timings)
    chunk_rows = set(engine.prepare(QUESTION, chunk_ids=ids).layout.chunk_rows().tolist())
    assert ans.context_tokens == len(chunk_rows)
    assert ans.effective_fraction == len(set(ans.recomputed) & chunk_rows) / len(chunk_rows)
    assert abs(ans.effective_fraction - 0.5) <= 0.1  # the kept budget lands near the ratio
    assert ans.score_layers is not None  # the aux model scored
    assert ans.recomputed == sorted(set(ans.recomputed))
    assert ans.recomputed[-1] == ans.prompt_tokens - 1
    assert ans.generated_tokens <= 4


def test_retrieval_when_no_ids_given(engine):
    ans = engine.answer(QUESTION, max_new_tokens=2)
    assert len(ans.chunk_ids) == 3 and set(ans.chunk_ids) <= set(engine.ids)
    ans2 = engine.answer(QUESTION, k=1, max_new_tokens=2)
    assert len(ans2.chunk_ids) == 1


def test_stream_yields_the_same_text(engine):
    ids = engine.ids[:2]
    streamed = "".join(engine.stream(QUESTION, chunk_ids=ids, max_new_tokens=8))
    assert streamed.strip() == engine.answer(QUESTION, chunk_ids=ids, max_new_tokens=8).text


def test_generate_reuses_chunks_found_in_the_prompt(engine):
    texts = [engine.store.get_chunk(cid).text for cid in engine.ids[:3]]
    prompt = "Context:\n- " + "\n- ".join(reversed(texts)) + f"\n\nQuestion: {QUESTION}"
    ans = engine.generate(prompt, max_new_tokens=4, mode="reuse")
    assert ans.chunk_ids == list(reversed(engine.ids[:3]))
    assert ans.cached_tokens > 0
    with pytest.raises(ValueError, match="not in the prompt"):
        engine.generate(texts[0] + " and a question", chunk_ids=engine.ids[:2])
    # Ids whose texts are absent: the prompt is the question, the chunks go before it.
    as_question = engine.generate("What is the code?", chunk_ids=engine.ids[:2], max_new_tokens=2)
    assert as_question.chunk_ids == engine.ids[:2] and as_question.context_tokens > 0


def test_damaged_cache_is_rebuilt_from_text(engine):
    ids = engine.ids[:2]
    before = engine.answer(QUESTION, chunk_ids=ids, max_new_tokens=6)
    path = engine.store.backend.kv_path(engine.primary.namespace, ids[0])
    data = bytearray(path.read_bytes())
    data[-20] ^= 0x55
    path.write_bytes(bytes(data))
    engine.store.clear_memory()
    after = engine.answer(QUESTION, chunk_ids=ids, max_new_tokens=6)
    assert after.text == before.text
    assert engine.store.stats.damaged == 1 and path.exists()


def test_store_for_another_model_is_refused(engine, tiny_tokenizer):
    other = tiny_model("qwen2", tiny_tokenizer, seed=99)
    with pytest.raises(ValueError, match="different primary model"):
        CacheClipEngine(other, engine.aux.lm, engine.store.backend.root, engine.config)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(recompute_ratio=1.5), r"recompute_ratio must be in \[0, 1\], got 1.5"),
        (dict(recompute_ratio=-0.1), r"recompute_ratio"),
        (dict(recompute_ratio=float("nan")), r"recompute_ratio"),
        (dict(recompute_ratio="lots"), r"recompute_ratio"),
        (dict(mode="turbo"), r"mode must be one of"),
        (dict(max_new_tokens=0), r"max_new_tokens"),
        (dict(k=0), r"k must be an integer"),
    ],
)
def test_bad_request_arguments(engine, kwargs, match):
    with pytest.raises(ValueError, match=match):
        engine.answer(QUESTION, **kwargs)


def test_bad_questions_and_ids(engine):
    with pytest.raises(ValueError, match="question must be a non-empty string"):
        engine.answer("   ")
    with pytest.raises(ValueError, match="unknown chunk ids"):
        engine.answer(QUESTION, chunk_ids=["c-not-there"])
    with pytest.raises(ValueError, match="unknown chunk ids"):
        engine.answer(QUESTION, chunk_ids=["../../etc/passwd"])
    with pytest.raises(ValueError, match="list of chunk id"):
        engine.answer(QUESTION, chunk_ids=engine.ids[0])


def test_empty_corpus(tiny_pair, tmp_path):
    eng = CacheClipEngine(*tiny_pair, tmp_path / "empty")
    with pytest.raises(ValueError, match="empty corpus"):
        eng.answer(QUESTION)
    with pytest.raises(ValueError, match="empty corpus"):
        eng.ingest([])
    with pytest.raises(ValueError, match="empty or whitespace"):
        eng.ingest(["fine text", "  "])
    with pytest.raises(ValueError, match="not a single document"):
        eng.ingest("a bare string")


def test_request_longer_than_the_context(tiny_pair, tmp_path):
    primary, aux = tiny_pair
    eng = CacheClipEngine(primary, aux, tmp_path / "s", EngineConfig(chunk=ChunkConfig(chunk_tokens=4000, overlap_tokens=0)))
    ids = eng.ingest([" ".join(CORPUS * 30)], progress=False)
    with pytest.raises(ValueError, match="context of 2048 positions"):
        eng.answer(QUESTION, chunk_ids=ids, max_new_tokens=8)


def test_stream_sets_the_answer_when_done(engine):
    stream = engine.stream(QUESTION, chunk_ids=engine.ids[:2], max_new_tokens=5)
    assert stream.answer is None
    text = "".join(stream)
    assert stream.answer is not None and stream.answer.text == text.strip()
    with pytest.raises(ValueError, match="recompute_ratio"):
        engine.stream(QUESTION, recompute_ratio=2)  # refused at creation, before iterating


def test_generate_retrieves_for_a_bare_question(engine):
    ans = engine.generate(QUESTION, retrieve=True, k=2, max_new_tokens=2)
    assert len(ans.chunk_ids) == 2 and ans.cached_tokens > 0
    bare = engine.generate(QUESTION, max_new_tokens=2)
    assert bare.chunk_ids == [] and bare.context_tokens == 0  # only the shared prefix is reused


def test_ingest_without_splitting_keeps_texts_verbatim(engine):
    text = " ".join(CORPUS)  # longer than the 24-token chunk size
    ids = engine.ingest([text], split=False, progress=False)
    assert len(ids) == 1 and engine.store.get_chunk(ids[0]).text == text
    ans = engine.generate(f"Context: {text}\nQ: {QUESTION}", max_new_tokens=2)
    assert ans.chunk_ids == ids


def test_reopening_heals_a_lost_index(engine, tiny_pair):
    root = engine.store.backend.root
    for f in (root / "index").iterdir():
        f.unlink()
    reopened = CacheClipEngine(*tiny_pair, root, engine.config)
    assert set(reopened.index.ids()) == set(engine.ids)
    assert len(reopened.matcher) == len(set(engine.ids))


def test_bf16_storage_round_trip(tiny_pair, tmp_path):
    """Caches stored in bf16 for fp32 models: stored and served in bf16 (memory tier and disk
    alike), in a namespace of their own, and answers stay those of fp32 storage up to rounding."""
    from cacheclip_rag import StoreConfig

    primary, aux = tiny_pair
    chunking = ChunkConfig(chunk_tokens=24, overlap_tokens=4)
    plain = CacheClipEngine(primary, aux, tmp_path / "store",
                            EngineConfig(chunk=chunking, store=StoreConfig(kv_dtype="float32", kv_codec="bf16")))
    assert StoreConfig().storage_dtype(torch.float32) == torch.bfloat16  # "auto": bf16 storage for fp32 models
    assert StoreConfig().storage_dtype(torch.float16) == torch.float16
    ids = plain.ingest(CORPUS, progress=False)
    half = CacheClipEngine(primary, aux, tmp_path / "store",
                           EngineConfig(chunk=chunking, store=StoreConfig(kv_dtype="bfloat16", kv_codec="bf16")))
    assert half.primary.namespace != plain.primary.namespace and half.primary.storage == torch.bfloat16
    half.ingest(CORPUS, progress=False)
    on_disk = half.store.backend.get(half.primary.namespace, ids[0])
    assert on_disk.tensor("k.0").dtype == torch.bfloat16
    first = half.answer(QUESTION, chunk_ids=ids[:3], mode="cacheclip", recompute_ratio=0.3, max_new_tokens=6)
    half.store.clear_memory()
    from_disk = half.answer(QUESTION, chunk_ids=ids[:3], mode="cacheclip", recompute_ratio=0.3, max_new_tokens=6)
    assert from_disk.text == first.text and from_disk.recomputed == first.recomputed
    from cacheclip_rag.request.execute import execute

    a = execute(plain.prepare(QUESTION, ids[:3], mode="reuse"), None).logits
    b = execute(half.prepare(QUESTION, ids[:3], mode="reuse"), None).logits
    assert 0 < (a - b).abs().max() < 0.05 * a.abs().max()
    with pytest.raises(ValueError, match="kv_dtype"):
        StoreConfig(kv_dtype="int8")


def test_an_abandoned_stream_leaves_the_threads_grad_mode_alone(tiny_pair, tmp_path):
    """A stream read for one piece and dropped (a client gone, a bench's first-token probe) must
    not leave the consuming thread in inference mode, nor switch it back later when collected."""
    import gc

    with CacheClipEngine(*tiny_pair, tmp_path, EngineConfig(chunk=ChunkConfig(chunk_tokens=24, overlap_tokens=4))) as eng:
        ids = eng.ingest(["The blue key is in the kitchen drawer; the code is 4721-9930."], progress=False)
        stream = eng.stream("what is the code?", chunk_ids=ids, max_new_tokens=6)
        next(stream)
        assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
        with torch.inference_mode():
            del stream
            gc.collect()
            assert torch.is_inference_mode_enabled()  # a late exit did not switch it off here
        assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled()


def test_store_counters_count_chunk_reads_per_model_and_not_the_shared_prefix(engine):
    ids = engine.ids[:2]
    engine.store.clear_memory()
    before = engine.stats()
    engine.answer(QUESTION, chunk_ids=ids, max_new_tokens=2)
    first = engine.stats()
    # the primary read each chunk once, from the store (the prefix is kept with the caches, not re-read)
    assert first["primary_disk_hits"] - before["primary_disk_hits"] == len(ids)
    assert first["primary_memory_hits"] == before["primary_memory_hits"]
    engine.answer(QUESTION, chunk_ids=ids, max_new_tokens=2)
    second = engine.stats()
    assert second["primary_memory_hits"] - first["primary_memory_hits"] == len(ids)  # now from the memory tier
    assert second["primary_disk_hits"] == first["primary_disk_hits"]
    assert second["memory_hits"] >= second["primary_memory_hits"]  # the totals include the aux's reads
    # the aux's scoring layers were kept in memory too: the second request read nothing from the store
    assert second["disk_hits"] == first["disk_hits"]
    assert second["memory_hits"] - first["memory_hits"] == 2 * len(ids)


def test_the_aux_pass_keeps_in_memory_only_the_layers_it_reads(tiny_pair, tmp_path):
    """Scoring at the aux's first layer reads, and keeps, one layer of its two: from the store, or
    from an encode when the store lost the cache (a bounded store drops records); the memory tier
    then serves the next request's aux pass and never stands in for the whole cache. (The store
    keeps every aux layer here: aux_depth "auto" would store the one layer read, tested apart.)"""
    from cacheclip_rag import SelectConfig, StoreConfig
    from cacheclip_rag.storage.record import ChunkKV

    cfg = EngineConfig(chunk=ChunkConfig(chunk_tokens=24, overlap_tokens=4), select=SelectConfig(score_layers=(0,)),
                       store=StoreConfig(aux_depth="all"))
    with CacheClipEngine(*tiny_pair, tmp_path, cfg) as eng:
        ids = eng.ingest(CORPUS, progress=False)[:2]
        ns, store = eng.aux.namespace, eng.store
        store.backend.delete(ns, ids[0])  # lost from the store: encoded again by the aux pass
        store.clear_memory()
        start = store.stats_of(ns)
        first = eng.answer(QUESTION, chunk_ids=ids, mode="cacheclip", max_new_tokens=2)
        read = store.stats_of(ns)
        assert (read.misses - start.misses, read.writes - start.writes, read.disk_hits - start.disk_hits) == (1, 1, 1)
        for cid in ids:
            held = store.open_layers(ns, cid, 1)
            assert isinstance(held, ChunkKV) and len(held.keys) == 1  # the partial entry
            assert not isinstance(store.open_layers(ns, cid), ChunkKV)  # a whole read goes to the store
        before = store.stats_of(ns)
        again = eng.answer(QUESTION, chunk_ids=ids, mode="cacheclip", max_new_tokens=2)
        after = store.stats_of(ns)
        assert after.memory_hits - before.memory_hits == len(ids) and after.disk_hits == before.disk_hits
        assert again.text == first.text


def test_scoring_layers_are_reported_only_where_the_aux_model_scored(engine):
    ids = engine.ids[:3]
    assert engine.answer(QUESTION, ids, recompute_ratio=0.5, max_new_tokens=1).score_layers is not None
    for opts in (dict(recompute_ratio=0.0), dict(recompute_ratio=1.0), dict(mode="reuse"),
                 dict(mode="random", recompute_ratio=0.5)):
        assert engine.answer(QUESTION, ids, max_new_tokens=1, **opts).score_layers is None, opts


def test_a_request_is_frozen_and_its_stages_return_what_they_found(engine):
    """The request is input only: the stages' results come back in the Answer, not in it."""
    import dataclasses

    prepared = engine.prepare(QUESTION, engine.ids[:3], recompute_ratio=0.5, max_new_tokens=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        prepared.request.ratio = 1.0
    before = dataclasses.asdict(prepared.request)
    stream = engine.run(prepared)
    answer = stream.collect()
    assert dataclasses.asdict(prepared.request) == before
    assert len(stream.trace) == 3 and answer.timings["ttft"] > 0 and answer.generated_tokens <= 2


def test_question_first_puts_the_question_before_the_chunks_and_keeps_the_oracles(tiny_pair, tmp_path):
    from cacheclip_rag.config import PromptConfig
    from cacheclip_rag.selectors.ape import ape_positions

    prompt = PromptConfig(question_first="Question: {question}\n\n")
    eng = CacheClipEngine(*tiny_pair, tmp_path / "store", EngineConfig(chunk=ChunkConfig(chunk_tokens=24, overlap_tokens=4),
                                                                         prompt=prompt))
    ids = eng.ingest(CORPUS, progress=False)[:3]
    layout = eng.prepare(QUESTION, ids).layout
    first = layout.segments[0]
    assert not first.cached and QUESTION in first.text and layout.segments[1].cached
    assert first.start == layout.prefix_len and set(range(first.start, first.end)) <= set(layout.uncached_rows().tolist())
    full = eng.answer(QUESTION, chunk_ids=ids, mode="full", max_new_tokens=6)
    lm = eng.primary.lm
    with torch.inference_mode():
        out = lm.model.generate(layout.input_ids[None].to(lm.device), max_new_tokens=6, do_sample=False)
    assert full.text == lm.tokenizer.decode(out[0, layout.num_tokens:], skip_special_tokens=True)  # a plain prefill
    clip1 = eng.answer(QUESTION, chunk_ids=ids, mode="cacheclip", recompute_ratio=1.0, max_new_tokens=6)
    assert clip1.text == full.text
    reuse = eng.answer(QUESTION, chunk_ids=ids, mode="reuse", max_new_tokens=6)
    assert set(range(first.start, first.end)) <= set(reuse.recomputed)  # computed fresh, never from the store
    starts = {int(ape_positions(layout)[s.start]) for s in layout.chunk_segments()}
    assert starts == {first.end}  # APE's parallel chunks start after it, not on top of it
    with pytest.raises(ValueError, match="question_first must contain"):
        PromptConfig(question_first="no placeholder")


def test_warm_up_touches_nothing_of_the_callers_store_and_changes_no_answer(tiny_pair, tmp_path):
    cfg = EngineConfig(chunk=ChunkConfig(chunk_tokens=24, overlap_tokens=4))
    with CacheClipEngine(*tiny_pair, tmp_path / "a", cfg) as cold:
        ids = cold.ingest(CORPUS, progress=False)
        before = cold.answer("what is the code?", chunk_ids=ids[:3], recompute_ratio=0.3, max_new_tokens=4).text
    with CacheClipEngine(*tiny_pair, tmp_path / "b", cfg) as warm:
        ids_b = warm.ingest(CORPUS, progress=False)
        chunks, usage = warm.store.chunk_count(), warm.store.usage()
        assert warm.warm_up(modes=("full", "cacheclip", "prophetkv")) > 0
        assert warm.store.chunk_count() == chunks and warm.store.usage() == usage and len(warm.index) == len(set(ids_b))
        assert warm.answer("what is the code?", chunk_ids=ids_b[:3], recompute_ratio=0.3, max_new_tokens=4).text == before
