"""`bench fidelity --data`: teacher-forced fidelity on real questions, on tiny models and tiny files.

The oracles: recomputing every chunk row is the reference itself (KL 0, every answer reproduced);
reuse leaves KL where chunks interact; a resumed run equals an uninterrupted one; the deviation
ceiling ranks a planted stale row first; a malformed file is refused naming its line and field.
"""

import json
import math

import pytest
import torch
from conftest import CORPUS

from cacheclip_bench import fidelity_qa
from cacheclip_bench.journal import Journal
from cacheclip_rag.cli import main
from cacheclip_rag.config import ChunkConfig, EngineConfig
from cacheclip_rag.engine import CacheClipEngine
from cacheclip_rag.offline import qa_data

QUESTIONS = [
    {"question": "What is the code in the kitchen drawer?", "answers": ["4721"],
     "ctxs": [{"title": "", "text": CORPUS[0]}, {"title": "Drawer", "text": CORPUS[2]}, {"title": "", "text": CORPUS[1]}]},
    {"question": "Who keeps the key?", "answers": ["Alice"],
     "ctxs": [{"title": "", "text": CORPUS[1]}, {"title": "", "text": CORPUS[3]}]},
]
LONGBENCH = {"input": "Who keeps the key?", "answers": ["Alice"], "dataset": "hotpotqa", "_id": "ab12",
             "context": f"Passage 1:\nKeys\n{CORPUS[1]}\nPassage 2:\nFoxes\n{CORPUS[0]}"}
OWN = {"question": "What is the code?", "contexts": [CORPUS[2], {"title": "t", "text": CORPUS[1]}], "answers": ["4721"]}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("qa") / "musique_s.json"
    path.write_text(json.dumps(QUESTIONS))
    return qa_data.load(path)


@pytest.fixture(scope="module")
def eng(tiny_pair, tmp_path_factory, data):
    cfg = EngineConfig(chunk=ChunkConfig(chunk_tokens=24, overlap_tokens=4), prompt=data.prompt)
    with CacheClipEngine(*tiny_pair, tmp_path_factory.mktemp("store"), cfg) as engine:
        yield engine


def test_recomputing_every_row_is_the_reference_and_reuse_is_not(eng, data):
    items = list(enumerate(data.examples))
    rows = fidelity_qa.run(eng, items, [("random", 1.0), ("cacheclip", 0.5)], answer_tokens=4,
                           ceilings=["dev", "attn-mean", "dev-L1"], ceiling_ratios=[1.0, 0.3])
    by = {(r.index, r.chunking, r.mode, r.ratio): r for r in rows}
    assert {c for _, c, _, _ in by} == {"passage", "engine"}
    for index in range(2):
        for chunking in ("passage", "engine"):
            for mode in ("random", "dev", "attn-mean", "dev-L1"):
                whole = by[(index, chunking, mode, 1.0)]
                assert whole.kl == pytest.approx(0.0, abs=1e-6) and whole.exact and whole.effective_fraction == 1.0
            assert by[(index, chunking, "reuse", 0.0)].kl > 1e-7  # several chunks: reuse is not full attention
            assert math.isnan(by[(index, chunking, "dev", 0.3)].ttft_vs_full)  # a ceiling is not a request
            assert by[(index, chunking, "cacheclip", 0.5)].ttft_vs_full > 0
    summary = {(r["chunking"], r["label"]): r for r in fidelity_qa.summarize(rows)}
    assert summary[("passage", "reuse")]["kl_share"] == pytest.approx(1.0)
    assert summary[("passage", "random@1")]["kl_share"] == pytest.approx(0.0, abs=1e-6)
    assert summary[("passage", "random@1")]["exact"] == 1.0 and summary[("passage", "dev@0.3")]["ceiling"]
    pairs = fidelity_qa.versus(rows, ["random@1"])
    mine = [p for p in pairs if p["chunking"] == "passage" and p["other"] == "cacheclip@0.5" and p["metric"] == "kl"]
    assert len(mine) == 1 and mine[0]["diff"] <= 0 and mine[0]["ci95"][0] <= mine[0]["diff"] <= mine[0]["ci95"][1]
    assert "a ceiling" in fidelity_qa.table(fidelity_qa.summarize(rows))


