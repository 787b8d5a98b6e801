"""The evaluation harness: needle generator, metrics, writers, and miniature runs end to end."""

import json
import math

import pytest
import torch
from conftest import CORPUS

from cacheclip_rag import CacheClipEngine, ChunkConfig, EngineConfig
from cacheclip_bench.suite import Suite
from cacheclip_bench import (
    alignment,
    deviation,
    fidelity,
    frontier,
    needle,
    plots,
    qa,
    ttft,
)
from cacheclip_rag.cli import selection_html as html
from cacheclip_rag.offline import qa_data
from cacheclip_bench.metrics import (
    best_of,
    exact_match,
    normalize,
    rouge_l,
    token_f1,
)
from cacheclip_bench.stats import bootstrap_interval, mean_of_means
from cacheclip_rag.offline import niah
from cacheclip_rag.offline import reference as fidelity_lib
from cacheclip_rag.offline.niah import VARIANTS, generate, score
from cacheclip_rag.offline.overlap import to_chars, top_jaccard


@pytest.mark.parametrize("variant", VARIANTS)
def test_generator_is_deterministic_and_places_needles_exactly(variant, tiny_tokenizer):
    a = generate(variant, 300, seed=3, tokenizer=tiny_tokenizer)
    b = generate(variant, 300, seed=3, tokenizer=tiny_tokenizer)
    c = generate(variant, 300, seed=4, tokenizer=tiny_tokenizer)
    assert a == b and a.context != c.context
    for needle_text in a.needles:
        assert a.context.count(needle_text) == 1  # each needle once, whole, between sentences
        i = a.context.index(needle_text)
        assert i == 0 or a.context[i - 1] == " "
    for value in a.expected:
        assert sum(value in n for n in a.needles) >= 1
    n_tokens = len(tiny_tokenizer(a.context, add_special_tokens=False)["input_ids"])
    assert 300 <= n_tokens <= 420
    expected_counts = {"multivalue": 4, "multiquery": 4}
    assert len(a.expected) == expected_counts.get(variant, 1)


def test_variant_shapes(tiny_tokenizer):
    mk1 = generate("multikey_1", 300, 0, tiny_tokenizer)
    assert mk1.context.count("One of the special magic numbers for") == 4  # 1 asked + 3 distractors
    mk2 = generate("multikey_2", 300, 0, tiny_tokenizer)
    assert mk2.context.count("One of the special magic numbers for") > 5  # haystack of needles
    mk3 = generate("multikey_3", 300, 0, tiny_tokenizer)
    assert mk3.question.count("-") >= 4 and len(mk3.expected[0]) == 36  # UUID key and value
    s1 = generate("single_1", 300, 0, tiny_tokenizer)
    assert "The grass is green." in s1.context
    with pytest.raises(ValueError, match="variant"):
        generate("nope", 300, 0, tiny_tokenizer)


def test_score_is_reference_coverage():
    assert score("the numbers are 123 and 456", ["123", "456", "789", "000"]) == 0.5
    assert score("UUID ABC-def", ["abc-DEF"]) == 1.0
    assert score("nothing", ["1"]) == 0.0


def test_metrics_against_hand_computed_values():
    assert normalize("The  Amber, Coast!") == "amber coast"
    assert exact_match("the Amber Coast.", "Amber coast") == 1.0
    # pred tokens: [born, in, amber, coast] vs ref [amber, coast]: p = 2/4, r = 1 -> F1 = 2/3
    assert token_f1("born in the Amber Coast", "the Amber Coast") == pytest.approx(2 / 3)
    # LCS of [a, b, c, d] and [a, c, d, e] is 3 -> p = r = 3/4 -> 0.75
    assert rouge_l("alpha beta gamma delta", "alpha gamma delta epsilon") == pytest.approx(0.75)
    assert best_of(token_f1, "Hollin Bay", ["Dunmarsh", "Hollin Bay"]) == 1.0
    assert token_f1("", "x") == 0.0 and rouge_l("x", "y") == 0.0


