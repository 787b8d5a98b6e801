"""The command line end to end on tiny models saved as local folders (any folder works as a model)."""

import json
import re

import pytest
from conftest import CORPUS

from cacheclip_rag.cli import main


@pytest.fixture(scope="module")
def folders(tiny_pair, tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    out = []
    for name, lm in zip(("primary", "aux"), tiny_pair):
        path = root / name
        lm.model.save_pretrained(path)
        lm.tokenizer.save_pretrained(path)
        out.append(str(path))
    return out


def _args(folders, store):
    return ["--store", str(store), "--primary", folders[0], "--aux", folders[1]]


def test_ingest_ask_and_selection_page(folders, tmp_path, capsys):
    docs = tmp_path / "docs.jsonl"
    docs.write_text("\n".join(json.dumps({"title": f"d{i}", "text": t}) for i, t in enumerate(CORPUS)))
    txt = tmp_path / "note.txt"
    txt.write_text("A plain text note about the harbour and the code 4721-9930.")
    assert main(["ingest", str(docs), str(txt), "--quiet", "--chunk-tokens", "32", *_args(folders, tmp_path / "s")]) == 0
    assert "ingested" in capsys.readouterr().out
    page = tmp_path / "sel.html"
    code = main(["ask", "what is the code?", "--ratio", "0.5", "--max-new-tokens", "3", "--json",
                 "--show-selection", str(page), *_args(folders, tmp_path / "s")])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert result["mode"] == "cacheclip" and result["chunk_ids"]
    assert page.exists()


def test_lazy_int4_bounded_ingest_then_store_stats(folders, tmp_path, capsys):
    """--kv-codec, --max-gb and --lazy from the command line; stats shows codec, bytes a token and
    the bound; an unknown codec is refused by argparse, naming the choices."""
    docs = tmp_path / "docs.jsonl"
    docs.write_text("\n".join(json.dumps({"text": t}) for t in CORPUS))
    args = [*_args(folders, tmp_path / "s"), "--kv-codec", "int4", "--max-gb", "0.5"]
    assert main(["ingest", str(docs), "--quiet", "--lazy", "--chunk-tokens", "32", *args]) == 0
    capsys.readouterr()
    assert main(["ask", "what is the code?", "--ratio", "0.5", "--max-new-tokens", "2", *args]) == 0
    capsys.readouterr()
    assert main(["store", "stats", "--store", str(tmp_path / "s")]) == 0
    out = capsys.readouterr().out
    assert "of a bound of 512.0 MB" in out and "KiB/token" in out
    rows = [line for line in out.splitlines() if " int4 " in line]
    assert len(rows) == 2, out  # primary and aux, each with its bytes a token
    assert all(re.search(r"\d+\.\d\d  \(namespace", line) for line in rows)
    assert "requests score with the aux model's last layer until `cacheclip calibrate`" in out  # tiny pair: none shipped
    with pytest.raises(SystemExit):
        main(["ingest", str(docs), "--kv-codec", "int3", *_args(folders, tmp_path / "s")])
    assert "invalid choice: 'int3'" in capsys.readouterr().err


def test_calibrate_then_store_stats_shows_the_profile(folders, tmp_path, capsys):
    out = tmp_path / "cal.json"
    assert main(["calibrate", "--lengths", "120", "--samples", "1", "--json", str(out), *_args(folders, tmp_path / "s")]) == 0
    printed = capsys.readouterr().out
    profile = json.loads(out.read_text())["profile"]
    assert "KL(full||" in printed and f"aux layers {profile['aux_layers']}" in printed
    assert main(["store", "stats", "--store", str(tmp_path / "s")]) == 0
    assert f"selection profile: aux layers {profile['aux_layers']}" in capsys.readouterr().out


def test_calibrate_on_a_qa_file_takes_its_last_questions_and_their_length(folders, tmp_path, capsys):
    """`calibrate --data`: passages as chunks under the dataset's prompt, the file's last --samples
    questions by default (bench qa starts at the first), the profile at their median length; a
    range outside the file is refused, naming it."""
    data = tmp_path / "musique_s.json"
    data.write_text(json.dumps([{"question": f"What is code {i}?", "answers": ["4721"],
                                 "ctxs": [{"title": "", "text": CORPUS[i]}, {"title": "", "text": CORPUS[2]}]}
                                for i in range(3)]))
    out = tmp_path / "cal.json"
    args = ["calibrate", "--data", str(data), "--samples", "2", "--json", str(out), *_args(folders, tmp_path / "s")]
    assert main(args) == 0
    assert "calibrating on musique_s.json questions 1-2 (cacheblend)" in capsys.readouterr().out
    profile = json.loads(out.read_text())["profile"]
    assert profile["inputs"] == "musique_s.json questions 1-2 (cacheblend)" and profile["seeds"] == []
    assert len(profile["lengths"]) == 1 and 60 < profile["lengths"][0] < 400, profile["lengths"]
    assert main([*args, "--offset", "3"]) == 2
    assert "--offset 3 / --samples 2: " in capsys.readouterr().err


def test_bench_niah_pools_saved_runs_without_loading_models(tmp_path, capsys):
    from cacheclip_bench import needle

    def row(mode, ratio, seed, score):
        return needle.NeedleResult(length=64, variant="multikey_1", seed=seed, mode=mode, ratio=ratio, score=score,
                                   answer=str(score), ttft=1.0, ttft_vs_full=1.0, selection=0.0, load=0.0,
                                   assemble=0.0, recompute=0.0, effective_fraction=ratio, prompt_tokens=9,
                                   needle_coverage=1.0, oracle_overlap=float("nan"))

    for seed in (0, 1):
        run = [row("full", 1.0, seed, 1.0), row("reuse", 0.0, seed, 0.0), row("cacheclip", 0.2, seed, float(seed))]
        needle.write_json(run, needle.summarize(run), tmp_path / f"s{seed}.json")
    out = tmp_path / "pooled.json"
    assert main(["bench", "niah", "--from", str(tmp_path / "s0.json"), str(tmp_path / "s1.json"), "--json", str(out),
                 "--versus", "cacheclip@0.2", "--primary", "no-such-model"]) == 0
    printed = capsys.readouterr().out
    assert "Paired differences" in printed and "cacheclip@0.2" in printed
    pooled = json.loads(out.read_text())
    assert len(pooled["samples"]) == 6 and {p["other"] for p in pooled["versus"]} == {"full", "reuse"}
    ttft = tmp_path / "ttft.json"
    ttft.write_text(json.dumps([dict(length=64, mode=m, ratio=r, vs_full=v)
                                for m, r, v in (("full", 1.0, 1.0), ("reuse", 0.0, 0.05), ("cacheclip", 0.2, 0.21))]))
    assert main(["bench", "niah", "--from", str(out), "--frontier", "--ttft-from", str(ttft), "--primary", "x"]) == 0
    printed = capsys.readouterr().out
    assert "cacheclip@0.2                0.210" in printed  # placed at the TTFT run's ratio
    assert f"TTFT / full of {ttft} (machine not recorded)" in printed
    assert "first keeps >= 95% of full" in printed and "not by 0.2" in printed
    # a journal of another machine beside the saved run: said, and the frontier's mixed TTFT named
    from dataclasses import asdict

    from cacheclip_bench.journal import Journal

    journal = Journal(tmp_path / "epyc.jsonl", {"primary": "p"}, machine="AMD EPYC; 1 threads")
    for r in (row("full", 1.0, 2, 1.0), row("cacheclip", 0.2, 2, 1.0)):
        journal.append(asdict(r))
    assert main(["bench", "niah", "--from", str(out), str(journal.path), "--frontier", "--primary", "x"]) == 0
    printed = capsys.readouterr().out
    assert f"{journal.path}: 2 rows, AMD EPYC; 1 threads" in printed and "pooled.json: a saved run" in printed
    assert "measured on more than one machine" in printed
    for flag in (["--from", str(out)], ["--versus", "cacheclip@0.2"]):  # each bench takes its own flags only
        with pytest.raises(SystemExit) as exit_:
            main(["bench", "ttft", *flag])
        assert exit_.value.code == 2 and f"unrecognized arguments: {flag[0]}" in capsys.readouterr().err


def test_bench_fidelity_prints_the_table_and_paired_differences(folders, tmp_path, capsys):
    out = tmp_path / "f.json"
    assert main(["bench", "fidelity", "--lengths", "100", "--samples", "1", "--variants", "multivalue", "--modes",
                 "reuse", "cacheclip", "--ratios", "0.5", "--chunk-tokens", "40", "--max-new-tokens", "3",
                 "--json", str(out), *_args(folders, tmp_path / "s")]) == 0
    printed = capsys.readouterr().out
    assert "KL(full||·)" in printed and "Paired KL differences" in printed
    assert {p["other"] for p in json.loads(out.read_text())["versus"]} == {"reuse"}


def test_bench_store_compares_every_codec_with_bf16(folders, tmp_path, capsys):
    import os

    out = tmp_path / "store.json"
    redis = os.environ.get("CACHECLIP_TEST_REDIS")
    args = ["bench", "store", "--lengths", "100", "--samples", "2", "--variants", "multivalue", "--modes", "reuse",
            "cacheclip", "--ratios", "0.5", "--chunk-tokens", "40", "--max-new-tokens", "3", "--fidelity-samples", "1",
            "--answer-tokens", "3", "--runs", "1", "--json", str(out), *_args(folders, tmp_path / "s")]
    assert main(args + (["--redis", f"{redis}?prefix=t-{tmp_path.name}-{os.getpid()}"] if redis else [])) == 0
    printed = capsys.readouterr().out
    for heading in ("Bytes a token as stored", "codec - bf16 on the same samples", "KL(full || mode), codec - bf16",
                    "TTFT, codecs and stores alternated", "Qwen2.5-7B-Instruct", "1e+07 chunks"):
        assert heading in printed, heading
    doc = json.loads(out.read_text())
    costs = {c["codec"]: c for c in doc["costs"]}
    total = {c: v["primary_bytes_per_token"] + v["aux_bytes_per_token"] for c, v in costs.items()}
    assert total["bf16"] > total["int8"] > total["int4"]
    assert {(r["codec"], r["backend"]) for r in doc["ttft"]} >= {(c, "file") for c in costs}
    if redis:
        assert {r["backend"] for r in doc["ttft"]} == {"file", "redis"}
    assert {r["seed"] for r in doc["needle"]["int4"]} == {r["seed"] for r in doc["needle"]["bf16"]}  # same samples
    assert main(["bench", "store", "--codecs", "int8", *_args(folders, tmp_path / "s")]) != 0
    assert "include it in --codecs" in capsys.readouterr().err


def test_bench_index_reports_recall_and_what_an_ingest_writes(tmp_path, capsys):
    out = tmp_path / "index.json"
    assert main(["bench", "index", "--sizes", "3000", "--queries", "20", "--ingest", "50", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {r["kind"] for r in rows} == {"flat", "ivf", "hnsw"}
    flat = next(r for r in rows if r["kind"] == "flat")
    assert flat["recall"] == 1.0
    assert all(0 <= r["recall"] <= 1 and r["ingest_written_mb"] < r["index_mb"] / 10 for r in rows)
    assert "written/index" in capsys.readouterr().out


def test_bench_fidelity_frontier_places_each_mode_at_its_ttft(folders, tmp_path, capsys):
    """--frontier on the fidelity bench: every point timed in the same run (TTFT / full), KL read
    off each mode's curve at the budget (lower is better), the frontier and its plot."""
    out = tmp_path / "f.json"
    assert main(["bench", "fidelity", "--frontier", "--lengths", "100", "--samples", "1", "--variants", "multivalue",
                 "--modes", "reuse", "cacheclip", "prophetkv", "--ratios", "0.3", "0.6", "auto", "--chunk-tokens", "40",
                 "--max-new-tokens", "3", "--budget-ttft", "5", "--json", str(out), "--plot", str(tmp_path / "p.png"),
                 *_args(folders, tmp_path / "s")]) == 0
    printed = capsys.readouterr().out
    assert "TTFT/full" in printed and "KL(full||mode), interpolated" in printed and "Pareto frontier" in printed
    summary = json.loads(out.read_text())["summary"]
    assert all(r["ttft_vs_full"] > 0 for r in summary)
    assert "cacheclip@auto" in {r["label"] for r in summary}  # a curve of its own beside the numeric ratios
    assert (tmp_path / "p-frontier-100.png").is_file()
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "ttft", "--frontier"])
    assert exit_.value.code == 2 and "unrecognized arguments: --frontier" in capsys.readouterr().err


def test_bench_deviation_prints_layers_concentration_and_fidelity(folders, tmp_path, capsys):
    out = tmp_path / "d.json"
    assert main(["bench", "deviation", "--lengths", "100", "--samples", "1", "--variants", "multivalue", "--ratios",
                 "0.5", "--chunk-tokens", "40", "--max-new-tokens", "3", "--modes", "prophetkv", "--json", str(out),
                 *_args(folders, tmp_path / "s")]) == 0
    printed = capsys.readouterr().out
    assert "V later" in printed and "of the deviation" in printed and "oracle@0.5*" in printed
    assert re.search(r"prophetkv@0\.5 +\d+\.\d%", printed)  # the share of the deviation its rows hold
    assert {p["other"] for p in json.loads(out.read_text())["versus"]} == {"deviation@0.5", "deviation-L1@0.5",
                                                                         "prophetkv@0.5"}
    assert main(["bench", "deviation", "--modes", "deviation", *_args(folders, tmp_path / "s")]) == 2
    assert "bench deviation replays serving modes" in capsys.readouterr().err


def test_bench_ttft_says_where_each_model_runs_and_when_the_aux_selects(folders, tmp_path, capsys):
    assert main(["bench", "ttft", "--lengths", "100", "--runs", "1", "--modes", "reuse", "cacheclip", "--ratios", "0.5",
                 "--chunk-tokens", "40", "--max-new-tokens", "2", *_args(folders, tmp_path / "s")]) == 0
    printed = capsys.readouterr().out
    assert "primary on cpu, aux on cpu: aux selection before cache loading; recompute attends with " in printed
    # dtype "auto": bf16 where this CPU has it natively, else float32
    assert re.search(r"attends with ((matmul|plain) blocks \(bfloat16\)|split blocks \(float32\))", printed)
    assert "cacheclip" in printed and "/full" in printed


def test_bad_input_exits_2_with_a_message(folders, tmp_path, capsys):
    assert main(["ask", "q?", "--ratio", "1.5", *_args(folders, tmp_path / "empty")]) == 2
    assert "recompute_ratio must be in [0, 1]" in capsys.readouterr().err
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xff\xfe\xfa")
    assert main(["ingest", str(bad), *_args(folders, tmp_path / "s2")]) == 2
    assert "not valid UTF-8" in capsys.readouterr().err
    assert main(["ingest", str(tmp_path / "missing.txt"), *_args(folders, tmp_path / "s2")]) == 2


from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    question=st.text(max_size=80),
    ratio=st.one_of(st.sampled_from(["nan", "-1", "0.3", "inf", "1e9", "x"]), st.floats().map(str)),
    payload=st.binary(max_size=200),
)
def test_fuzzed_command_line(folders, tmp_path_factory, question, ratio, payload):
    tmp = tmp_path_factory.mktemp("fuzz")
    doc = tmp / "doc.txt"
    doc.write_bytes(payload)
    store = tmp / "s"
    code = cli_exit(["ingest", str(doc), "--quiet", *_args(folders, store)])
    assert code in (0, 2)
    code = cli_exit(["ask", question, "--ratio", ratio, "--max-new-tokens", "2", *_args(folders, store)])
    assert code in (0, 2)


