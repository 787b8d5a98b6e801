"""Request building: the one validation of per-request options, and the prompt pieces."""

import pytest

from cacheclip_rag import PromptConfig, RequestOptions
from cacheclip_rag.request.options import (
    REQUEST_OPTIONS,
    prompt_pieces,
    question_pieces,
    request_options,
)


def test_options_are_normalized():
    opts = RequestOptions.parse(recompute_ratio=1, stop="END", score_layers=3)
    assert opts.recompute_ratio == 1.0 and isinstance(opts.recompute_ratio, float)
    assert opts.stop == ("END",) and opts.score_layers == (3,)
    assert opts.decode_options().stop == ("END",)
    assert RequestOptions.parse() == RequestOptions()


@pytest.mark.parametrize("bad, message", [
    (dict(recompute_ratio=float("nan")), "recompute_ratio must be in"),
    (dict(mode=""), "mode must be a mode name"),
    (dict(budget="some"), "budget"),
    (dict(max_new_tokens=0), "max_new_tokens must be"),
    (dict(temperature=-1), "temperature must be"),
    (dict(stop=[""]), "stop must be"),
    (dict(epic_tokens=-2), "epic_tokens must be"),
    (dict(seed=True), "seed must be an integer"),
    (dict(score_layers=[]), "score_layers must be a non-empty list"),
    (dict(score_layers=["1"]), "score_layers must be a non-empty list"),
    (dict(aux_context="all"), r"aux_context must be one of \['chunk', 'joint'\], got 'all'"),
    (dict(recompute_ratoi=0.1), r"unknown request options \['recompute_ratoi'\]"),
])
def test_bad_options_name_what_was_given(bad, message):
    with pytest.raises(ValueError, match=message):
        RequestOptions.parse(**bad)


def test_adapter_option_names_cover_every_request_option():
    assert set(REQUEST_OPTIONS) == {"chunk_ids", "k"} | set(RequestOptions.__dataclass_fields__)
    assert request_options({"mode": "reuse"}, {"k": 2}) == {"mode": "reuse", "k": 2}
    with pytest.raises(ValueError, match="unknown options"):
        request_options({}, {"ratio": 0.1})


def test_question_pieces_frame_chunks_in_order():
    cfg = PromptConfig()
    pieces, query = question_pieces("why?", [("c1", "one"), ("c2", "two")], cfg)
    assert [cid for _, cid in pieces] == ["c1", None, "c2", None]
    assert pieces[1][0] == cfg.separator and query == cfg.question_template.format(question="why?")
    with pytest.raises(ValueError, match="question must be a non-empty string"):
        question_pieces("  ", [("c1", "one")], cfg)


def test_prompt_pieces_split_around_found_chunks():
    prompt = "Context: AAA and BBB\nQuestion: q?"
    found = [(9, 12, "a"), (17, 20, "b")]
    pieces, aux_query = prompt_pieces(prompt, found)
    assert "".join(text for text, _ in pieces) == prompt
    assert [cid for _, cid in pieces] == [None, "a", None, "b", None]
    assert aux_query == "\nQuestion: q?"
    pieces, aux_query = prompt_pieces("AAA", [(0, 3, "a")])
    assert pieces[-1] == ("\n", None) and aux_query == "\n"  # nothing after the chunk: a newline row


def test_every_way_in_takes_the_options_from_their_one_declaration():
    """The HTTP body, the framework LLM fields and the `cacheclip ask` flags: every
    `RequestOptions` field, with its one default."""
    import dataclasses
    import inspect

    from cacheclip_rag.cli import parser
    from cacheclip_rag.cli.common import request_options as cli_options
    from cacheclip_rag.request.options import DEFAULTS
    from cacheclip_rag.serving import frameworks, schemas, server

    names = [f.name for f in dataclasses.fields(RequestOptions)]
    body = schemas.Options.model_fields
    for name in names:
        assert name in body or all(n in body for n in schemas.OPENAI_FIELDS[name]), name
    assert schemas.Options().request_options(DEFAULTS.max_new_tokens) == {"max_new_tokens": DEFAULTS.max_new_tokens,
                                                                          "temperature": DEFAULTS.temperature}
    assert inspect.signature(server.create_app).parameters["default_max_tokens"].default == DEFAULTS.max_new_tokens
    fields = frameworks.EngineLLMFields.model_fields
    assert all(fields[name].default == getattr(DEFAULTS, name) for name in frameworks.INSTANCE_OPTIONS)
    args = parser().parse_args(["ask", "why?"])
    assert cli_options(args) == dataclasses.asdict(DEFAULTS)
    assert args.max_new_tokens == parser().parse_args(["serve"]).max_tokens == DEFAULTS.max_new_tokens
    given = parser().parse_args(["ask", "why?", "--ratio", "0.5", "--stop", "A", "B", "--score-layers", "1", "2",
                                 "--budget", "paper", "--aux-context", "joint", "--epic-tokens", "3"])
    opts = RequestOptions.parse(**cli_options(given))
    assert (opts.recompute_ratio, opts.stop, opts.score_layers, opts.budget, opts.aux_context, opts.epic_tokens) == \
        (0.5, ("A", "B"), (1, 2), "paper", "joint", 3)