def test_character_projection_and_jaccard():
    chars = to_chars(torch.tensor([0.5, 0.5]), torch.tensor([[0, 2], [2, 6]]), 6)
    assert chars.tolist() == [0.25, 0.25, 0.125, 0.125, 0.125, 0.125]
    a = torch.tensor([5.0, 4, 3, 2, 1, 0, 0, 0, 0, 0])
    assert top_jaccard(a, a) == 1.0
    assert top_jaccard(a, a.flip(0)) == 0.0
    assert alignment.kl(a + 1, a + 1) == pytest.approx(0.0)


def test_bootstrap_interval_is_seeded_stratified_and_brackets_the_mean():
    groups = {"a": [0.0, 1.0, 1.0, 0.0, 1.0], "b": [1.0, 1.0, 0.5]}
    lo, hi = bootstrap_interval(groups)
    assert (lo, hi) == bootstrap_interval(groups)  # seeded: the same table every time
    assert lo < mean_of_means(groups) < hi and 0.0 <= lo and hi <= 1.0
    assert bootstrap_interval({"a": [0.5], "b": [1.0]}) == pytest.approx((0.75, 0.75))  # one sample each: no spread
    wide = bootstrap_interval(groups, level=0.99)
    assert wide[0] <= lo and hi <= wide[1]
    with pytest.raises(ValueError, match="at least one value"):
        bootstrap_interval({"a": []})


def _result(mode, ratio, variant, seed, score, answer="x"):
    return needle.NeedleResult(length=100, variant=variant, seed=seed, mode=mode, ratio=ratio, score=score,
                               answer=answer, ttft=1.0, ttft_vs_full=1.0, selection=0.0, load=0.0, assemble=0.0,
                               recompute=0.0, effective_fraction=ratio, prompt_tokens=10, needle_coverage=0.5,
                               oracle_overlap=float("nan"))


def test_versus_pairs_samples_and_counts_wins():
    results = []
    for seed, (a, b) in enumerate([(1.0, 0.0), (1.0, 1.0), (0.0, 1.0), (1.0, 0.0)]):
        results += [_result("full", 1.0, "multivalue", seed, 1.0), _result("cacheclip", 0.2, "multivalue", seed, a),
                    _result("reuse", 0.0, "multivalue", seed, b)]
    results.append(_result("cacheclip", 0.2, "multivalue", 9, 1.0))  # no reuse run on seed 9: not paired
    rows = needle.summarize(results)
    clip = next(r for r in rows if r["label"] == "cacheclip@0.2")
    assert clip["wins_losses_vs_reuse"] == (2, 1) and clip["samples"] == 5
    pairs = {p["other"]: p for p in needle.versus(results, rows, "cacheclip@0.2")}
    assert pairs["reuse"]["samples"] == 4 and pairs["reuse"]["diff"] == pytest.approx(0.25)
    assert pairs["reuse"]["wins_losses"] == (2, 1) and pairs["full"]["wins_losses"] == (0, 1)
    lo, hi = pairs["reuse"]["diff_ci95"]
    assert lo < 0.25 < hi
    assert "[" in needle.versus_table(list(pairs.values())) and "95% CI" in needle.table(rows)
    with pytest.raises(ValueError, match="no bench row is labelled 'oracle@0.2'"):
        needle.versus(results, rows, "oracle@0.2")


def test_percent_of_full_compares_the_samples_a_row_ran():
    results = [_result("full", 1.0, "multivalue", 0, 1.0), _result("full", 1.0, "single_1", 0, 0.0),
               _result("reuse", 0.0, "multivalue", 0, 0.5)]  # reuse ran one of full's two samples
    rows = {r["label"]: r for r in needle.summarize(results)}
    assert rows["full"]["pct_of_full"] == pytest.approx(100.0)
    assert rows["reuse"]["pct_of_full"] == pytest.approx(50.0)  # against full's 1.0 there, not its 0.5 average


