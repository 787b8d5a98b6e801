"""`cacheclip bench load` against a real server (uvicorn, tiny models): bounded, checked answers."""

import json

import pytest

from cacheclip_rag import CacheClipEngine, ChunkConfig, EngineConfig
from cacheclip_rag.cli import main
from cacheclip_bench import load
from cacheclip_rag.serving.server import BackgroundServer, create_app


@pytest.fixture()
def server(tiny_pair, tmp_path):
    engine = CacheClipEngine(*tiny_pair, tmp_path / "store", EngineConfig(
        chunk=ChunkConfig(chunk_tokens=48, overlap_tokens=0), top_k=2, packets=None))
    served = BackgroundServer(create_app(engine, max_active=2, max_waiting=16))
    yield served
    served.stop()
    engine.close()


def test_a_small_load_answers_every_request_as_alone_and_loses_no_ingest(server, tmp_path, capsys):
    out = tmp_path / "load.json"
    assert main(["bench", "load", "--url", server.url, "--users", "3", "--requests", "18", "--duration", "120",
                 "--pool", "2", "--documents", "6", "--context", "1", "--max-new-tokens", "4", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "answered/s" in printed and "memory-tier hit rate" in printed
    written = json.loads(out.read_text())
    summary = written["summary"]
    assert written["config"]["context"] == 1
    assert summary["requests"] == 18 and summary["ok"] == 18 and summary["wrong"] == 0
    assert summary["lost_ingests"] == 0 and not summary["errors"]
    assert summary["memory_hit_rate"] is not None and summary["memory_hit_rate"] > 0  # the pool's chunks repeat
    assert summary["ttft"]["p50"] is not None


def test_load_bounds_and_addresses_are_checked():
    with pytest.raises(ValueError, match="this machine"):
        load.check_url("http://10.0.0.5:8000")
    with pytest.raises(ValueError, match="users"):
        load.LoadConfig(users=0)
    with pytest.raises(ValueError, match="seconds"):
        load.LoadConfig(seconds=-1)
    with pytest.raises(ValueError, match="context"):
        load.LoadConfig(context=0)
    with pytest.raises(ValueError, match="mix"):
        load.LoadConfig(mix=(("chat", 1.0), ("delete", 1.0)))
    assert load.parse_mix("chat=1,ingest=0.5") == (("chat", 1.0), ("ingest", 0.5))
    assert main(["bench", "load", "--url", "http://example.com:80"]) == 2


def test_each_load_question_retrieves_its_own_note(tmp_path):
    """The load's questions must reuse chunks the way a RAG workload does: each over its own
    note (a corpus whose questions all retrieve one note measures nothing about routing)."""
    from cacheclip_rag.corpus.index import ChunkIndex

    pairs = load.corpus(32)
    index = ChunkIndex(tmp_path / "index")
    index.add([(f"n{i}", text) for i, (text, _) in enumerate(pairs)])
    assert all(index.search(question, 1)[0][0] == f"n{i}" for i, (_, question) in enumerate(pairs))
    assert len({text for text, _ in pairs}) == 32 and load.corpus(32) == pairs  # distinct, deterministic
