"""`cacheclip ask --show-selection out.html`: the context with recomputed tokens highlighted
and the aux scores as a heat map."""

from __future__ import annotations

import html
from pathlib import Path

import torch


def _char_scores(trace: dict) -> torch.Tensor:
    n = len(trace["text"])
    chars = torch.zeros(n)
    for score, (s, e) in zip(trace["aux_scores"].tolist(), trace["aux_offsets"].tolist()):
        chars[s:e] = torch.maximum(chars[s:e], torch.tensor(score))
    return chars


def _recomputed_chars(trace: dict) -> torch.Tensor:
    n = len(trace["text"])
    mask = torch.zeros(n, dtype=torch.bool)
    for rec, (s, e) in zip(trace["recomputed"].tolist(), trace["primary_offsets"].tolist()):
        if rec:
            mask[s:max(e, s + 1)] = True
    return mask


def write(path: str | Path, question: str, answer, traces: list[dict]) -> None:
    """One block per chunk; background = aux score (darker = higher), underlined = recomputed."""
    top = max((float(t["aux_scores"].max()) for t in traces if t["aux_scores"].numel()), default=1.0) or 1.0
    blocks = []
    for t in traces:
        scores, rec = _char_scores(t), _recomputed_chars(t)
        spans, text = [], t["text"]
        i = 0
        while i < len(text):
            j = i + 1
            while j < len(text) and bool(rec[j]) == bool(rec[i]) and abs(float(scores[j] - scores[i])) < 1e-12:
                j += 1
            alpha = min(1.0, float(scores[i]) / top) ** 0.5
            style = f"background: rgba(255,140,0,{alpha:.3f});" + (" text-decoration: underline 2px #0645ad;" if rec[i] else "")
            spans.append(f'<span style="{style}">{html.escape(text[i:j])}</span>')
            i = j
        frac = float(t["recomputed"].float().mean()) if t["recomputed"].numel() else 0.0
        blocks.append(f"<h3>{html.escape(t['chunk_id'])} — {100 * frac:.1f}% recomputed</h3><pre>{''.join(spans)}</pre>")
    page = f"""<!doctype html><meta charset="utf-8"><title>CacheClip selection</title>
<style>body{{font-family:sans-serif;max-width:60em;margin:2em auto}} pre{{white-space:pre-wrap;line-height:1.6}}</style>
<h1>CacheClip selection</h1>
<p><b>Question:</b> {html.escape(question)}</p>
<p><b>Answer:</b> {html.escape(answer.text)}</p>
<p>Recompute ratio {answer.recompute_ratio}, effective {100 * answer.effective_fraction:.1f}% of {answer.context_tokens} context tokens.
Orange: aux attention score (darker is higher). Underlined: tokens the primary model recomputed.</p>
{''.join(blocks)}"""
    Path(path).write_text(page, encoding="utf-8")
