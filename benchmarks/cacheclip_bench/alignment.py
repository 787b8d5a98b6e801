"""`cacheclip bench alignment`: do the aux model's last-layer attention peaks match the primary's?

Reproduces the paper's Table 2 for any model pair. For each multi-document input (context +
question, the same text for both models), the head-averaged attention of the last token is
taken at the aux model's last layer and at the primary model's first and last layers, projected
into character space (each token's weight spread evenly over its characters, context characters
only), and compared by the Jaccard index of the top-20% character positions and by KL divergence.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from cacheclip_rag.analysis import (
    LoadedModel,
    attention_from_rows,
    encode_text,
    to_chars,
    top_jaccard,
)
from cacheclip_rag.analysis import (
    needle_samples as generate,
)


@dataclass
class AlignmentRow:
    length: int
    samples: int
    jaccard_aux_last: float
    jaccard_pri_first: float
    kl_aux_last: float
    kl_pri_first: float


def last_token_attention(lm: LoadedModel, text: str, layers: list[int]) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
    """Head-averaged attention [T] of the last token at each layer, and token offsets [T, 2]."""
    ids, offsets = encode_text(lm.tokenizer, text)
    ids_t = torch.tensor(ids)
    attention = attention_from_rows(lm, ids_t, torch.tensor([ids_t.numel() - 1]), layers)
    return attention, torch.tensor(offsets).reshape(-1, 2)


def kl(p: torch.Tensor, q: torch.Tensor, eps: float = 1e-12) -> float:
    p = p / p.sum() if p.sum() > 0 else p
    q = q / q.sum() if q.sum() > 0 else q
    return float((p * ((p + eps) / (q + eps)).log()).sum())


def run(primary: LoadedModel, aux: LoadedModel, lengths: list[int], samples: int = 5, seed: int = 500) -> list[AlignmentRow]:
    rows = []
    for length in lengths:
        j_aux, j_first, kl_aux, kl_first = [], [], [], []
        for i in range(samples):
            sample = generate("multikey_1", length, seed + i, primary.tokenizer)
            text = sample.context + "\n\nQuestion: " + sample.question + "\nAnswer:"
            n_ctx = len(sample.context)
            pri, pri_off = last_token_attention(primary, text, [0, -1])
            aux_att, aux_off = last_token_attention(aux, text, [-1])
            pri_last = to_chars(pri[-1], pri_off, n_ctx)
            pri_first = to_chars(pri[0], pri_off, n_ctx)
            aux_last = to_chars(aux_att[-1], aux_off, n_ctx)
            j_aux.append(top_jaccard(aux_last, pri_last))
            j_first.append(top_jaccard(pri_first, pri_last))
            kl_aux.append(kl(aux_last, pri_last))
            kl_first.append(kl(pri_first, pri_last))
        rows.append(AlignmentRow(length, samples, statistics.mean(j_aux), statistics.mean(j_first),
                                 statistics.mean(kl_aux), statistics.mean(kl_first)))
    return rows


def table(rows: list[AlignmentRow]) -> str:
    head = f"{'len':>6} {'n':>3} {'J(aux_last,pri_last)':>21} {'J(pri_first,pri_last)':>22} {'KL(aux_last||pri_last)':>23} {'KL(pri_first||pri_last)':>24}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.length:>6} {r.samples:>3} {r.jaccard_aux_last:>21.3f} {r.jaccard_pri_first:>22.3f} {r.kl_aux_last:>23.3f} {r.kl_pri_first:>24.3f}")
    return "\n".join(lines)


def write_json(rows: list[AlignmentRow], path: str | Path) -> None:
    Path(path).write_text(json.dumps([asdict(r) for r in rows], indent=2))