def cli_exit(argv):
    try:
        return main(argv)
    except SystemExit as exit_:  # argparse rejects malformed flags with exit status 2
        return exit_.code


def test_bench_ttft_peer_row_says_a_folder_primary_has_no_gguf(folders, tmp_path, capsys):
    out = tmp_path / "t.json"
    assert main(["bench", "ttft", "--lengths", "100", "--runs", "1", "--modes", "cacheclip", "--ratios", "0.5",
                 "--chunk-tokens", "40", "--max-new-tokens", "2", "--peer", "llamacpp", "--json", str(out),
                 *_args(folders, tmp_path / "s")]) == 0
    printed = capsys.readouterr().out
    assert "has no GGUF" in printed
    rows = json.loads(out.read_text())
    assert [r["mode"] for r in rows] == ["full", "cacheclip", "llamacpp"]
    assert "has no GGUF" in rows[-1]["note"] and rows[-1]["runs"] == 0
    with pytest.raises(SystemExit) as exited:  # argparse refuses an unknown peer by name
        main(["bench", "ttft", "--peer", "vllm"])
    assert exited.value.code == 2 and "invalid choice: 'vllm'" in capsys.readouterr().err


def test_bench_schedules_times_one_request_under_each_schedule(folders, tmp_path, capsys):
    out = tmp_path / "sch.json"
    assert main(["bench", "schedules", "--length", "120", "--runs", "1", "--ratio", "0.5", "--chunk-tokens", "40",
                 "--json", str(out), *_args(folders, tmp_path / "s")]) == 0
    printed = capsys.readouterr().out
    assert all(name in printed for name in ("overlapped", "select first", "all serial"))
    rows = json.loads(out.read_text())["rows"]
    assert [r["schedule"] for r in rows] == ["overlapped", "select first", "all serial"]
    assert all(r["ttft"] > 0 and r["recompute"] > 0 for r in rows)
    serial = rows[2]
    assert serial["selection_hidden"] == 0  # nothing overlaps when everything runs in turn


