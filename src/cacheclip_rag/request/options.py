"""One request, built and validated before anything runs: its options and its prompt pieces.

Every entry point (`answer`, `generate`, their streaming forms, the framework adapters) accepts
the same per-request options; `RequestOptions.parse` is the one place they are checked. A
request's prompt is a list of pieces, (text, chunk id) for a stored chunk and (text, None) for
text computed fresh (separators, the question, a framework's template); `question_pieces` and
`prompt_pieces` build it for the two ways a prompt arrives. The engine adds what needs its state
(retrieval, the store, the aux model's layer count) and runs the resulting `Request`.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields, replace


from ..config import (
    AUTO,
    AUX_CONTEXTS,
    BUDGETS,
    PromptConfig,
    SelectConfig,
    check_budget,
    check_ratio,
)
from .assemble import TEMPLATE
from .decode import DecodeOptions

Piece = tuple[str, "str | None"]
"""(text, chunk id) for a stored chunk's text, (text, None) for text computed for this request,
(text, TEMPLATE) for template text between a chat's turns (computed, special tokens parsed)."""


def ratio_arg(text: str) -> float | str:
    """A recompute ratio as the command line gives it: a number, or "auto" (range checked later,
    by `check_ratio`)."""
    if text == AUTO:
        return AUTO
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1] or 'auto', got {text!r}") from None


def _option(default, help: str, **cli):
    """A request option: its default, what it means, and how the command line takes it
    (argparse keywords; "flags" for the names, default --the-field-name)."""
    return field(default=default, metadata={"help": help, "cli": cli})


@dataclass(frozen=True)
class RequestOptions:
    """The per-request options every entry point accepts, validated: the one declaration of
    their names, defaults and meanings. The engine's keyword arguments, the HTTP body
    (`serving.schemas.Options`), the LangChain / LlamaIndex fields (`frameworks.EngineLLMFields`) and the
    `cacheclip ask` flags are derived from it (tests/request/test_request.py checks each).
    """

    mode: str = _option("cacheclip", "the KV method: a registered selector (`CacheClipEngine.modes()`)")
    recompute_ratio: float | str = _option(0.2, "share of the chunk tokens the primary recomputes, in [0, 1], or "
                                                "'auto': the selector decides per request (cacheclip)",
                                           flags=("--recompute-ratio", "--ratio"), type=ratio_arg)
    max_new_tokens: int = _option(128, "most tokens generated", type=int)
    temperature: float = _option(0.0, "sampling temperature; 0 is greedy", type=float)
    stop: tuple[str, ...] = _option((), "strings that end the text", nargs="+")
    epic_tokens: int | None = _option(None, "epic mode's tokens per chunk (default ceil(ratio x chunk length))", type=int)
    seed: int = _option(0, "seed of sampling and of the random mode", type=int)
    budget: str = _option("keep", "keep: candidates are added in score order until the grouped set reaches the "
                                  "ratio; paper: the top ratio x tokens are candidates, grouping keeps what it keeps",
                          choices=BUDGETS)
    score_layers: tuple[int, ...] | None = _option(None, "aux layers that score tokens (default: the config's, else "
                                                         "the calibrated profile's, else the last)", type=int, nargs="+")
    aux_context: str | None = _option(None, "what the aux query reads when it scores: chunk or joint "
                                            "(`SelectConfig.context`; default: the profile's)", choices=AUX_CONTEXTS)

    @classmethod
    def parse(cls, **options) -> RequestOptions:
        """Check and normalize options given by name; an unknown name is a ValueError."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown request options {unknown}; expected some of {sorted(known)}")
        stop = options.get("stop")
        options["stop"] = (stop,) if isinstance(stop, str) else tuple(stop or ())
        opts = cls(**options)
        opts.decode_options()  # checks max_new_tokens, temperature, stop
        epic = opts.epic_tokens
        if epic is not None and (not isinstance(epic, int) or isinstance(epic, bool) or epic < 0):
            raise ValueError(f"epic_tokens must be a non-negative integer or None, got {epic!r}")
        if opts.aux_context not in (*AUX_CONTEXTS, None):
            raise ValueError(f"aux_context must be one of {list(AUX_CONTEXTS)}, got {opts.aux_context!r}")
        if not isinstance(opts.seed, int) or isinstance(opts.seed, bool):
            raise ValueError(f"seed must be an integer, got {opts.seed!r}")
        if not isinstance(opts.mode, str) or not opts.mode:
            raise ValueError(f"mode must be a mode name (`CacheClipEngine.modes()`), got {opts.mode!r}")
        return replace(opts, recompute_ratio=check_ratio(opts.recompute_ratio),
                       budget=check_budget(opts.budget), score_layers=_layer_list(opts.score_layers))

    def decode_options(self) -> DecodeOptions:
        return DecodeOptions(max_new_tokens=self.max_new_tokens, temperature=self.temperature, stop=self.stop,
                             seed=self.seed)


def _layer_list(layers) -> tuple[int, ...] | None:
    """score_layers as a tuple of ints (the range is checked against the aux model by the engine)."""
    if layers is None:
        return None
    if isinstance(layers, int) and not isinstance(layers, bool):
        layers = (layers,)
    if not isinstance(layers, (list, tuple)) or not layers or any(not isinstance(x, int) or isinstance(x, bool) for x in layers):
        raise ValueError(f"score_layers must be a non-empty list of aux layer indices, got {layers!r}")
    return tuple(layers)


DEFAULTS = RequestOptions()
"""Every option at its default."""

REQUEST_OPTIONS = ("chunk_ids", "k", *(f.name for f in fields(RequestOptions)))
"""Per-request options every entry point (and every framework adapter) accepts: which chunks
(chunk_ids, or k to retrieve), then the `RequestOptions`."""


def request_options(defaults: dict, overrides: dict) -> dict:
    """Merge per-call overrides into an adapter's defaults; unknown options are a ValueError."""
    unknown = set(overrides) - set(REQUEST_OPTIONS)
    if unknown:
        raise ValueError(f"unknown options {sorted(unknown)}; expected some of {list(REQUEST_OPTIONS)}")
    return {**defaults, **overrides}


