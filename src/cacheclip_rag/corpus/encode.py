"""Offline: prefill the shared prefix and each chunk after it, producing ChunkKVs to store."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import PromptConfig
from ..models.loading import LoadedModel
from ..storage.record import ChunkKV
from .chunking import encode_text

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


ROLES = ("system", "user", "assistant")


def check_messages(messages) -> list[dict]:
    """Chat messages as [{"role", "content"}], validated: roles system / user / assistant,
    string contents, at least one user message, the last one from the user."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"messages must be a non-empty list of {{'role', 'content'}} dicts, got {messages!r}"[:300])
    out = []
    for i, m in enumerate(messages):
        role, content = (m.get("role"), m.get("content")) if isinstance(m, dict) else (None, None)
        if role not in ROLES:
            raise ValueError(f"messages[{i}].role must be one of {list(ROLES)}, got {role!r}")
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string, got {type(content).__name__}")
        out.append({"role": role, "content": content})
    if out[-1]["role"] != "user" or not out[-1]["content"].strip():
        raise ValueError("the last message must be a non-empty user message")
    return out


def chat_frame(lm: LoadedModel, prompt: PromptConfig, messages: list[dict]) -> tuple[list[str], list[str]]:
    """A conversation in the model's chat template, cut into what the engine's frame needs:
    (contents, glue) with rendered == template.prefix + contents[0] + glue[0] + contents[1] + ...
    + contents[-1] + template.suffix, where each glue string is template text (role markers;
    its special tokens are parsed) and each content is user text (never parsed for them).

    The shared prefix (the engine's system prompt) is kept so chunk caches stay valid; a
    system message from the caller is put at the head of the first user turn, as plain text.
    A model without a chat template gets "User: / Assistant:" lines.
    """
    messages = check_messages(messages)
    system = "\n\n".join(m["content"] for m in messages if m["role"] == "system")
    turns = [dict(m) for m in messages if m["role"] != "system"]
    if turns[0]["role"] != "user":
        turns.insert(0, {"role": "user", "content": ""})
    if system:
        turns[0]["content"] = f"{system}\n\n{turns[0]['content']}"
    contents = [t["content"] for t in turns]
    tok, template = lm.tokenizer, chat_template(lm, prompt)
    marks = [f"\x00CACHECLIP-TURN-{i}\x00" for i in range(len(turns))]
    if getattr(tok, "chat_template", None):
        placed = [{"role": "system", "content": prompt.system_prompt}]
        placed += [{"role": t["role"], "content": mark} for t, mark in zip(turns, marks)]
        rendered = tok.apply_chat_template(placed, tokenize=False, add_generation_prompt=True)
    else:
        rendered = template.prefix + "".join(
            mark if i == 0 else f"\n{t['role'].capitalize()}: {mark}" for i, (t, mark) in enumerate(zip(turns, marks))
        ) + template.suffix
    if template.prefix.startswith(tok.bos_token or "\x00") and not rendered.startswith(template.prefix):
        rendered = tok.bos_token + rendered
    parts, rest = [], rendered
    for mark in marks:
        head, found, rest = rest.partition(mark)
        if not found:
            raise ValueError(f"the chat template of {lm.name!r} drops a message; cannot frame this conversation")
        parts.append(head)
    if parts[0] != template.prefix or rest != template.suffix:
        raise ValueError(f"the chat template of {lm.name!r} frames a conversation unlike a single turn; "
                         "its chat requests are not supported")
    return contents, parts[1:]


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