def test_load_pools_runs_and_refuses_a_sample_counted_twice(tmp_path):
    run_a = [_result("full", 1.0, "multivalue", 0, 1.0), _result("reuse", 0.0, "multivalue", 0, 0.0)]
    run_b = [_result("full", 1.0, "multivalue", 0, 1.0), _result("cacheclip", 0.2, "multivalue", 0, 1.0)]
    for name, run in (("a.json", run_a), ("b.json", run_b)):
        needle.write_json(run, needle.summarize(run), tmp_path / name)
    pooled = needle.load([tmp_path / "a.json", tmp_path / "b.json"])
    assert sorted(r.mode for r in pooled) == ["cacheclip", "full", "reuse"]  # the shared full answer kept once
    run_c = [_result("reuse", 0.0, "multivalue", 0, 1.0, answer="other")]
    needle.write_json(run_c, needle.summarize(run_c), tmp_path / "c.json")
    with pytest.raises(ValueError, match=r"c.json: sample .* is also in .*a.json with another answer"):
        needle.load([tmp_path / "a.json", tmp_path / "c.json"])
    tagged = needle.load([tmp_path / "a.json", f"tuned={tmp_path / 'b.json'}"])
    rows = {r["label"]: r for r in needle.summarize(tagged)}
    assert set(rows) == {"full", "reuse", "tuned/full", "tuned/cacheclip@0.2"}
    assert rows["tuned/cacheclip@0.2"]["pct_of_full"] == pytest.approx(100.0)  # against the untagged full
    with pytest.raises(ValueError, match="a tag is a name without"):
        needle.load([f"a/b={tmp_path / 'b.json'}"])
    (tmp_path / "d.json").write_text('{"summary": []}')
    with pytest.raises(ValueError, match="d.json: not a needle bench JSON"):
        needle.load([tmp_path / "d.json"])


@pytest.fixture(scope="module")
def eng(tiny_pair, tmp_path_factory):
    cfg = EngineConfig(chunk=ChunkConfig(chunk_tokens=48, overlap_tokens=0))
    return CacheClipEngine(*tiny_pair, tmp_path_factory.mktemp("eval"), cfg)


