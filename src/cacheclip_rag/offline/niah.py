"""RULER-style needle-in-a-haystack samples, generated here (no download).

Eight retrieval variants, after RULER (Hsieh et al., 2024):

    single_1      one needle, repeated-noise haystack, number value
    single_2      one needle, natural-text haystack, number value
    single_3      one needle, natural-text haystack, UUID value
    multikey_1    several needles with word keys, one asked; natural-text haystack
    multikey_2    the haystack itself is made of needles (word keys, number values)
    multikey_3    the haystack is made of needles with UUID keys and UUID values
    multivalue    one key with several values, all asked
    multiquery    several keys asked at once

The score of an answer is the fraction of expected values it contains (RULER's average
reference coverage). Samples are deterministic for (variant, length, seed).
"""

from __future__ import annotations

import random
import uuid
from dataclasses import dataclass, field

from .haystack import prose

VARIANTS = ("single_1", "single_2", "single_3", "multikey_1", "multikey_2", "multikey_3", "multivalue", "multiquery")

_NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
_ADJ = ["amber", "brisk", "cobalt", "dusty", "elder", "fuzzy", "gentle", "hollow", "ivory", "jolly", "keen",
        "lunar", "misty", "noble", "olive", "plain", "quiet", "rusty", "silent", "tidy", "urban", "vivid", "woven"]
_NOUN = ["anchor", "badger", "canyon", "dolphin", "ember", "falcon", "garden", "harbor", "island", "jacket",
         "kettle", "lantern", "meadow", "needle", "orchard", "pepper", "quarry", "river", "saddle", "tunnel"]
N_MULTI = 4  # needles asked in multivalue / multiquery, distractor needles in multikey_1


@dataclass
class NeedleSample:
    """One sample: the context (to be chunked), the question, the expected values."""

    variant: str
    length: int
    seed: int
    context: str
    question: str
    expected: list[str]
    needles: list[str] = field(default_factory=list)
    """The needle sentences, each exactly once in the context."""


def _uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _number(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def _word_key(rng: random.Random, taken: set[str]) -> str:
    while True:
        key = f"{rng.choice(_ADJ)}-{rng.choice(_NOUN)}"
        if key not in taken:
            taken.add(key)
            return key


def _needle(key: str, value: str, kind: str) -> str:
    return f"One of the special magic {kind} for {key} is: {value}."


def _n_tokens(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def _fill(tokenizer, n_tokens: int, make_sentence, reserved: str) -> list[str]:
    """Sentences until the haystack plus the reserved needles reach about n_tokens."""
    sentences: list[str] = []
    budget = n_tokens - _n_tokens(tokenizer, reserved)
    total = 0
    while total < budget:
        sentence = make_sentence()
        sentences.append(sentence)
        total += _n_tokens(tokenizer, " " + sentence)
    return sentences


def _place(rng: random.Random, sentences: list[str], needles: list[str]) -> list[str]:
    """Insert each needle at a seeded depth between sentences (never inside one)."""
    out = list(sentences)
    for needle in needles:
        out.insert(rng.randint(0, len(out)), needle)
    return out


def generate(variant: str, length: int, seed: int, tokenizer) -> NeedleSample:
    """One sample of `variant` with a context of about `length` tokens of `tokenizer`."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {list(VARIANTS)}, got {variant!r}")
    if not isinstance(length, int) or length < 64:
        raise ValueError(f"length must be an integer >= 64 tokens, got {length!r}")
    rng = random.Random(f"{variant}/{length}/{seed}")
    taken: set[str] = set()
    kind = "uuids" if variant in ("single_3", "multikey_3") else "numbers"
    value = _uuid if kind == "uuids" else _number

    if variant == "multikey_3":
        keys = [_uuid(rng) for _ in range(1)]
    else:
        keys = [_word_key(rng, taken) for _ in range(N_MULTI if variant == "multiquery" else 1)]
    values_per_key = N_MULTI if variant == "multivalue" else 1
    answers = {key: [value(rng) for _ in range(values_per_key)] for key in keys}
    needles = [_needle(key, v, kind) for key, vs in answers.items() for v in vs]

    distractors: list[str] = []
    if variant == "multikey_1":
        distractors = [_needle(_word_key(rng, taken), _number(rng), kind) for _ in range(N_MULTI - 1)]

    if variant == "single_1":
        make = lambda: _NOISE  # noqa: E731
    elif variant == "multikey_2":
        make = lambda: _needle(_word_key(rng, taken), _number(rng), kind)  # noqa: E731
    elif variant == "multikey_3":
        make = lambda: _needle(_uuid(rng), _uuid(rng), kind)  # noqa: E731
    else:
        make = lambda: prose(rng, 1)  # noqa: E731
    reserved = " ".join(needles + distractors)
    sentences = _place(rng, _fill(tokenizer, length, make, reserved), needles + distractors)
    context = " ".join(sentences)

    if variant == "multiquery":
        question = f"What are all the special magic {kind} for {', '.join(keys[:-1])} and {keys[-1]} mentioned in the provided text?"
    elif variant == "multivalue":
        question = f"What are all the special magic {kind} for {keys[0]} mentioned in the provided text?"
    else:
        question = f"What is the special magic {kind[:-1]} for {keys[0]} mentioned in the provided text?"
    expected = [v for vs in answers.values() for v in vs]
    return NeedleSample(variant, length, seed, context, question, expected, needles)


def score(answer: str, expected: list[str]) -> float:
    """RULER's average reference coverage: the fraction of expected values in the answer."""
    if not expected:
        raise ValueError("expected values must not be empty")
    text = answer.lower()
    return sum(v.lower() in text for v in expected) / len(expected)
