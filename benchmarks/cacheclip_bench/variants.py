"""Analysis variants of product selectors, registered for benches so that a choice a method's
paper leaves open, or a combination of methods, can be compared with the defaults on the same
samples. Registered when `cacheclip_rag.eval` is imported; not serving modes.

`prophetkv-max`: ProphetKV with its per-layer query attention fused by max over layers instead
of the mean; `prophetkv-hmean`: with each layer's attention averaged over query heads instead of
their max (the first default; `selectors/prophetkv.py`); `prophetkv-word`: choosing whole words
ranked by their best token instead of single tokens.

`cacheclip+prophetkv`: one budget split between the two query-driven selections. On the needle
suite they fail on different questions (CacheClip on multi-value needles, ProphetKV on multi-key
ones), so this spends `share` of the budget on CacheClip's selection (aux model, calibrated
profile, grouping) and fills the rest with ProphetKV's top-scored chunk rows (Wang et al.,
"ProphetKV: User-Query-Driven Selective Recomputation for Efficient KV Cache Reuse in
Retrieval-Augmented Generation", arXiv:2602.02579) among those CacheClip left. Both selections
are on the critical path on one CPU and count in `timings["selection"]`. Measured at 4K it
scores below both (`docs/notes/2026-12-03-benchmark-record.md`, where the multi-key gap turns out to be two samples).

`cacheclip-hmax`, `cacheclip-tokens`, `cacheclip-deep`: CacheClip with one choice of its
selection changed from what the profile gives, as ProphetKV makes it: heads reduced by their
max (the heads that retrieve are few), the top tokens without grouping (window 1, tau 1), the
scores averaged over every aux layer instead of the calibrated ones; `cacheclip-hmax-tokens`
both of the first two.

`cacheclip-stale-l1`, `-l6`, `-lall`: the aux staleness read over the first 1, 6 or every aux
layer instead of `SelectConfig.stale_layers`; `cacheclip-stale-k`, `-v`: of K or V alone;
`cascade-x2`, `-x4`: the cascade proposing 2 or 4 times the budget; `cascade-l1`: its proposals
read from the aux's first layer alone (a third of the aux pass). What calibration of the
staleness selectors chooses between, on the same questions (`bench fidelity --data`).

`cacheclip-passage`: whole passages instead of scattered tokens. The aux query reads every chunk
at once (context "joint", so one softmax compares the chunks), each chunk's share of the aux
attention is summed, and whole chunks are recomputed in that order until the budget is reached
(the last one may overshoot it; the effective fraction says by how much). On multi-hop QA the
answer sits in one or two passages; recomputing them whole repairs every link inside them.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from cacheclip_rag.analysis import (
    CacheClip,
    CacheClipStale,
    Cascade,
    Plan,
    ProphetKV,
    Selector,
    aux_scores,
    query_attention,
    register,
)


class ProphetKVMax(ProphetKV):
    name = "prophetkv-max"
    fuse = "max"


class ProphetKVHeadMean(ProphetKV):
    name = "prophetkv-hmean"
    heads = "mean"


class ProphetKVWord(ProphetKV):
    name = "prophetkv-word"
    unit = "word"


class CacheClipProphetKV(Selector):
    """share: the fraction of the ratio's rows CacheClip's selection takes (ProphetKV the rest)."""

    name = "cacheclip+prophetkv"
    uses_aux = True
    share: float = 0.5

    def plan(self, prepared) -> Plan:
        start = time.perf_counter()
        chunk_rows = prepared.layout.chunk_rows()
        budget = round(prepared.request.ratio * chunk_rows.numel())
        aux_request = dataclasses.replace(prepared.request, ratio=prepared.request.ratio * self.share)
        aux_plan = CacheClip().plan(dataclasses.replace(prepared, request=aux_request))
        taken = torch.isin(chunk_rows, aux_plan.rows)  # [C]
        scores = query_attention(prepared).masked_fill(taken, float("-inf"))
        fill = max(0, min(budget - int(taken.sum()), int((~taken).sum())))
        extra = chunk_rows[torch.topk(scores, fill).indices] if fill else chunk_rows[:0]
        return Plan(rows=torch.sort(torch.cat([aux_plan.rows, extra])).values, trace=aux_plan.trace, seconds=time.perf_counter() - start)


class CacheClipWith(Selector):
    """A selector (CacheClip by default) with `select` fields replaced (`SelectConfig`); "all"
    score or stale layers: every aux layer."""

    uses_aux = True
    adaptive = True

    def __init__(self, name: str, base: Selector | None = None, **select) -> None:
        self.name, self.base, self.select = name, base or CacheClip(), select
        self.adaptive = self.base.adaptive

    def plan(self, prepared) -> Plan:
        select = dict(self.select)
        if select.get("score_layers") == "all":
            select["score_layers"] = tuple(range(prepared.aux.lm.num_layers))
        if select.get("stale_layers") == "all":
            select["stale_layers"] = prepared.aux.lm.num_layers
        request = dataclasses.replace(prepared.request, select=dataclasses.replace(prepared.request.select, **select))
        return self.base.plan(dataclasses.replace(prepared, request=request))


class CacheClipPassage(Selector):
    name = "cacheclip-passage"
    uses_aux = True

    def plan(self, prepared) -> Plan:
        start = time.perf_counter()
        request = prepared.request
        joint = dataclasses.replace(prepared, request=dataclasses.replace(
            request, select=dataclasses.replace(request.select, context="joint")))
        cfg, aux_kvs, query_ids = CacheClip.scoring(joint)
        scores = aux_scores(prepared.aux.lm, cfg, prepared.aux_prefix_kv(), aux_kvs, query_ids)
        segments = prepared.layout.chunk_segments()
        budget = round(request.ratio * prepared.layout.chunk_rows().numel())
        rows, taken = [], 0
        for i in sorted(range(len(segments)), key=lambda i: -float(scores[i].sum())):
            if taken >= budget:
                break
            seg = segments[i]
            rows.append(torch.arange(seg.start, seg.end)[seg.ids >= 0])  # a packet's soft rows hold no text
            taken += int(rows[-1].numel())
        rows = torch.sort(torch.cat(rows)).values if rows else torch.empty(0, dtype=torch.long)
        return Plan(rows=rows, seconds=time.perf_counter() - start)


register(ProphetKVMax())
register(ProphetKVHeadMean())
register(ProphetKVWord())
register(CacheClipProphetKV())
register(CacheClipPassage())
register(CacheClipWith("cacheclip-hmax", head_agg="max"))
register(CacheClipWith("cacheclip-tokens", window=1, tau=1))
register(CacheClipWith("cacheclip-hmax-tokens", head_agg="max", window=1, tau=1))
register(CacheClipWith("cacheclip-deep", score_layers="all"))
for _layers in (1, 6, "all"):
    register(CacheClipWith(f"cacheclip-stale-l{_layers}", CacheClipStale(), stale_layers=_layers))
register(CacheClipWith("cacheclip-stale-k", CacheClipStale(), stale_on="k"))
register(CacheClipWith("cacheclip-stale-v", CacheClipStale(), stale_on="v"))
register(CacheClipWith("cascade-x2", Cascade(), cascade_factor=2.0))
register(CacheClipWith("cascade-x4", Cascade(), cascade_factor=4.0))
register(CacheClipWith("cascade-l1", Cascade(), stale_layers=1))
