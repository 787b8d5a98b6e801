"""Decoding: from the first token's logits and a filled cache, stream text until a stop."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from ..corpus.chunking import decode_ids
from ..models.loading import LoadedModel


@dataclass(frozen=True)
class DecodeOptions:
    """Per-request decoding: greedy when temperature is 0; stop strings end the text early."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    stop: tuple[str, ...] = ()
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or isinstance(self.max_new_tokens, bool) or not 1 <= self.max_new_tokens <= 1 << 16:
            raise ValueError(f"max_new_tokens must be an integer in [1, 65536], got {self.max_new_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not 0.0 <= float(self.temperature) <= 10.0:
            raise ValueError(f"temperature must be a number in [0, 10], got {self.temperature!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")


def stop_token_ids(lm: LoadedModel) -> set[int]:
    """End-of-sequence ids from the generation config and the tokenizer (e.g. <|im_end|>)."""
    ids: set[int] = set()
    eos = getattr(lm.model.generation_config, "eos_token_id", None)
    ids.update(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
    if lm.tokenizer.eos_token_id is not None:
        ids.add(lm.tokenizer.eos_token_id)
    return ids


Step = Callable[[int, int], torch.Tensor]
"""step(token, t) feeds the t-th generated token and returns the logits [vocab] for the next."""


def hf_step(lm: LoadedModel, cache: DynamicCache, next_pos: int) -> Step:
    """Decode with transformers' own forward over a DynamicCache holding positions [0, next_pos)."""

    def step(token: int, t: int) -> torch.Tensor:
        pos = torch.tensor([[next_pos + t]], device=lm.device)
        ids = torch.tensor([[token]], device=lm.device)
        out = lm.model(input_ids=ids, position_ids=pos, cache=cache, use_cache=True)
        return out.logits[0, -1].float().cpu()

    return step


def _pick(logits: torch.Tensor, opts: DecodeOptions, gen: torch.Generator) -> int:
    if opts.temperature == 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / opts.temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=gen))


@torch.inference_mode()
def decode(lm: LoadedModel, step: Step, first_logits: torch.Tensor, opts: DecodeOptions) -> Iterator[tuple[int, str]]:
    """Yield (token id, new text) per generated token until a stop token, stop string or the limit.

    first_logits [vocab] predict the first new token; step feeds each token and gives the next logits.
    Text is released only once it can no longer change (incomplete UTF-8 is held back) and
    never past a stop string.
    """
    stops = stop_token_ids(lm)
    gen = torch.Generator().manual_seed(opts.seed)
    ids: list[int] = []
    emitted = ""
    logits = first_logits
    for i in range(opts.max_new_tokens):
        token = _pick(logits, opts, gen)
        if token in stops:
            break
        ids.append(token)
        text = decode_ids(lm.tokenizer, ids)
        cut = min((text.find(s) for s in opts.stop if s in text), default=-1)
        if cut >= 0:
            if cut > len(emitted):
                yield token, text[len(emitted) : cut]
            return
        hold = max((len(s) - 1 for s in opts.stop), default=0)  # a stop string may be starting
        ready = text if not text.endswith("\ufffd") else text.rstrip("\ufffd")
        ready = ready[: max(len(emitted), len(ready) - hold)] if hold else ready
        if len(ready) > len(emitted) and ready.startswith(emitted):
            yield token, ready[len(emitted) :]
            emitted = ready
        if i + 1 == opts.max_new_tokens:
            break
        logits = step(token, i)
    text = decode_ids(lm.tokenizer, ids)  # flush what was held back
    if len(text) > len(emitted) and text.startswith(emitted):
        yield -1, text[len(emitted) :]
