"""The QA bench: its readers on tiny files in each format, its metrics, and a resumed run."""

import json

import pytest
from conftest import CORPUS

from cacheclip_rag.config import ChunkConfig, EngineConfig
from cacheclip_rag.engine import CacheClipEngine
from cacheclip_bench import qa
from cacheclip_rag.offline import qa_data
from cacheclip_bench.journal import Journal, machines, provenance, read_rows
from cacheclip_bench.metrics import exact_match, token_f1

CACHEBLEND = [
    {"question": "Where was the author educated?", "answers": ["Exeter College"],
     "ctxs": [{"title": "", "text": CORPUS[0]}, {"title": "Nabbes", "text": CORPUS[1]}]},
    {"question": "What is the code?", "answers": ["4721-9930", "4721"], "ctxs": [{"title": "", "text": CORPUS[2]}, {"title": "", "text": CORPUS[1]}]},
]
LONGBENCH = {"input": "Who keeps the key?", "answers": ["Alice"], "dataset": "hotpotqa", "_id": "ab12",
             "context": f"Passage 1:\nKeys\n{CORPUS[1]}\nPassage 2:\nFoxes\n{CORPUS[0]}"}


def test_cacheblend_json_reads_passages_in_order_with_its_harness_prompt(tmp_path):
    path = tmp_path / "musique_s.json"
    path.write_text(json.dumps(CACHEBLEND, indent=4))
    data = qa_data.load(path)
    assert data.format == "cacheblend" and len(data.examples) == 2
    assert data.examples[0].contexts == [{"text": CORPUS[0]}, {"title": "Nabbes", "text": CORPUS[1]}]
    assert data.examples[1].answers == ["4721-9930", "4721"]
    assert "within 5 words" in data.prompt.system_prompt and "{question}" in data.prompt.question_template


def test_longbench_jsonl_splits_its_context_at_the_passage_marks(tmp_path):
    path = tmp_path / "hotpotqa.jsonl"
    path.write_text(json.dumps(LONGBENCH) + "\n")
    data = qa_data.load(path)
    ex = data.examples[0]
    assert data.format == "longbench" and ex.question == "Who keeps the key?" and ex.id == "ab12"
    assert ex.contexts == [{"text": f"Keys\n{CORPUS[1]}"}, {"text": f"Foxes\n{CORPUS[0]}"}]
    assert data.prompt.question_template.endswith("Question: {question}\nAnswer:")


def test_own_jsonl_keeps_the_engine_prompt(tmp_path):
    path = tmp_path / "own.jsonl"
    path.write_text(json.dumps({"question": "q?", "contexts": ["a text", {"title": "t", "text": "b"}], "answers": ["a"]}))
    data = qa_data.load(path)
    assert data.format == "jsonl" and data.prompt == EngineConfig().prompt
    assert data.examples[0].contexts == [{"text": "a text"}, {"title": "t", "text": "b"}]
    shipped = qa_data.load(qa_data.Path(qa_data.__file__).parent.parent / "data" / "qa_invented.jsonl")
    assert len(shipped.examples) == 32 and all(len(ex.contexts) == 4 for ex in shipped.examples)


