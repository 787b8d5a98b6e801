"""Deterministic synthetic long contexts: varied prose with planted facts (no download)."""

from __future__ import annotations

import random

_SUBJECTS = ["the harbour master", "a retired pilot", "the night baker", "our neighbour", "the young engineer",
             "a travelling botanist", "the librarian", "an old sailor", "the mayor's assistant", "a violin maker"]
_VERBS = ["repaired", "painted", "measured", "photographed", "described", "carried", "sold", "studied", "ignored", "borrowed"]
_OBJECTS = ["a copper kettle", "the north lighthouse", "seven wooden crates", "a map of the islands", "the town clock",
            "a bundle of letters", "the broken radio", "a basket of plums", "the ferry timetable", "a brass telescope"]
_PLACES = ["near the market", "before sunrise", "on the windy pier", "behind the chapel", "during the storm",
           "in the quiet library", "after the festival", "beside the canal", "under the old bridge", "at the train station"]
_CODAS = ["Nobody remembered why.", "It took most of the afternoon.", "The rain kept falling.",
          "Children watched from the windows.", "A dog barked twice.", "The tea went cold.", "Gulls circled overhead."]


def prose(rng: random.Random, n_sentences: int) -> str:
    """Grammatical filler sentences, varied enough that chunks do not repeat."""
    out = []
    for _ in range(n_sentences):
        s = f"{rng.choice(_SUBJECTS).capitalize()} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_PLACES)}."
        if rng.random() < 0.3:
            s += " " + rng.choice(_CODAS)
        out.append(s)
    return " ".join(out)


def needle_context(tokenizer, n_tokens: int, seed: int, key: str = "", value: str = "") -> tuple[str, str, str]:
    """A context of about n_tokens (primary tokenizer) with one planted fact at a seeded depth.

    Returns (context, question, expected answer).
    """
    rng = random.Random(seed)
    key = key or f"{rng.choice(['amber', 'cobalt', 'willow', 'granite', 'saffron'])}-{rng.randint(100, 999)}"
    value = value or str(rng.randint(1_000_000, 9_999_999))
    sentences: list[str] = []
    while len(tokenizer(" ".join(sentences), add_special_tokens=False)["input_ids"]) < n_tokens:
        sentences.append(prose(rng, 1))
    depth = rng.randint(1, max(1, len(sentences) - 1))
    sentences.insert(depth, f"The special magic number for {key} is {value}.")
    question = f"What is the special magic number for {key}?"
    return " ".join(sentences), question, value
