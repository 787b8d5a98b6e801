"""`cacheclip-stale` and `cascade`: CacheClip reading where reuse went stale.

Teacher-forced on real multi-hop questions, the rows worth recomputing are those whose reused
K/V differ most from what a full prefill would hold, not those the question attends to most;
and the small aux model's own reused-vs-full deviation tracks the primary's (Spearman 0.90 per
token on MuSiQue), so the aux can read it at the aux's cost (`docs/benchmarks.md`).

`cacheclip-stale`: the aux runs the request's joint sequence (the shared prefix, every chunk at
its assembled position, the question) through its first `SelectConfig.stale_layers` layers
only, compares each chunk token's K and V there with its stored cache (keys moved to the joint
positions), and scores each token by its relative deviation, mean over those layers
(`stale_on`: K, V or both). Scores move to primary tokens through character spans (a primary
token takes the highest score of the aux tokens it overlaps), and the top `ratio` of the
primary's chunk rows are recomputed. Runs on the aux worker thread, beside the primary's cache
loading.

`cascade`: the staleness proposes `SelectConfig.cascade_factor` times the budget; the primary
reads the question over its reused caches (ProphetKV's first stage) and keeps the budget's worth
of the proposals it attends to most: the aux says where the cache is stale, the primary which
of those rows its question reads.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from cacheclip_kernels import causal_position_mask

from ..config import AUTO
from ..models.loading import LoadedModel
from ..models.rope import rerotate
from ..request.plan import Plan
from ..request.selector import Selector, register
from ..storage.record import ChunkKV
from .budget import row_count
from .prophetkv import query_attention


def relative_deviation(full: torch.Tensor, reused: torch.Tensor) -> torch.Tensor:
    """[T] |full - reused| / |full| per row, mean over KV heads; both [1, kv_heads, T, head_dim]."""
    f, r = full[0].float(), reused[0].float()
    return ((f - r).norm(dim=-1) / f.norm(dim=-1).clamp(min=1e-6)).mean(0)


@torch.inference_mode()
def aux_deviation(aux: LoadedModel, prefix_kv: ChunkKV, chunk_kvs: list[ChunkKV], query_ids: torch.Tensor,
                  layers: int, on: str = "kv") -> list[torch.Tensor]:
    """Per chunk, [L_i]: how far its stored aux cache is from the aux model's own pass over the
    joint sequence [prefix | chunk_1 | ... | chunk_n | query], mean over the first `layers`
    layers of the relative deviation of K, V or both (`on`: "k", "v", "kv").

    Every chunk was stored after the shared prefix at positions [P, P + L_i); in the joint
    sequence it starts after the chunks before it, so its stored keys are re-rotated by that
    offset before they are compared. The pass stops after `layers` layers (a fraction of the aux
    model's cost). The first chunk after the prefix deviates only by rounding: its stored cache is
    its in-context cache."""
    if on not in ("k", "v", "kv"):
        raise ValueError(f"on must be 'k', 'v' or 'kv', got {on!r}")
    fam = aux.family
    layers = min(layers, len(fam.layers))
    p = prefix_kv.num_tokens
    lens = [kv.num_tokens for kv in chunk_kvs]
    ids = torch.cat([prefix_kv.token_ids, *(kv.token_ids for kv in chunk_kvs), query_ids.to(torch.long)])
    n = int(ids.numel())
    if n > aux.max_positions:
        raise ValueError(f"the joint sequence needs {n} positions in the aux model {aux.name!r}, which has "
                         f"{aux.max_positions}: fewer or shorter chunks, or another selector")
    starts = [p + sum(lens[:i]) for i in range(len(lens))]
    totals = [torch.zeros(length) for length in lens]
    for layer, k, v in joint_pass(aux, ids, layers):
        inv_freq = fam.inv_freq(layer)
        for i, (kv, start) in enumerate(zip(chunk_kvs, starts)):
            end = start + lens[i]
            if on in ("k", "kv"):
                stored = rerotate(kv.keys[layer], start - p, inv_freq)[None]  # [1, H_kv, L_i, D]
                totals[i] += relative_deviation(k[:, :, start:end], stored.to(k.device, k.dtype)).cpu()
            if on in ("v", "kv"):
                stored = kv.values[layer][None]
                totals[i] += relative_deviation(v[:, :, start:end], stored.to(v.device, v.dtype)).cpu()
    per = layers * (2 if on == "kv" else 1)
    return [t / per for t in totals]


def joint_pass(aux: LoadedModel, ids: torch.Tensor, layers: int) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """The aux model's own causal pass over ids [N] at positions 0..N-1, stopped after `layers`
    layers: yields (layer, k, v) for each, k rotated, both [1, H_kv, N, D], as a prefill's cache
    would hold them (the layers after the last yielded one never run)."""
    fam = aux.family
    n = int(ids.numel())
    positions = torch.arange(n, device=aux.device)[None]
    h = fam.embed(ids.to(aux.device))[None]
    rope = fam.rope(h, positions)
    for layer in range(min(layers, len(fam.layers))):
        q, k, v = fam.qkv(layer, h, rope)
        yield layer, k, v
        if layer == layers - 1:
            return
        window, group = fam.window(layer), q.shape[1] // k.shape[1]
        mask = None if window is None else causal_position_mask(positions, n, window).to(q.device)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=fam.scaling(layer),
                                             enable_gqa=group > 1)
        h = fam.finish(layer, h, out)


def _span_chars(offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The characters of every token's span [start, end), all tokens at once: (character index,
    the token it belongs to), each [sum of span lengths]. offsets [L, 2]; empty spans add none."""
    lengths = (offsets[:, 1] - offsets[:, 0]).clamp(min=0)
    owner = torch.repeat_interleave(torch.arange(offsets.shape[0]), lengths)
    first = torch.cumsum(lengths, 0) - lengths  # where each token's characters start in the flat list
    return offsets[owner, 0] + torch.arange(owner.numel()) - first[owner], owner


def to_primary(aux_offsets: torch.Tensor, aux_scores: torch.Tensor, primary_offsets: torch.Tensor,
               n_chars: int) -> torch.Tensor:
    """[Lp] each primary token's score: the highest of the aux tokens its character span overlaps
    (0 where none does). aux_offsets [La, 2], aux_scores [La], primary_offsets [Lp, 2]."""
    chars = torch.zeros(n_chars + 1)
    idx, owner = _span_chars(aux_offsets)
    chars.scatter_reduce_(0, idx.clamp(max=n_chars), aux_scores.float()[owner], "amax")
    out = torch.zeros(primary_offsets.shape[0])
    idx, owner = _span_chars(primary_offsets)
    out.scatter_reduce_(0, owner, chars[idx.clamp(max=n_chars)], "amax")
    return out


def stale_scores(prepared) -> torch.Tensor:
    """[C] the aux staleness of each primary chunk row, in `layout.chunk_rows()` order; a packet's
    soft rows (no text) score 0."""
    cfg = prepared.request.select
    aux_kvs = prepared.aux_kvs(layers=cfg.stale_layers)
    per_chunk = aux_deviation(prepared.aux.lm, prepared.aux_prefix_kv(), aux_kvs, prepared.aux_query_ids(),
                              cfg.stale_layers, cfg.stale_on)
    out = []
    for seg, kv, scores in zip(prepared.layout.chunk_segments(), aux_kvs, per_chunk):
        primary = to_primary(kv.offsets, scores, seg.offsets, len(seg.text))
        out.append(torch.where(seg.ids >= 0, primary, torch.zeros_like(primary)))
    return torch.cat(out)


def _with_chunk_starts(prepared, rows: torch.Tensor) -> torch.Tensor:
    """`rows` and the first `chunk_start_tokens` text rows of every chunk, sorted, unique."""
    n = prepared.request.select.chunk_start_tokens
    if not n:
        return rows.sort().values
    starts = [seg.start + torch.nonzero(seg.ids >= 0).flatten()[:n] for seg in prepared.layout.chunk_segments()]
    return torch.unique(torch.cat([rows, *starts]))


def stale_ratio(prepared, scores: torch.Tensor) -> float:
    """The request's ratio; for recompute_ratio "auto", the fewest stalest rows whose recompute
    leaves at most `SelectConfig.stale_target` of staleness per chunk row unrepaired (the mean,
    over all chunk rows, of the scores of the rows left), as a fraction of the chunk rows within
    [auto_floor, auto_cap]: a request whose chunks barely interact recomputes its floor, one
    whose reuse went stale everywhere recomputes more."""
    ratio, cfg = prepared.request.ratio, prepared.request.select
    if ratio != AUTO:
        return ratio
    n = scores.numel()
    if n == 0:
        return cfg.auto_floor
    left = float(scores.sum()) - torch.cumsum(torch.sort(scores.float(), descending=True).values, 0)  # [C]
    needed = int((left > cfg.stale_target * n).sum()) + 1 if float(scores.sum()) > cfg.stale_target * n else 0
    return min(max(needed / n, cfg.auto_floor), cfg.auto_cap)


class CacheClipStale(Selector):
    name = "cacheclip-stale"
    uses_aux = True
    adaptive = True  # recompute_ratio "auto": `stale_ratio`

    def plan(self, prepared) -> Plan:
        start = time.perf_counter()
        scores = stale_scores(prepared)
        chunk_rows = prepared.layout.chunk_rows()
        k = row_count(stale_ratio(prepared, scores), chunk_rows.numel())
        top = torch.topk(scores, k).indices if k else torch.empty(0, dtype=torch.long)
        return Plan(rows=_with_chunk_starts(prepared, chunk_rows[top]), seconds=time.perf_counter() - start)


class Cascade(Selector):
    name = "cascade"

    def plan(self, prepared) -> Plan:
        start = time.perf_counter()
        chunk_rows = prepared.layout.chunk_rows()
        k = row_count(prepared.request.ratio, chunk_rows.numel())
        if k == 0:
            return Plan(rows=_with_chunk_starts(prepared, chunk_rows[:0]), seconds=time.perf_counter() - start)
        proposed = min(chunk_rows.numel(), max(k, round(prepared.request.select.cascade_factor * k)))
        candidates = torch.topk(stale_scores(prepared), proposed).indices
        read = query_attention(prepared)[candidates]
        chosen = candidates[torch.topk(read, k).indices]
        return Plan(rows=_with_chunk_starts(prepared, chunk_rows[chosen]), seconds=time.perf_counter() - start)


register(CacheClipStale())
register(Cascade())
