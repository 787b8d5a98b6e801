"""The command line end to end on tiny models saved as local folders (any folder works as a model)."""

import json
import re

import pytest
from conftest import CORPUS

from cacheclip_rag.cli import main


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


def test_store_stats_names_the_shipped_profiles_of_an_embedded_pair():
    from cacheclip_rag.cli.stores import shipped_profile_lines

    pair = [{"role": "primary", "model": "qwen2.5-coder-1.5b-instruct"}, {"role": "aux", "model": "smollm2-135m-instruct"}]
    (line,) = shipped_profile_lines(pair)
    assert "qwen2.5-coder-1.5b-instruct + smollm2-135m-instruct scores with the package's profiles" in line
    assert "[2048, 4096]" in line
    assert "last layer" in shipped_profile_lines([{"role": "primary", "model": "my-model"}, pair[1]])[0]


def test_an_aux_folder_without_a_model_is_refused_naming_it(folders, tmp_path, capsys):
    empty = tmp_path / "no-model-here"
    empty.mkdir()
    args = ["--store", str(tmp_path / "s"), "--primary", folders[0], "--aux", str(empty)]
    assert main(["ask", "what is the code?", "--mode", "cacheclip-stale", *args]) == 2
    err = capsys.readouterr().err
    assert f"cannot load model {str(empty)!r}: the folder holds no config.json" in err and "a local model folder" in err