def check_text(value, what: str) -> str:
    """A question or prompt: a string with something besides whitespace."""
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{what} must be a non-empty string, got {value!r}")
    return value


def question_pieces(question: str, chunks: list[tuple[str, str]], prompt: PromptConfig) -> tuple[list[Piece], str]:
    """A question asked over chunks [(id, text)], in the engine's own prompt frame.

    Returns the pieces (`prompt.question_first` filled where set, the chunks in the given order,
    the separator between them, then the question template) and the aux query (the filled
    question template).
    """
    check_text(question, "question")
    pieces: list[Piece] = [(prompt.question_first.format(question=question), None)] if prompt.question_first else []
    for i, (cid, text) in enumerate(chunks):
        if i:
            pieces.append((prompt.separator, None))
        pieces.append((text, cid))
    query = prompt.question_template.format(question=question)
    pieces.append((query, None))
    return pieces, query


def content_pieces(text: str, found: list[tuple[int, int, str]]) -> tuple[list[Piece], str]:
    """User text cut at the stored chunk texts found in it [(start, end, chunk id)] (sorted,
    disjoint): the pieces up to the last chunk's end, and the text after it."""
    pieces: list[Piece] = []
    pos = 0
    for start, end, cid in found:
        if start > pos:
            pieces.append((text[pos:start], None))
        pieces.append((text[start:end], cid))
        pos = end
    return pieces, text[pos:]


def prompt_pieces(prompt: str, found: list[tuple[int, int, str]]) -> tuple[list[Piece], str]:
    """A finished prompt in which stored chunk texts were found at [(start, end, chunk id)] (sorted,
    disjoint). Returns the pieces and the aux query: the text after the last chunk when it has
    any, else all the text outside chunks."""
    pieces, tail = content_pieces(prompt, found)
    if not tail.strip():
        tail = tail or "\n"
    pieces.append((tail, None))
    uncached = "".join(text for text, cid in pieces if cid is None)
    return pieces, tail if tail.strip() else uncached


def chat_pieces(contents: list[str], glue: list[str], found: list[list[tuple[int, int, str]]]) -> tuple[list[Piece], str]:
    """A conversation (`encode.chat_frame`'s contents and glue) with the stored chunk texts
    found in each content. Returns the pieces and the aux query: the last message's text after
    its last chunk, else the whole last message."""
    pieces: list[Piece] = []
    for i, (content, hits) in enumerate(zip(contents, found)):
        if i:
            pieces.append((glue[i - 1], TEMPLATE))
        head, tail = content_pieces(content, hits)
        pieces.extend(head)
        if tail:
            pieces.append((tail, None))
    last, hits = contents[-1], found[-1]
    tail = last[hits[-1][1]:] if hits else last
    return pieces, tail if tail.strip() else last


@dataclass(frozen=True)
class Request:
    """What one call asks for, validated and frozen: the stages read it and never write it.

    ratio: the recompute ratio asked for, a number in [0, 1] or "auto" (the selector decides).
    chunk_ids / pieces: the stored chunks it reuses and the prompt as pieces (`Piece`).
    aux_query: the text whose aux attention rows score the chunks. select: the selection
    settings it runs with, every scoring field set (resolved once when it is prepared, from the
    profile calibrated nearest its length: `profile_source.ProfileSource.settings`).
    """

    mode: str
    ratio: float | str
    chunk_ids: tuple[str, ...]
    pieces: tuple[Piece, ...]
    aux_query: str
    options: DecodeOptions
    select: SelectConfig
    epic_tokens: int | None = None
    seed: int = 0
    budget: str = "keep"

    @classmethod
    def of(cls, opts: RequestOptions, select: SelectConfig, chunk_ids: list[str], pieces: list[Piece],
           aux_query: str) -> Request:
        return cls(mode=opts.mode, ratio=opts.recompute_ratio, chunk_ids=tuple(chunk_ids), pieces=tuple(pieces),
                   aux_query=aux_query, options=opts.decode_options(), select=select, epic_tokens=opts.epic_tokens,
                   seed=opts.seed, budget=opts.budget)