@pytest.mark.parametrize("name, text, message", [
    ("a.json", json.dumps([CACHEBLEND[0], {**CACHEBLEND[1], "answers": []}], indent=2), r"a.json:\d+: 'answers' must"),
    ("b.json", json.dumps([CACHEBLEND[0], {**CACHEBLEND[1], "ctxs": [{"title": "x"}]}]), r"b.json:1: each of 'ctxs'"),
    ("c.jsonl", json.dumps(LONGBENCH) + "\n" + json.dumps({**LONGBENCH, "input": ""}), r"c.jsonl:2: 'input' must"),
    ("d.jsonl", json.dumps(LONGBENCH) + "\n{not json", r"d.jsonl:2: not JSON"),
    ("e.jsonl", json.dumps({"q": 1}), r"e.jsonl:1: cannot tell the format"),
    ("f.jsonl", '{"question": "q", "contexts": [], "answers": ["a"]}', r"f.jsonl:1: 'contexts' must"),
    ("g.json", "[" + json.dumps(CACHEBLEND[0]) + ",\n{\"question\": }]", r"g.json:2: not JSON"),
    ("h.jsonl", "", r"holds no examples"),
])
def test_a_malformed_file_names_the_line_and_the_field(tmp_path, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        qa_data.load(path)


def test_the_line_named_is_where_the_item_starts(tmp_path):
    path = tmp_path / "m.json"
    path.write_text(json.dumps([CACHEBLEND[0], {**CACHEBLEND[1], "question": 3}], indent=4))
    second = path.read_text().splitlines().index("    {", 2) + 1
    with pytest.raises(ValueError, match=rf"m.json:{second}: 'question'"):
        qa_data.load(path)
    with pytest.raises(ValueError, match="does not exist"):
        qa_data.load(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="format must be one of"):
        qa_data.load(path, format="squad")
    path.write_bytes(b"\xff\xfe not utf8")
    with pytest.raises(ValueError, match="m.json is not valid UTF-8"):
        qa_data.load(path)


def test_the_scored_answer_and_agreement_are_hand_computable():
    assert qa.answer_of("\n\n Exeter College \nThe author studied there.") == "Exeter College"
    assert qa.answer_of("") == ""
    # "exeter college oxford" against "exeter college": precision 2/3, recall 1: F1 0.8
    assert token_f1("Exeter College, Oxford", "Exeter College") == pytest.approx(0.8)
    assert exact_match("The Exeter college.", "exeter College") == 1.0


def test_journal_refuses_another_run_and_drops_a_torn_last_row(tmp_path):
    path = tmp_path / "r.jsonl"
    journal = Journal(path, {"primary": "a", "data": "x.json"})
    journal.append({"index": 0, "mode": "full", "ratio": 1.0})
    with open(path, "a") as f:
        f.write('{"index": 0, "mode": "reu')  # killed mid-write
    again = Journal(path, {"primary": "a", "data": "x.json"})
    assert again.keys(("index", "mode")) == {(0, "full")}
    assert path.read_text().count("\n") == 2  # header and the one whole row
    with pytest.raises(ValueError, match=r"holds another run \(primary: 'a' there, 'b' here\)"):
        Journal(path, {"primary": "b", "data": "x.json"})
    (tmp_path / "other.jsonl").write_text('{"x": 1}\n')
    with pytest.raises(ValueError, match="not a bench journal"):
        Journal(tmp_path / "other.jsonl", {})


def test_a_journal_resumed_on_another_machine_says_which_rows_each_measured(tmp_path):
    path, header = tmp_path / "r.jsonl", {"primary": "a"}
    old = Journal(path, header)  # a journal of an earlier version: no machine line
    old.append({"index": 0, "mode": "full", "ratio": 1.0})
    first = Journal(path, header, machine="Xeon; 2 threads")
    first.append({"index": 1, "mode": "full", "ratio": 1.0})
    first.append({"index": 2, "mode": "full", "ratio": 1.0})
    again = Journal(path, header, machine="Xeon; 2 threads")  # the same machine: no second line
    again.append({"index": 3, "mode": "full", "ratio": 1.0})
    other = Journal(path, header, machine="EPYC; 1 threads")
    assert len(other.rows) == 4 and [r["index"] for r in read_rows(path)] == [0, 1, 2, 3]
    other.append({"index": 4, "mode": "full", "ratio": 1.0})
    assert machines(path) == [(None, 1), ("Xeon; 2 threads", 3), ("EPYC; 1 threads", 1)]
    assert path.read_text().count('"machine"') == 2
    said = provenance([f"tag={path}", tmp_path / "saved.json"])
    assert f"{path}: 3 rows, Xeon; 2 threads" in said and f"{path}: 1 rows, EPYC; 1 threads" in said
    assert f"{path}: 1 rows, machine not recorded" in said and "saved.json: a saved run" in said


def _engine(tiny_pair, store, prompt):
    cfg = EngineConfig(chunk=ChunkConfig(chunk_tokens=48, overlap_tokens=0), prompt=prompt)
    return CacheClipEngine(*tiny_pair, store, cfg)


def test_a_resumed_run_continues_from_its_journal_and_gives_the_same_table(tiny_pair, tmp_path):
    path = tmp_path / "musique_s.json"
    path.write_text(json.dumps(CACHEBLEND))
    data = qa_data.load(path)
    eng = _engine(tiny_pair, tmp_path / "s", data.prompt)
    modes = [("reuse", 0.0), ("cacheclip", 0.5)]
    whole = qa.run(eng, data.examples, modes, max_new_tokens=3)
    header = {"data": path.name, "primary": "tiny"}
    first = Journal(tmp_path / "r.jsonl", header)
    qa.run(eng, data.examples[:1], modes, max_new_tokens=3, journal=first)  # stopped after one question
    assert len(first.rows) == 3
    steps = []
    resumed = qa.run(eng, data.examples, modes, max_new_tokens=3, journal=Journal(tmp_path / "r.jsonl", header),
                     progress=steps.append)
    assert len(steps) == 2 and len(Journal(tmp_path / "r.jsonl", header).rows) == 6  # question 0 not measured again
    answers = lambda rs: [(r.index, r.mode, r.ratio, r.answer, r.f1, r.agreement) for r in rs]  # noqa: E731
    assert answers(resumed) == answers(whole)
    timeless = lambda rows: [{k: v for k, v in r.items() if "ttft" not in k} for r in rows]  # noqa: E731
    assert json.dumps(timeless(qa.summarize(resumed))) == json.dumps(timeless(qa.summarize(whole)))  # nan == nan
    full = [r for r in whole if r.mode == "full"]
    reuse = [r for r in whole if r.mode == "reuse"]
    assert [r.recomputed_by_passage for r in full] == [[1.0, 1.0], [1.0, 1.0]]
    assert [r.recomputed_by_passage for r in reuse] == [[0.0, 0.0], [0.0, 0.0]]
    assert [r.gold_passages for r in full] == [[], [1]]  # the second passage of question 1 holds "4721-9930"
    summary = {r["label"]: r for r in qa.summarize(whole)}
    assert summary["full"]["gold_share"] == 1.0 and summary["reuse"]["gold_share"] == 0.0
    assert all(r.agreement == 1.0 and r.ttft_vs_full == 1.0 for r in full)
    for r in whole:
        assert r.agreement == pytest.approx(token_f1(r.answer, full[r.index].answer))
    rows = qa.summarize(whole)
    assert [r["label"] for r in rows] == ["full", "cacheclip@0.5", "reuse"]
    pairs = qa.versus(whole, rows, "cacheclip@0.5", "agreement")
    assert {p["other"] for p in pairs} == {"full", "reuse"} and all(p["samples"] == 2 for p in pairs)
    with pytest.raises(ValueError, match="no bench row is labelled 'x'"):
        qa.versus(whole, rows, "x")


def _row(index, mode, ratio, answer, f1):
    return qa.QAResult(index=index, id=str(index), mode=mode, ratio=ratio, prediction=answer, answer=answer, f1=f1,
                       em=float(f1 == 1.0), rouge_l=f1, contains=f1, agreement=1.0 if mode == "full" else 0.5,
                       ttft=1.0, ttft_vs_full=1.0, effective_fraction=ratio, prompt_tokens=10)


def test_load_pools_qa_runs_and_tags_a_run_of_another_profile(tmp_path):
    """`bench qa --from`: journals and JSON pooled by question; a shared full answer kept once, a
    question answered twice differently refused; TAG=PATH sets a run beside, paired by question."""
    from dataclasses import asdict

    header = {"data": "musique_s.json"}
    needle_profile = Journal(tmp_path / "a.jsonl", header)
    for row in (_row(0, "full", 1.0, "exeter", 1.0), _row(0, "cacheclip", 0.2, "oxford", 0.0),
                _row(1, "full", 1.0, "4721", 1.0), _row(1, "cacheclip", 0.2, "4721", 1.0)):
        needle_profile.append(asdict(row))
    other = [_row(0, "full", 1.0, "exeter", 1.0), _row(0, "cacheclip", 0.2, "exeter", 1.0),
             _row(1, "full", 1.0, "4721", 1.0), _row(1, "cacheclip", 0.2, "4721", 1.0)]
    qa.write_json(other, qa.summarize(other), tmp_path / "b.json")
    pooled = qa.load([tmp_path / "a.jsonl", f"qa={tmp_path / 'b.json'}"])
    rows = {r["label"]: r for r in qa.summarize(pooled)}
    assert set(rows) == {"full", "cacheclip@0.2", "qa/full", "qa/cacheclip@0.2"}
    assert rows["qa/cacheclip@0.2"]["pct_of_full"] == pytest.approx(100.0)  # against the untagged full
    assert rows["cacheclip@0.2"]["pct_of_full"] == pytest.approx(50.0)
    (pair,) = [p for p in qa.versus(pooled, list(rows.values()), "qa/cacheclip@0.2") if p["other"] == "cacheclip@0.2"]
    assert pair["samples"] == 2 and pair["diff"] == pytest.approx(0.5)
    assert len(qa.load([tmp_path / "a.jsonl", tmp_path / "a.jsonl"])) == 4  # the same rows twice: kept once
    with pytest.raises(ValueError, match=r"b.json: sample \(0, 'cacheclip', 0.2\) is also in .*a.jsonl with another"):
        qa.load([tmp_path / "a.jsonl", tmp_path / "b.json"])
    (tmp_path / "c.json").write_text('{"summary": []}')
    with pytest.raises(ValueError, match="c.json: not a QA bench journal or JSON"):
        qa.load([tmp_path / "c.json"])


def test_the_diagnosis_measures_each_mode_against_full_attention_and_its_attention_oracle(tiny_pair, tmp_path):
    from cacheclip_bench import qa_diagnose

    path = tmp_path / "musique_s.json"
    path.write_text(json.dumps(CACHEBLEND))
    data = qa_data.load(path)
    eng = _engine(tiny_pair, tmp_path / "s", data.prompt)
    modes = [("reuse", 0.0), ("cacheclip", 0.3), ("prophetkv", 0.3), ("cacheclip-passage", 0.3),
             ("cacheclip-hmax-tokens", 0.3), ("cacheclip-deep", 0.3), (qa_diagnose.ORACLE, 0.3)]
    results = qa_diagnose.run(eng, [(1, data.examples[1])], modes, answer_tokens=3)
    (q,) = results
    layout = eng.prepare(data.examples[1].question, eng.ingest([dict(c) for c in data.examples[1].contexts],
                                                                   progress=False, split=False)).layout
    lens = [seg.end - seg.start for seg in layout.chunk_segments()]
    assert q.index == 1 and q.gold_passages == [1] and sum(q.oracle_mass) == pytest.approx(1.0, abs=1e-4)
    assert len(q.aux_mass) == 2 and sum(q.aux_mass) == pytest.approx(1.0, abs=1e-4)
    rows = {r.mode: r for r in q.rows}
    assert rows["reuse"].held == 0.0 and rows["reuse"].effective_fraction == 0.0 and rows["reuse"].gold == 0.0
    oracle = rows[qa_diagnose.ORACLE]
    assert oracle.overlap == 1.0 and oracle.held >= rows["prophetkv"].held - 1e-6  # the same count, the most mass
    assert all(r.kl >= 0 and 0 <= r.top1 <= 1 for r in q.rows)
    summary = qa_diagnose.summarize(results, answered_only=False)
    assert [r["label"] for r in summary] == ["reuse", "attention@0.3", "cacheclip@0.3", "cacheclip-deep@0.3",
                                             "cacheclip-hmax-tokens@0.3", "cacheclip-passage@0.3", "prophetkv@0.3"]
    assert rows["cacheclip-hmax-tokens"].effective_fraction == pytest.approx(0.3, abs=0.02)  # top tokens, no grouping
    assert rows["cacheclip-passage"].effective_fraction in {n / sum(lens) for n in lens}  # one whole passage
    assert rows["cacheclip-passage"].gold in (0.0, 1.0)
    assert "attention@0.3" in qa_diagnose.question_table(results) and "KL 1st" in qa_diagnose.table(summary)
    with pytest.raises(ValueError, match=r"\['cacheblend'\] have none"):
        qa_diagnose.run(eng, [(1, data.examples[1])], [("cacheblend", 0.3)])