def test_a_resumed_run_equals_an_uninterrupted_one(eng, data, tmp_path):
    items = list(enumerate(data.examples))
    modes = [("cacheclip", 0.5)]
    kw = dict(chunkings=["passage"], ceilings=["dev"], ceiling_ratios=[0.3], answer_tokens=3)
    whole = fidelity_qa.run(eng, items, modes, **kw)
    header = {"data": "musique_s.json", "primary": "tiny"}
    fidelity_qa.run(eng, items[:1], modes, journal=Journal(tmp_path / "f.jsonl", header), **kw)  # stopped
    steps = []
    resumed = fidelity_qa.run(eng, items, modes, journal=Journal(tmp_path / "f.jsonl", header), progress=steps.append,
                              **kw)
    assert steps[0].endswith("(measured before)") and len(Journal(tmp_path / "f.jsonl", header).rows) == 6
    strip = lambda rs: sorted((r.index, r.mode, r.ratio, round(r.kl, 6), r.exact) for r in rs)  # noqa: E731
    assert strip(resumed) == strip(whole)
    assert strip(fidelity_qa.load([str(tmp_path / "f.jsonl")])) == strip(whole)


def test_the_deviation_ceiling_ranks_a_planted_stale_row_first(eng, data):
    ex = data.examples[0]
    ids = eng.ingest([dict(c) for c in ex.contexts], progress=False, split=False)
    ref = fidelity_qa.reference(eng, ex.question, ids, 3, keep_full_cache=True)
    rows = ref.layout.chunk_rows()
    planted = int(rows[len(rows) // 2])
    with torch.inference_mode():
        for layer in range(len(ref.base_cache.keys)):  # this row's reused K and V are far from the full prefill's
            ref.base_cache.keys[layer][0, :, planted] += 50.0
            ref.base_cache.values[layer][0, :, planted] -= 50.0
    attention = torch.full((len(ref.base_cache.keys), rows.numel()), 1.0 / rows.numel())
    scores = fidelity_qa.ceiling_scores(ref, attention, ["dev", "dev-L0", "dev*attn"])
    for name in ("dev", "dev-L0", "dev*attn"):
        assert int(rows[scores[name].argmax()]) == planted, name
        assert int(fidelity_qa.top_rows(rows, scores[name], 1 / rows.numel())[0]) == planted
    with pytest.raises(ValueError, match="dev-L99: the primary has layers 0"):
        fidelity_qa.ceiling_scores(ref, attention, ["dev-L99"])


@pytest.mark.parametrize("name, text", [
    ("musique_s.json", json.dumps(QUESTIONS)),
    ("hotpotqa.jsonl", json.dumps(LONGBENCH) + "\n"),
    ("own.jsonl", json.dumps(OWN) + "\n"),
])
def test_the_command_runs_on_every_format_and_pools_its_journal(folders, tmp_path, capsys, name, text):
    path = tmp_path / name
    path.write_text(text)
    journal = tmp_path / "fid.jsonl"
    common = ["--store", str(tmp_path / "s"), "--primary", folders[0], "--aux", folders[1]]
    assert main(["bench", "fidelity", "--data", str(path), "--modes", "random", "cacheclip", "--ratios", "1.0", "0.5",
                 "--chunkings", "passage", "--ceilings", "dev", "attn-last", "--max-new-tokens", "3", "--frontier",
                 "--results", str(journal), "--json", str(tmp_path / "f.json"), *common]) == 0
    out = capsys.readouterr().out
    assert "random@1" in out and "dev@0.5 *" in out and "a ceiling" in out
    assert ("Paired differences" in out) == (name == "musique_s.json")  # pairs need two questions
    assert "passage chunking: score at TTFT <= 0.25 of full (share of reuse's KL" in out
    saved = json.loads((tmp_path / "f.json").read_text())
    assert {r["label"] for r in saved["summary"]} >= {"reuse", "random@1", "cacheclip@0.5", "dev@1", "attn-last@0.5"}
    whole = [r for r in saved["summary"] if r["label"] == "random@1"][0]
    assert whole["kl"] == pytest.approx(0.0, abs=1e-6) and whole["exact"] == 1.0
    assert main(["bench", "fidelity", "--from", str(journal), "--modes", "random", "--ratios", "1.0"]) == 0
    assert "rows measured on:" in capsys.readouterr().out


def test_bad_input_is_refused_by_name(folders, tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([QUESTIONS[0], {**QUESTIONS[1], "answers": []}], indent=2))
    common = ["--store", str(tmp_path / "s"), "--primary", folders[0], "--aux", folders[1]]
    assert main(["bench", "fidelity", "--data", str(bad), *common]) == 2
    assert "bad.json:" in capsys.readouterr().err
    good = tmp_path / "good.json"
    good.write_text(json.dumps(QUESTIONS))
    assert main(["bench", "fidelity", "--data", str(good), "--ceilings", "deviation", *common]) == 2
    assert "unknown ceilings ['deviation']" in capsys.readouterr().err
    assert main(["bench", "fidelity", "--data", str(good), "--modes", "cacheblend", *common]) == 2
    assert "have none" in capsys.readouterr().err
    assert main(["bench", "fidelity", "--data", str(good), "--offset", "5", *common]) == 2
    assert "--offset must be in [0, 2)" in capsys.readouterr().err
