"""Offline: prefill the shared prefix and each chunk after it, producing ChunkKVs to store."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .chunking import encode_text
from .config import PromptConfig
from .models import LoadedModel
from .store import ChunkKV

_PLACEHOLDER = "\x00CACHECLIP-USER-CONTENT\x00"


@dataclass(frozen=True)
class Template:
    """A model's prompt frame around the user content.

    prefix: text before the context (system prompt and the start of the user turn).
    suffix: text after the user content (end of user turn, start of assistant turn).
    """

    prefix: str
    suffix: str


def chat_template(lm: LoadedModel, prompt: PromptConfig) -> Template:
    """Split the model's chat template at the user content; a plain completion frame (system
    prompt, content, "Answer:") for a base model that has none.

    A model whose tokenizer starts every text with a BOS token (Llama, Gemma) gets it at the
    head of the prefix when the template does not write it: segments are tokenized without
    special tokens, so this is the one place it can go (Gemma degrades badly without it).
    """
    tok = lm.tokenizer
    template = Template(prompt.system_prompt + "\n\n", "\nAnswer:")
    if getattr(tok, "chat_template", None):
        messages = [
            {"role": "system", "content": prompt.system_prompt},
            {"role": "user", "content": _PLACEHOLDER},
        ]
        rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        if rendered.count(_PLACEHOLDER) == 1:
            template = Template(*rendered.split(_PLACEHOLDER))
    bos = tok.bos_token
    if bos and tok("x").input_ids[:1] == [tok.bos_token_id] and not template.prefix.startswith(bos):
        template = Template(bos + template.prefix, template.suffix)
    return template


def tokenize(lm: LoadedModel, text: str, special: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [T] and character offsets [T, 2] of one segment, tokenized on its own.

    special=True only for template text (its <|im_start|> must be the special token); in user
    content, special-token strings are split as plain text (see chunking.encode_text).
    """
    ids, offsets = encode_text(lm.tokenizer, text, special)
    return torch.tensor(ids, dtype=torch.long), torch.tensor(offsets, dtype=torch.long).reshape(-1, 2)


def layers_kv(cache, start: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per layer K/V from `start` on, on the host (stored caches and the memory tier live there)."""
    keys = [layer.keys[0, :, start:].to("cpu", copy=True).contiguous() for layer in cache.layers]
    values = [layer.values[0, :, start:].to("cpu", copy=True).contiguous() for layer in cache.layers]
    return keys, values


@torch.inference_mode()
def encode_prefix(lm: LoadedModel, prefix: str) -> ChunkKV:
    """The prefix's own cache, prefilled from position 0."""
    ids, offsets = tokenize(lm, prefix, special=True)
    if ids.numel() == 0:
        raise ValueError("the shared prefix tokenizes to nothing; set PromptConfig.system_prompt")
    keys, values = layers_kv(lm.family.prefill(ids).cache, 0)
    return ChunkKV(keys, values, ids, offsets, start_pos=0)


@torch.inference_mode()
def encode_segment(lm: LoadedModel, prefix_ids: torch.Tensor, text: str) -> ChunkKV:
    """Prefill prefix + text; keep the text's rows, keys rotated for positions [P, P + T)."""
    ids, offsets = tokenize(lm, text)
    if ids.numel() == 0:
        raise ValueError(f"segment {text[:40]!r} tokenizes to nothing")
    p = prefix_ids.numel()
    keys, values = layers_kv(lm.family.prefill(torch.cat([prefix_ids, ids])).cache, p)
    return ChunkKV(keys, values, ids, offsets, start_pos=p)
