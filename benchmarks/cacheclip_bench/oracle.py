"""`oracle` (analysis only): select by the primary model's own last-layer attention from the
question over the chunks, taken from a full prefill, then the same grouping and budget as
CacheClip. It costs more than full attention; it shows what a selector that agreed perfectly
with the primary would choose. Registered when `cacheclip_rag.eval` is imported."""

from __future__ import annotations

import torch

from cacheclip_rag.analysis import Plan, Selector, attention_from_rows, pick, register


class Oracle(Selector):
    name = "oracle"
    analysis_only = True

    def plan(self, prepared) -> Plan:
        layout, request = prepared.layout, prepared.request
        segments = layout.chunk_segments()
        query_rows = torch.arange(segments[-1].end, layout.num_tokens)
        attention = attention_from_rows(prepared.primary.lm, layout.input_ids, query_rows, [-1])[-1]
        scores = [attention[seg.start : seg.end] for seg in segments]
        picks = pick(scores, request.ratio, request.select, request.budget)
        return Plan(rows=torch.cat([seg.start + torch.nonzero(p.kept).flatten() for seg, p in zip(segments, picks)]))


register(Oracle())