def test_bench_recompute_profile_lists_the_operators_of_recompute_and_full(folders, tmp_path, capsys):
    out = tmp_path / "prof.json"
    assert main(["bench", "recompute-profile", "--length", "120", "--ratio", "0.5", "--chunk-tokens", "40",
                 "--json", str(out), *_args(folders, tmp_path / "s")]) == 0
    printed = capsys.readouterr().out
    assert "== recompute:" in printed and "== full:" in printed
    result = json.loads(out.read_text())
    assert [r["name"] for r in result["runs"]] == ["recompute", "full"]
    assert 0 < result["rows"] < result["tokens"]
    assert all(r["seconds"] > 0 and r["ops"] and all(op["calls"] >= 1 for op in r["ops"]) for r in result["runs"])


def test_bench_qa_resumes_its_results_file_and_eval_runs_the_shipped_questions(folders, tmp_path, capsys):
    data = tmp_path / "hotpotqa.jsonl"
    data.write_text("\n".join(json.dumps({"input": f"Who keeps the key {i}?", "answers": ["Alice"], "_id": str(i),
                                          "context": f"Passage 1:\n{CORPUS[1]}\nPassage 2:\n{CORPUS[i]}"})
                              for i in (0, 2, 3)))
    results, out = tmp_path / "rows.jsonl", tmp_path / "qa.json"
    base = ["bench", "qa", "--data", str(data), "--modes", "reuse", "cacheclip", "--ratios", "0.2", "0.5",
            "--max-new-tokens", "2", "--results", str(results), *_args(folders, tmp_path / "s")]
    assert main([*base, "--limit", "1"]) == 0
    lines = results.read_text().splitlines()  # header, the machine, then full, reuse and cacheclip at two ratios
    assert len(lines) == 2 + 4 and json.loads(lines[1])["machine"].endswith("threads")
    capsys.readouterr()
    assert main([*base, "--offset", "1", "--frontier", "--json", str(out)]) == 0  # the rest, and the table of all
    printed = capsys.readouterr().out
    assert "resuming" in printed and "(4 rows)" in printed and "agree" in printed
    assert "Paired differences of agreement with full attention's answer" in printed
    assert "score at TTFT <= 0.25 of full" in printed and "score at TTFT <= 0.3 of full" in printed
    assert len(results.read_text().splitlines()) == 2 + 3 * 4  # resumed on the same machine: no second line
    assert {r["index"] for r in json.loads(out.read_text())["examples"]} == {1, 2}  # the run's own questions
    capsys.readouterr()
    assert main([*base, "--max-new-tokens", "3"]) == 2  # the last --max-new-tokens counts
    assert "holds another run (max_new_tokens: 2 there, 3 here)" in capsys.readouterr().err
    header = json.loads(results.read_text().splitlines()[0])["journal"]
    assert header["kv_codec"] == header["aux_kv_codec"] == "int8"  # what the rows' caches were kept in
    assert main([*base, "--kv-codec", "bf16"]) == 2  # other caches answer another question
    assert "kv_codec: 'int8' there, 'bf16' here" in capsys.readouterr().err
    assert main([*base, "--offset", "3"]) == 2
    assert "--offset must be in [0, 3)" in capsys.readouterr().err
    assert main([*base, "--diagnose"]) == 2  # a diagnosis keeps no journal: refused, not ignored
    assert "takes no --results journal" in capsys.readouterr().err
    assert main([*base, "--indices", "1"]) == 2
    assert "--indices chooses the questions of --diagnose" in capsys.readouterr().err
    assert main(["eval", "--limit", "1", "--modes", "reuse", "--max-new-tokens", "2", *_args(folders, tmp_path / "e")]) == 0
    assert "F1 %full" in capsys.readouterr().out
    # the journal pooled without a model: the same table, and a tagged copy paired with it
    assert main(["bench", "qa", "--from", str(results), f"again={results}", "--offset", "1", "--versus", "again/cacheclip@0.2"]) == 0
    printed = capsys.readouterr().out
    assert "again/cacheclip@0.2" in printed and re.search(r"again/cacheclip@0.2 +cacheclip@0.2 +2 +\+0\.0", printed), printed
    assert f"{results}: 12 rows, " in printed and "threads" in printed  # which machine measured the pooled rows
    assert main(["bench", "qa", "--from", str(results), "--offset", "5"]) == 2
    assert "no saved rows of questions 5.." in capsys.readouterr().err
    assert main(["bench", "qa"]) == 2
    assert "needs --data FILE" in capsys.readouterr().err


def test_store_stats_names_the_shipped_profiles_of_an_embedded_pair():
    from cacheclip_rag.cli.stores import shipped_profile_lines

    pair = [{"role": "primary", "model": "qwen2.5-coder-1.5b-instruct"}, {"role": "aux", "model": "smollm2-135m-instruct"}]
    (line,) = shipped_profile_lines(pair)
    assert "qwen2.5-coder-1.5b-instruct + smollm2-135m-instruct scores with the package's profiles" in line
    assert "[2048, 4096]" in line
    assert "last layer" in shipped_profile_lines([{"role": "primary", "model": "my-model"}, pair[1]])[0]
