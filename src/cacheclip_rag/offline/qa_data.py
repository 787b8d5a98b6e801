"""QA datasets in the formats users have, each with the prompt its own harness uses.

Three formats, told apart by their fields (or named with `format=`):

- `cacheblend`: CacheBlend's `inputs/musique_s.json` and `wikimqa_s.json` (public repository
  YaoJiayi/CacheBlend; no licence, so not shipped): one JSON array of
  `{"question": str, "answers": [str], "ctxs": [{"title": str, "text": str}]}`.
- `longbench`: LongBench's multi-document QA (`2wikimqa.jsonl`, `hotpotqa.jsonl`,
  `musique.jsonl`): JSON Lines of `{"input": str, "context": str, "answers": [str], ...}`, the
  context one string of "Passage N:" blocks.
- `jsonl`: this project's own, JSON Lines of
  `{"question": str, "contexts": [str | {"title", "text"}], "answers": [str]}`.

Passages become chunks in their order, one chunk each. Each format carries its harness's
instruction as a `PromptConfig` (the system prompt is the shared prefix every chunk cache is
computed after; the question template closes the user turn), so that F1 measures the answer and
not its phrasing: CacheBlend's harness asks for the answer directly, within five words
(`example/blend_musique.py`), LongBench's asks for only the answer (its `dataset2prompt`, one
prompt shared by these three datasets). The instruction texts below restate those harnesses'.

A malformed file is a ValueError naming the file, the line and the field.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from ..config import PromptConfig
from ..paths import read_user_text

FORMATS = ("auto", "cacheblend", "longbench", "jsonl")

CACHEBLEND_PROMPT = PromptConfig(
    system_prompt=("You will be asked a question after reading several passages. Please directly answer the question "
                   "based on the given passages. Do NOT repeat the question. The answer should be within 5 words."),
    question_template=("\n\nAnswer the question directly based on the given passages. Do NOT repeat the question. "
                       "The answer should be within 5 words.\nQuestion: {question}\nAnswer:"),
)
"""CacheBlend's musique / 2wikimqa harness: its prefix instruction and its query instruction."""

LONGBENCH_PROMPT = PromptConfig(
    system_prompt=("Answer the question based on the given passages. Only give me the answer and do not output any "
                   "other words.\n\nThe following are given passages."),
    question_template=("\n\nAnswer the question based on the given passages. Only give me the answer and do not "
                       "output any other words.\n\nQuestion: {question}\nAnswer:"),
)
"""LongBench's prompt for hotpotqa, 2wikimqa and musique (one template for the three)."""

_PASSAGE = re.compile(r"^Passage \d+:\n", re.MULTILINE)


@dataclass(frozen=True)
class QAExample:
    question: str
    contexts: list[dict]
    """The passages in order, as documents: {"text"} or {"title", "text"}."""
    answers: list[str]
    id: str = ""


@dataclass(frozen=True)
class QADataset:
    path: str
    format: str
    examples: list[QAExample]
    prompt: PromptConfig
    """The instruction of the format's own harness (the project's `jsonl` keeps the engine's)."""


def load(path: str | Path, format: str = "auto") -> QADataset:
    """Read and validate a QA file; `format` one of FORMATS ("auto": told by the fields)."""
    if format not in FORMATS:
        raise ValueError(f"format must be one of {list(FORMATS)}, got {format!r}")
    path = Path(path)
    text = read_user_text(path, "dataset")
    items = _json_array(path, text) if text.lstrip().startswith("[") else _json_lines(path, text)
    if not items:
        raise ValueError(f"dataset {path} holds no examples")
    if format == "auto":
        format = _detect(path, *items[0])
    parse = {"cacheblend": _cacheblend, "longbench": _longbench, "jsonl": _own}[format]
    examples = [parse(f"{path}:{line}", obj) for line, obj in items]
    prompt = {"cacheblend": CACHEBLEND_PROMPT, "longbench": LONGBENCH_PROMPT, "jsonl": PromptConfig()}[format]
    return QADataset(str(path), format, examples, prompt)


