"""`cacheclip bench` and `cacheclip eval` end to end on tiny models saved as local folders: the
commands the benchmark harness adds to the library's command line."""

import json
import re

import pytest
from conftest import CORPUS

from cacheclip_rag.cli import main


def _args(folders, store):
    return ["--store", str(store), "--primary", folders[0], "--aux", folders[1]]


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


def test_bench_ttft_cold_times_the_first_request_of_fresh_processes(folders, tmp_path, capsys):
    out = tmp_path / "cold.json"
    assert main(["bench", "ttft", "--cold", "--lengths", "100", "--modes", "full", "cacheclip", "--ratios", "0.5",
                 "--chunk-tokens", "40", "--json", str(out), *_args(folders, tmp_path / "s")]) == 0
    printed = capsys.readouterr().out
    assert "first / next" in printed and "cacheclip@0.5" in printed
    rows = json.loads(out.read_text())["rows"]
    assert [(r["mode"], r["warm_up"]) for r in rows] == [("full", False), ("full", True), ("cacheclip", False),
                                                         ("cacheclip", True)]
    assert all(len(r["ttfts"]) == 6 and r["first_vs_rest"] > 0 for r in rows)
    assert all((r["warm_up_s"] > 0) == r["warm_up"] for r in rows)


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


def test_bench_stages_takes_each_mode_apart_beside_its_arithmetic(folders, tmp_path, capsys):
    out = tmp_path / "stages.json"
    assert main(["bench", "stages", "--lengths", "120", "--runs", "1", "--modes", "reuse", "cacheclip@0.5",
                 "prophetkv@0.5", "--chunk-tokens", "40", "--json", str(out), *_args(folders, tmp_path / "s")]) == 0
    printed = capsys.readouterr().out
    assert "x arith" in printed and "cacheclip@0.5" in printed
    rows = {r["mode"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"full", "full-model", "reuse", "cacheclip", "prophetkv"}
    full, model, reuse, clip = rows["full"], rows["full-model"], rows["reuse"], rows["cacheclip"]
    assert full["ttft"] == pytest.approx(1.0) and full["arithmetic"] == pytest.approx(1.0)
    assert model["ttft"] > 0 and model["arithmetic"] == pytest.approx(1.0)
    assert 0 < model["attention"] < model["recompute"]  # sdpa's share of the model's prefill, from the profile
    # reuse recomputes the question's rows alone: its arithmetic is theirs
    assert reuse["rows"] == reuse["question_rows"] and reuse["arithmetic"] == pytest.approx(reuse["arith_question"])
    assert reuse["arithmetic"] < clip["arithmetic"] < 1 and clip["rows"] > clip["question_rows"]
    for row in (reuse, clip):  # the loader's stages were seen
        assert row["read"] > 0 and row["write"] > 0
    for row in (reuse, clip, rows["prophetkv"]):  # the recompute's ranges, ProphetKV's first stage left out
        assert row["dense"] > 0 and row["attention"] > 0 and row["other"] >= 0
        parts = row["dense"] + row["attention"] + row["writes"] + row["logits"] + row["other"]
        assert parts == pytest.approx(row["recompute"], rel=1e-6)


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


def test_every_bench_is_one_module_behind_the_harness_interface():
    from cacheclip_bench.benches import BENCHES

    names = [b.NAME for b in BENCHES]
    assert len(names) == len(set(names)) == 14
    for bench in BENCHES:
        assert isinstance(bench.HELP, str) and bench.HELP
        assert callable(bench.arguments) and callable(bench.measure)


def test_without_the_harness_bench_and_eval_say_how_to_install_it(monkeypatch, capsys):
    import cacheclip_rag.cli as cli

    monkeypatch.setattr(cli, "entry_points", lambda group: [])  # as where the harness is not installed
    for command in (["bench", "niah", "--samples", "1"], ["eval"]):
        assert main(command) == 2
        assert "pip install -e ./benchmarks" in capsys.readouterr().err
    assert "ask" in cli.parser().format_help() and "benchmark harness" in cli.parser().format_help()


def test_a_plugin_that_does_not_import_leaves_the_library_commands_working(monkeypatch, capsys, caplog):
    from importlib.metadata import EntryPoint

    import cacheclip_rag.cli as cli

    broken = EntryPoint(name="bench", value="cacheclip_bench_not_here.cli:add_commands", group=cli.PLUGIN_GROUP)
    monkeypatch.setattr(cli, "entry_points", lambda group: [broken])
    assert cli.plugins() == [] and "does not import" in caplog.text
    assert main(["bench", "ttft"]) == 2 and "pip install -e ./benchmarks" in capsys.readouterr().err
    assert "ingest" in cli.parser().format_help()
