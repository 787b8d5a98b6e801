"""Label-free training requests for KV Packet adapters: a mix of three kinds.

The KV Packet paper found adapters trained on one domain do not transfer, so training mixes:

    needle    a RULER-style needle haystack (`niah.generate`, all eight variants in turn)
    twohop    invented linked facts spread over prose: the question needs two of them
    prose     plain prose documents with an open question about them (summary, comparison)
    notes     many short notes (one to three sentences each, each its own document, as a RAG
              store of snippets holds them): two linked facts among distractors, a two-hop question

`needle`, `twohop` and `prose` are cut into documents by token count; `notes` gives its documents.

Only the context and the question are made here; the teacher's answer is the frozen model's
own continuation (self-distillation), so no labels are needed. Names and places below are
invented and disjoint from the shipped QA file. Deterministic for (kind, length, seed).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from .haystack import prose
from .niah import VARIANTS, generate

KINDS = ("needle", "twohop", "prose")
"""The KV Packet adapters' mix (the shipped adapters were trained on it)."""
ALL_KINDS = (*KINDS, "notes")
"""Every kind `make_request` makes; the concatenation-aware LoRA trains on all of them (short
notes keep its answers over snippet stores from drifting)."""

_GIVEN = ["Arvid", "Bettina", "Corin", "Dalia", "Edvard", "Fenna", "Gideon", "Hester", "Ingmar", "Juno", "Kasimir",
          "Liesel", "Magnus", "Nerys", "Orla", "Pavel", "Runa", "Soren", "Thea", "Ulrik"]
_FAMILY = ["Ashgrove", "Bellweather", "Cinderby", "Duskmoor", "Elmstrand", "Foxhallow", "Greywater", "Hartlepool-Ines",
           "Ironwood", "Juniperley", "Kestrelmann", "Larkspur"]
_TOWNS = ["Brambleford", "Coldharbour Quay", "Emberlyn", "Frostwick", "Glimmerdale", "Havenmouth", "Isenholt",
          "Juniper Falls", "Kilnstead", "Mirewatch", "Northbright", "Oakenreach"]
_REGIONS = ["the Fernlands", "High Carrow", "Westmarch", "the Tidewater", "Greymantle", "Sunderhold", "the Reedmoor", "Pellwick"]
_CRAFTS = ["clockmaker", "lighthouse keeper", "bookbinder", "ferry captain", "glacier surveyor", "organ tuner",
           "rope maker", "seed archivist"]
_FILLER = ["{who} keeps a small garden behind the house.", "{who} once crossed {region} on foot.",
           "{who} collects old maps of {town}.", "{who} rarely travels in winter.",
           "The market in {town} is held every Thursday.", "{town} has a narrow stone bridge over its river.",
           "Most houses in {town} have red roofs.", "The road to {town} floods every spring."]
_OPEN = ["Summarize the documents above in one sentence.", "Which people or places appear in more than one document?",
         "What happens in the last document?", "List three objects that the documents mention.",
         "Describe the first document briefly."]


@dataclass(frozen=True)
class TrainRequest:
    """A context (to be cut into packets by token count) and the question asked after it."""

    kind: str
    context: str
    question: str
    documents: tuple[str, ...] = ()
    """Given documents (`notes`); empty: the context is cut by token count."""


def _pad_with_prose(rng: random.Random, tokenizer, facts: list[str], length: int) -> str:
    """Prose of about `length` tokens with each fact placed once at a random sentence boundary."""
    sentences: list[str] = []
    budget = length - sum(len(tokenizer(f, add_special_tokens=False)["input_ids"]) for f in facts)
    while len(tokenizer(" ".join(sentences), add_special_tokens=False)["input_ids"]) < budget:
        sentences.append(prose(rng, 1))
    for fact in facts:
        sentences.insert(rng.randint(0, len(sentences)), fact)
    return " ".join(sentences)


def _twohop_facts(rng: random.Random) -> tuple[list[str], str]:
    """Four invented facts, two of which answer the returned two-hop question."""
    people = rng.sample([f"{g} {f}" for g in _GIVEN for f in _FAMILY], 4)
    towns, regions, crafts = rng.sample(_TOWNS, 2), rng.sample(_REGIONS, 2), rng.sample(_CRAFTS, 2)
    if rng.random() < 0.5:
        facts = [f"{people[0]} grew up in {towns[0]}.", f"{towns[0]} lies in the region of {regions[0]}.",
                 f"{people[1]} grew up in {towns[1]}.", f"{towns[1]} lies in the region of {regions[1]}."]
        return facts, f"In which region did {people[0]} grow up?"
    facts = [f"{people[0]} is the sibling of {people[2]}.", f"{people[2]} works as a {crafts[0]}.",
             f"{people[1]} is the sibling of {people[3]}.", f"{people[3]} works as a {crafts[1]}."]
    return facts, f"What is the profession of the sibling of {people[0]}?"


def _twohop(rng: random.Random, tokenizer, length: int) -> TrainRequest:
    facts, question = _twohop_facts(rng)
    return TrainRequest("twohop", _pad_with_prose(rng, tokenizer, facts, length), question)


def _notes(rng: random.Random, tokenizer, length: int) -> TrainRequest:
    """Short notes (titled "Note i") of about `length` tokens in all: the four facts of a two-hop
    question, each in a note of its own, among notes of filler sentences, shuffled."""
    facts, question = _twohop_facts(rng)
    notes = list(facts)
    used = sum(len(tokenizer(n, add_special_tokens=False)["input_ids"]) for n in notes)
    while used < length:
        who = f"{rng.choice(_GIVEN)} {rng.choice(_FAMILY)}"
        note = " ".join(rng.choice(_FILLER).format(who=who, town=rng.choice(_TOWNS), region=rng.choice(_REGIONS))
                        for _ in range(rng.randint(1, 3)))
        notes.append(note)
        used += len(tokenizer(note, add_special_tokens=False)["input_ids"]) + 4
    rng.shuffle(notes)
    docs = tuple(f"Note {i}\n{text}" for i, text in enumerate(notes, 1))
    return TrainRequest("notes", "\n\n".join(docs), question, docs)


def make_request(kind: str, length: int, seed: int, tokenizer) -> TrainRequest:
    """One training request of `kind` with a context of about `length` tokens."""
    if kind not in ALL_KINDS:
        raise ValueError(f"training kind must be one of {ALL_KINDS}, got {kind!r}")
    rng = random.Random(seed)
    if kind == "needle":
        sample = generate(VARIANTS[seed % len(VARIANTS)], length, seed, tokenizer)
        return TrainRequest(kind, sample.context, sample.question)
    if kind == "twohop":
        return _twohop(rng, tokenizer, length)
    if kind == "notes":
        return _notes(rng, tokenizer, length)
    return TrainRequest(kind, _pad_with_prose(rng, tokenizer, [], length), rng.choice(_OPEN))