def _json_lines(path: Path, text: str) -> list[tuple[int, object]]:
    items = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                items.append((n, json.loads(line)))
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{n}: not JSON ({err.msg})") from None
    return items


def _json_array(path: Path, text: str) -> list[tuple[int, object]]:
    """The items of one JSON array with the line each starts on (so errors can name it)."""
    decoder, items = json.JSONDecoder(), []
    at = text.index("[") + 1
    while True:
        at = _skip_space(text, at)
        if at < len(text) and text[at] == "]":
            break
        try:
            obj, end = decoder.raw_decode(text, at)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{err.lineno}: not JSON ({err.msg})") from None
        items.append((text.count("\n", 0, at) + 1, obj))
        at = _skip_space(text, end)
        if at < len(text) and text[at] == ",":
            at += 1
        elif at >= len(text) or text[at] != "]":
            raise ValueError(f"{path}:{text.count(chr(10), 0, at) + 1}: not JSON (expected ',' or ']')")
    return items


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at] in " \t\r\n":
        at += 1
    return at


def _detect(path: Path, line: int, obj: object) -> str:
    if isinstance(obj, dict):
        if "ctxs" in obj:
            return "cacheblend"
        if "context" in obj and "input" in obj:
            return "longbench"
        if "contexts" in obj:
            return "jsonl"
    raise ValueError(f"{path}:{line}: cannot tell the format: expected CacheBlend's 'ctxs', LongBench's 'context' and "
                     f"'input', or 'contexts' (this project's); name it with --format")


def _object(where: str, obj: object, fields: str) -> dict:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected an object with {fields}, got {type(obj).__name__}")
    return obj


def _string(where: str, obj: dict, field: str) -> str:
    value = obj.get(field)
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{where}: {field!r} must be a non-empty string, got {value!r}"[:300])
    return value


def _answers(where: str, obj: dict) -> list[str]:
    answers = obj.get("answers")
    if not isinstance(answers, list) or not answers or not all(isinstance(a, str) and a.strip() for a in answers):
        raise ValueError(f"{where}: 'answers' must be a non-empty list of non-empty strings, got {answers!r}"[:300])
    return answers


def _passage(where: str, field: str, c: object) -> dict:
    if isinstance(c, str) and c.strip():
        return {"text": c}
    if isinstance(c, dict) and isinstance(c.get("text"), str) and c["text"].strip():
        title = c.get("title") or ""
        if not isinstance(title, str):
            raise ValueError(f"{where}: {field} titles must be strings, got {title!r}"[:300])
        return {"title": title, "text": c["text"]} if title.strip() else {"text": c["text"]}
    raise ValueError(f"{where}: each of {field!r} must be a non-empty string or {{title, text}}, got {c!r}"[:300])


def _passages(where: str, obj: dict, field: str) -> list[dict]:
    items = obj.get(field)
    if not isinstance(items, list) or not items:
        raise ValueError(f"{where}: {field!r} must be a non-empty list of passages, got {items!r}"[:300])
    return [_passage(where, field, c) for c in items]


def _cacheblend(where: str, obj: object) -> QAExample:
    obj = _object(where, obj, "question, answers, ctxs")
    return QAExample(_string(where, obj, "question"), _passages(where, obj, "ctxs"), _answers(where, obj),
                     str(obj.get("id", "")))


def _own(where: str, obj: object) -> QAExample:
    obj = _object(where, obj, "question, contexts, answers")
    return QAExample(_string(where, obj, "question"), _passages(where, obj, "contexts"), _answers(where, obj),
                     str(obj.get("id", "")))


def _longbench(where: str, obj: object) -> QAExample:
    obj = _object(where, obj, "input, context, answers")
    context = _string(where, obj, "context")
    blocks = [b.strip() for b in _PASSAGE.split(context) if b.strip()]
    return QAExample(_string(where, obj, "input"), [{"text": b} for b in blocks], _answers(where, obj),
                     str(obj.get("_id", "")))