def test_miniature_needle_bench_with_plots(eng, tmp_path):
    modes = [("reuse", 0.0), ("ape", 0.0), ("cacheblend", 0.3), ("epic", 0.3), ("random", 0.3), ("cacheclip", 0.3), ("cacheclip", 0.6)]
    results = needle.run(eng, modes, Suite(lengths=[150], variants=["single_2", "multivalue"], samples=2), max_new_tokens=3)
    rows = needle.summarize(results)
    assert {r["label"] for r in rows} >= {"full", "reuse", "ape", "cacheblend@0.3", "cacheclip@0.6"}
    assert "W/L vs reuse" in needle.table(rows)
    needle.write_json(results, rows, tmp_path / "n.json")
    assert len(json.loads((tmp_path / "n.json").read_text())["samples"]) == 2 * 2 * 8
    plots.quality_vs_ratio(rows, tmp_path / "q.png")
    plots.ttft_breakdown(rows, tmp_path / "t.png")
    for name in ("q.png", "t.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"


def test_miniature_fidelity_bench_and_its_oracles(eng, tmp_path):
    modes = [("reuse", 0.0), ("random", 0.5), ("cacheclip", 0.5), ("oracle", 0.5), ("cacheclip", 1.0)]
    results = fidelity.run(eng, modes, Suite(lengths=[150], variants=["multivalue"], samples=2), answer_tokens=4)
    assert len(results) == 2 * len(modes)
    for r in results:
        if r.ratio == 1.0:  # every chunk row recomputed: the full prefill itself
            assert r.kl == pytest.approx(0.0, abs=1e-5) and r.exact and r.effective_fraction == 1.0
    assert any(r.kl > 0 for r in results if r.mode == "reuse")
    rows = fidelity.summarize(results)
    assert rows[0]["label"] == "cacheclip@1" and "top-1 agree" in fidelity.table(rows)
    lo, hi = rows[-1]["kl_ci95"]
    assert lo <= rows[-1]["kl"] <= hi
    pairs = needle.versus(results, rows, "cacheclip@0.5", metric="kl")
    assert {p["other"] for p in pairs} == {r["label"] for r in rows} - {"cacheclip@0.5"}
    assert "cacheclip@1" in needle.versus_table(pairs, scale=1, digits=4)
    at_one = next(p for p in pairs if p["other"] == "cacheclip@1")
    assert at_one["diff"] >= 0 and at_one["wins_losses"][1] == 0  # nothing is closer to full than full itself
    fidelity.write_json(results, rows, tmp_path / "f.json", pairs)
    assert len(json.loads((tmp_path / "f.json").read_text())["samples"]) == len(results)
    with pytest.raises(ValueError, match=r"\['cacheblend'\] have none to replay"):
        fidelity.run(eng, [("cacheblend", 0.2)], Suite(lengths=[150], variants=["multivalue"], samples=1))


def test_reused_cache_deviates_only_after_the_first_chunk(eng):
    sample = niah.generate("multivalue", 150, 0, eng.primary.lm.tokenizer)
    ids = eng.ingest([sample.context], progress=False)
    ref = fidelity_lib.reference(eng, sample.question, ids, 4)
    k, v = deviation.kv_deviation(eng, ref)
    segments = ref.layout.chunk_segments()
    assert len(segments) >= 2 and k.shape == v.shape == (eng.primary.lm.num_layers, ref.layout.chunk_rows().numel())
    first = segments[0].end - segments[0].start
    # The first chunk follows the prefix in both caches: rounding only. Layer 0 sees no context at all.
    assert k[:, :first].max() < 1e-2 and v[:, :first].max() < 1e-2
    assert k[0].max() < 1e-2 and v[0].max() < 1e-2
    assert v[1:, first:].mean() > 10 * v[1:, :first].mean()


def test_deviation_bench_on_tiny_models(eng, tmp_path):
    deviations, results = deviation.run(eng, [0.3], Suite(lengths=[150], variants=["multivalue"], samples=2), answer_tokens=4,
                                        modes=["prophetkv"])
    assert len(deviations) == 2 and {r.mode for r in results} == {"deviation", "deviation-L1", "oracle", "prophetkv"}
    assert all(r.effective_fraction == pytest.approx(0.3, abs=0.02) for r in results)
    assert all(0.3 <= d.top_share[0.3] <= 1.0 for d in deviations)
    # The deviation criterion's own rows hold the most deviation any 30% of rows can: top_share.
    for d in deviations:
        assert set(d.held) == {"deviation@0.3", "deviation-L1@0.3", "oracle@0.3*", "prophetkv@0.3"}
        assert d.held["deviation@0.3"] == pytest.approx(d.top_share[0.3])
        assert all(0.0 <= share <= d.top_share[0.3] + 1e-6 for share in d.held.values())
    assert "V later" in deviation.layer_table(deviations) and "hold" in deviation.concentration(deviations)
    assert "prophetkv@0.3" in deviation.held_table(deviations)
    rows = fidelity.summarize(results)
    deviation.write_json(deviations, results, rows, tmp_path / "d.json")
    assert len(json.loads((tmp_path / "d.json").read_text())["deviation"]) == 2
    with pytest.raises(ValueError, match="strictly between 0 and 1"):
        deviation.run(eng, [1.0], Suite(lengths=[150], variants=["multivalue"], samples=1))
    with pytest.raises(ValueError, match="strictly between 0 and 1"):
        deviation.run(eng, ["auto"], Suite(lengths=[150], variants=["multivalue"], samples=1))
    with pytest.raises(ValueError, match="plain caches"):
        deviation.run(eng, [0.2], Suite(lengths=[150], variants=["multivalue"], samples=1), packets=True, modes=["cacheclip"])


def test_top_rows_and_their_share():
    rows = torch.arange(10, 20)
    scores = torch.tensor([0.0, 5, 1, 4, 0, 0, 3, 0, 0, 2])
    assert deviation.top_rows(rows, scores, 0.3).tolist() == [11, 13, 16]
    assert deviation.top_share(torch.ones(10), 0.2) == pytest.approx(0.2)
    assert deviation.top_share(scores, 0.2) == pytest.approx(9 / 15)


def test_miniature_qa_and_ttft_runs(eng, tmp_path):
    examples = qa_data.load(qa_data.Path(qa_data.__file__).parent.parent / "data" / "qa_invented.jsonl").examples[:2]
    rows = qa.summarize(qa.run(eng, examples, [("reuse", 0.0), ("cacheclip", 0.5)], max_new_tokens=3))
    assert [r["mode"] for r in rows] == ["full", "cacheclip", "reuse"]
    assert "F1 %full" in qa.table(rows)
    steps: list[str] = []
    trows = ttft.run(eng, [120], [("reuse", 0.0), ("cacheclip", 0.2)], runs=2, max_new_tokens=2, progress=steps.append)
    assert [r.mode for r in trows] == ["full", "reuse", "cacheclip"] and trows[0].vs_full == 1.0
    assert len(steps) == ttft.requests([120], [("reuse", 0.0), ("cacheclip", 0.2)], runs=2) == 6
    assert steps[0].startswith("120 full: ")
    ttft.write_json(trows, tmp_path / "t.json", machine="AMD EPYC; 2 threads")
    written = json.loads((tmp_path / "t.json").read_text())
    assert frontier.ttft_machine(tmp_path / "t.json") == "AMD EPYC; 2 threads"
    assert frontier.load_ttft(tmp_path / "t.json")[(120, "cacheclip", 0.2)] == trows[2].vs_full
    assert [(r["mode"], r["ratio"]) for r in written] == [(r.mode, r.ratio) for r in trows]
    assert [r["ttft_median"] for r in written] == [r.ttft_median for r in trows] and written[0]["vs_full"] == 1.0


def test_miniature_alignment(tiny_pair):
    primary, aux = tiny_pair
    # A model paired with itself is its own aux: its peaks are the primary's, at KL 0.
    same = alignment.run(primary, primary, lengths=[100], samples=1)[0]
    assert same.jaccard_aux_last == 1.0 and same.kl_aux_last == pytest.approx(0.0, abs=1e-9)
    # The pair's figures are the overlap of the two models' own last-token attention.
    row = alignment.run(primary, aux, lengths=[100], samples=1, seed=7)[0]
    sample = niah.generate("multikey_1", 100, 7, primary.tokenizer)
    text = sample.context + "\n\nQuestion: " + sample.question + "\nAnswer:"
    pri, pri_off = alignment.last_token_attention(primary, text, [0, -1])
    aux_att, aux_off = alignment.last_token_attention(aux, text, [-1])
    n = len(sample.context)
    pri_last, aux_last = to_chars(pri[-1], pri_off, n), to_chars(aux_att[-1], aux_off, n)
    assert row.jaccard_aux_last == top_jaccard(aux_last, pri_last)
    assert row.kl_pri_first == alignment.kl(to_chars(pri[0], pri_off, n), pri_last) > 0
    assert "J(aux_last,pri_last)" in alignment.table([row])


def test_selection_page(eng, tmp_path):
    ids = eng.ingest(CORPUS, progress=False)
    stream = eng.stream("what is the code?", chunk_ids=ids[:3], recompute_ratio=0.5, max_new_tokens=2)
    list(stream)
    assert len(stream.trace) == 3
    html.write(tmp_path / "sel.html", "what is the code?", stream.answer, stream.trace)
    page = (tmp_path / "sel.html").read_text()
    assert "CacheClip selection" in page and "underline" in page and "rgba(255,140,0," in page


def test_needle_bench_reports_overlap_with_the_oracle(eng):
    results = needle.run(eng, [("cacheclip", 0.5), ("oracle", 0.5), (needle.PAPER_MODE, 0.5)],
                         Suite([150], ["single_2"], samples=1), max_new_tokens=2, budget="keep")
    by_mode = {r.mode: r for r in results}
    # The paper's configuration beside the engine's: the paper rule never recomputes more than
    # asked (grouping only drops candidates; on a tiny random model it may drop none).
    assert by_mode[needle.PAPER_MODE].effective_fraction <= by_mode["cacheclip"].effective_fraction
    assert abs(by_mode["cacheclip"].effective_fraction - 0.5) <= 8 / by_mode["cacheclip"].prompt_tokens + 0.05
    assert by_mode["oracle"].oracle_overlap == 1.0
    # cacheclip's overlap is the Jaccard index of its chunk rows and the oracle's on that sample
    (_, _, seed, sample, ids), = needle.suite(eng, Suite([150], ["single_2"], 1, 0))
    chunk_rows = set(eng.prepare(sample.question, ids).layout.chunk_rows().tolist())
    rows = {m: set(eng.answer(sample.question, chunk_ids=ids, recompute_ratio=0.5, max_new_tokens=2, seed=seed,
                              **needle.request_for(m, "keep")).recomputed) & chunk_rows for m in ("cacheclip", "oracle")}
    expected = len(rows["cacheclip"] & rows["oracle"]) / len(rows["cacheclip"] | rows["oracle"])
    assert by_mode["cacheclip"].oracle_overlap == pytest.approx(expected)
    assert math.isnan(by_mode["full"].oracle_overlap)  # no oracle run at full's ratio


def test_bench_cacheclip_variants_set_their_request_options():
    from cacheclip_bench.needle import request_for

    assert request_for("cacheclip-joint", "keep") == dict(mode="cacheclip", budget="keep", aux_context="joint")
    assert request_for("cacheclip-chunk", "keep") == dict(mode="cacheclip", budget="keep", aux_context="chunk")
    assert request_for("cacheclip-paper", "keep") == dict(mode="cacheclip", budget="paper", score_layers=(-1,))
    assert request_for("prophetkv", "keep") == dict(mode="prophetkv", budget="keep")


def test_a_resumed_needle_run_measures_only_what_its_journal_lacks(eng, tmp_path):
    from cacheclip_bench.journal import Journal

    modes = [("reuse", 0.0), ("cacheclip", 0.3)]
    kw = dict(max_new_tokens=3)
    whole = needle.run(eng, modes, Suite([150], ["single_2"], samples=2), **kw)
    first = Journal(tmp_path / "n.jsonl", {"primary": "tiny"})
    needle.run(eng, modes, Suite([150], ["single_2"], samples=1), journal=first, **kw)  # stopped after one sample
    assert len(first.rows) == 3
    steps = []
    resumed = needle.run(eng, modes, Suite([150], ["single_2"], samples=2), journal=Journal(tmp_path / "n.jsonl", {"primary": "tiny"}),
                         progress=steps.append, **kw)
    assert steps[0].endswith("(measured before)") and len(Journal(tmp_path / "n.jsonl", {"primary": "tiny"}).rows) == 6
    same = lambda rs: sorted((r.seed, r.mode, r.ratio, r.answer, r.score) for r in rs)  # noqa: E731
    assert same(resumed) == same(whole)
    scores = lambda rs: [(r["label"], r["avg"], r["avg_ci95"]) for r in needle.summarize(rs)]  # noqa: E731
    assert scores(resumed) == scores(whole)


def test_load_pools_a_results_journal_beside_a_saved_run(tmp_path):
    from dataclasses import asdict

    from cacheclip_bench.journal import Journal

    run_a = [_result("full", 1.0, "multivalue", 0, 1.0), _result("reuse", 0.0, "multivalue", 0, 0.0)]
    needle.write_json(run_a, needle.summarize(run_a), tmp_path / "a.json")
    journal = Journal(tmp_path / "b.jsonl", {"primary": "p"})
    for r in (_result("full", 1.0, "multivalue", 0, 1.0), _result("cacheclip", 0.4, "multivalue", 0, 1.0)):
        journal.append(asdict(r))
    pooled = needle.load([tmp_path / "a.json", tmp_path / "b.jsonl"])
    assert sorted((r.mode, r.ratio) for r in pooled) == [("cacheclip", 0.4), ("full", 1.0), ("reuse", 0.0)]
    with open(tmp_path / "b.jsonl", "a") as f:
        f.write('{"length": 20')  # a row cut off mid-write, as a killed run leaves it: left out, as a resume does
    assert len(needle.load([tmp_path / "a.json", tmp_path / "b.jsonl"])) == 3
