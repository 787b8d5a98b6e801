"""CacheClip token selection with the auxiliary model.

For each retrieved chunk i the aux model reuses its own cache of [prefix + chunk_i] and computes
only the query rows of [prefix + chunk_i + query]; all chunks run as one padded batch. At the
scoring layer the attention of the query rows over the chunk's tokens (prefix and query columns
excluded, softmax over the whole row) is averaged over rows and heads: one score per aux token.
With context "joint" the query rows run once over every chunk at its assembled position instead
(`score_joint_by_layer`). The top k = round(ratio x all chunk tokens) become candidates,
sliding-window grouping keeps dense runs whole and drops isolated candidates, and the kept aux
tokens are mapped to primary tokens through character offsets.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .config import AUTO, SelectConfig
from .models import LoadedModel
from cacheclip_kernels import causal_position_mask

from .assemble import rerotate
from .record import ChunkKV


@dataclass
class ChunkSelection:
    """Per chunk, in aux token space: scores [La], candidates and grouped keep masks [La] bool."""

    scores: torch.Tensor
    candidates: torch.Tensor
    kept: torch.Tensor


def scoring_layers(aux: LoadedModel, layers: tuple[int, ...]) -> list[int]:
    n = aux.num_layers
    bad = [layer for layer in layers if not -n <= layer < n]
    if bad:
        raise ValueError(f"score_layers {bad} are outside the aux model's {n} layers (valid: {-n} to {n - 1})")
    return sorted({layer % n for layer in layers})


@torch.inference_mode()
def score_chunks_by_layer(
    aux: LoadedModel,
    prefix_kv: ChunkKV,
    chunk_kvs: list[ChunkKV],
    query_ids: torch.Tensor,
    layers: tuple[int, ...] = (-1,),
    head_agg: str = "mean",
    row_agg: str = "mean",
) -> dict[int, list[torch.Tensor]]:
    """Aux attention of the query over each chunk's tokens, at each requested layer, in one pass.

    prefix_kv: aux cache of the prefix (positions [0, P)); chunk_kvs: aux caches of the chunks,
    each prefilled after that prefix; query_ids: [Q] aux tokens of the query. Only the query
    rows are computed, and only up to the deepest requested layer. Returns {layer (0-based): one
    fp32 tensor [L_i] per chunk}; `mean_over_layers` makes one score per token of it.
    """
    wanted = scoring_layers(aux, layers)
    stop = wanted[-1]
    collected: dict[int, list[torch.Tensor]] = {}
    fam = aux.family
    b = len(chunk_kvs)
    p, q_len = prefix_kv.num_tokens, int(query_ids.numel())
    lens = torch.tensor([kv.num_tokens for kv in chunk_kvs])
    l_max = int(lens.max())
    dev = aux.device
    # Key layout per batch row: [prefix (P) | chunk_i padded to l_max | query (Q)].
    n_keys = p + l_max + q_len
    cols = torch.arange(n_keys)
    q_idx = torch.arange(q_len)
    visible = (cols[None, None, :] < p) | (
        (cols[None, None, :] >= p) & (cols[None, None, :] < p + lens[:, None, None])
    )
    query_cols = cols[None, None, :] - (p + l_max)
    visible = visible | ((query_cols >= 0) & (query_cols <= q_idx[None, :, None]))  # [B, Q, n_keys]
    positions = p + lens[:, None] + q_idx[None, :]  # [B, Q]
    key_pos = torch.where(query_cols[0] >= 0, p + lens[:, None] + query_cols[0], cols[None, :])  # [B, n_keys]
    masks: dict[int | None, torch.Tensor] = {}  # one per sliding window in the model

    def mask(window: int | None) -> torch.Tensor:  # [B, 1, Q, n_keys]
        if window not in masks:
            near = True if window is None else positions[:, :, None] - key_pos[:, None, :] < window
            masks[window] = (visible & near)[:, None].to(dev)
        return masks[window]

    h = fam.embed(query_ids.to(dev))[None].expand(b, -1, -1)
    rope = fam.rope(h, positions.to(dev))
    for layer in range(stop + 1):
        q, k, v = fam.qkv(layer, h, rope)
        keys = _batched(prefix_kv.keys[layer], [kv.keys[layer] for kv in chunk_kvs], l_max, k)
        seen, scale = mask(fam.window(layer)), fam.scaling(layer)
        if layer in wanted:
            collected[layer] = _query_to_chunk(q, keys, seen, scale, p, lens, head_agg, row_agg)
        if layer == stop:
            return collected
        values = _batched(prefix_kv.values[layer], [kv.values[layer] for kv in chunk_kvs], l_max, v)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=seen, scale=scale, enable_gqa=q.shape[1] != keys.shape[1])
        h = fam.finish(layer, h, out)
    raise AssertionError("scoring layer not reached")


@torch.inference_mode()
def score_joint_by_layer(
    aux: LoadedModel,
    prefix_kv: ChunkKV,
    chunk_kvs: list[ChunkKV],
    query_ids: torch.Tensor,
    layers: tuple[int, ...] = (-1,),
    head_agg: str = "mean",
    row_agg: str = "mean",
) -> dict[int, list[torch.Tensor]]:
    """Like `score_chunks_by_layer`, but the query reads every chunk at once: one sequence
    [prefix | chunk_1 | ... | chunk_B | query] at its assembled positions (each chunk's cached keys
    re-rotated from [P, P + L_i) to where the chunk starts), one softmax per query row over all of
    it. The query rows carry what earlier chunks said into their reading of later ones (a bridge
    entity in a two-hop question), and they run once instead of once per chunk. Needs
    P + sum(L_i) + Q positions in the aux model. Returns {layer: one fp32 tensor [L_i] per chunk}.
    """
    wanted = scoring_layers(aux, layers)
    stop = wanted[-1]
    fam, dev = aux.family, aux.device
    p, q_len = prefix_kv.num_tokens, int(query_ids.numel())
    lens = [kv.num_tokens for kv in chunk_kvs]
    starts = [p + sum(lens[:i]) for i in range(len(lens))]
    n_ctx = p + sum(lens)
    positions = torch.arange(n_ctx, n_ctx + q_len)[None]  # [1, Q]
    masks: dict[int | None, torch.Tensor] = {}
    collected: dict[int, list[torch.Tensor]] = {}
    h = fam.embed(query_ids.to(dev))[None]
    rope = fam.rope(h, positions.to(dev))
    for layer in range(stop + 1):
        q, k, v = fam.qkv(layer, h, rope)
        inv_freq = fam.inv_freq(layer)
        keys = torch.cat([prefix_kv.keys[layer].to(dev, q.dtype)]
                         + [rerotate(kv.keys[layer].to(dev, q.dtype), s - p, inv_freq) for kv, s in zip(chunk_kvs, starts)]
                         + [k[0]], dim=1)[None]  # [1, H_kv, N, D]
        window = fam.window(layer)
        if window not in masks:
            masks[window] = causal_position_mask(positions, n_ctx + q_len, window).to(dev)
        seen, scale = masks[window], fam.scaling(layer)
        if layer in wanted:
            probs = _query_attention(q, keys, seen, scale, head_agg, row_agg)[0]  # [N]
            collected[layer] = [probs[s : s + n].cpu() for s, n in zip(starts, lens)]
        if layer == stop:
            return collected
        values = torch.cat([prefix_kv.values[layer].to(dev, q.dtype)]
                           + [kv.values[layer].to(dev, q.dtype) for kv in chunk_kvs] + [v[0]], dim=1)[None]
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=seen, scale=scale, enable_gqa=q.shape[1] != keys.shape[1])
        h = fam.finish(layer, h, out)
    raise AssertionError("scoring layer not reached")


def joint_positions(prefix_kv: ChunkKV, chunk_kvs: list[ChunkKV], query_ids: torch.Tensor) -> int:
    """Positions the aux model needs for joint scoring: prefix + every chunk + the query."""
    return prefix_kv.num_tokens + sum(kv.num_tokens for kv in chunk_kvs) + int(query_ids.numel())


def mean_over_layers(per_layer: dict[int, list[torch.Tensor]]) -> list[torch.Tensor]:
    """{layer: [L_i] per chunk} -> [L_i] per chunk, averaged over the layers."""
    return [torch.stack(chunk).mean(dim=0) for chunk in zip(*per_layer.values())]


def _batched(prefix: torch.Tensor, chunks: list[torch.Tensor], l_max: int, query: torch.Tensor) -> torch.Tensor:
    """[B, H_kv, P + l_max + Q, D] from prefix [H_kv, P, D], chunks [H_kv, L_i, D], query [B, H_kv, Q, D]."""
    b = len(chunks)
    h_kv, p, d = prefix.shape
    out = query.new_zeros((b, h_kv, p + l_max + query.shape[2], d))
    out[:, :, :p] = prefix.to(query.dtype)
    for i, chunk in enumerate(chunks):
        out[i, :, p : p + chunk.shape[1]] = chunk.to(query.dtype)
    out[:, :, p + l_max :] = query
    return out


def _query_to_chunk(
    q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, scale: float, p: int, lens: torch.Tensor,
    head_agg: str = "mean", row_agg: str = "mean",
) -> list[torch.Tensor]:
    """The chunk columns of each batch row of `_query_attention`."""
    probs = _query_attention(q, keys, mask, scale, head_agg, row_agg)
    return [probs[i, p : p + int(n)].cpu() for i, n in enumerate(lens)]


def _query_attention(
    q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, scale: float, head_agg: str = "mean", row_agg: str = "mean",
) -> torch.Tensor:
    """Softmax attention of query rows q [B, H, Q, D] over all visible keys [B, H_kv, N, D]
    (mask [B, 1, Q, N]), aggregated over heads then rows: [B, N] fp32."""
    group = q.shape[1] // keys.shape[1]
    keys = keys.repeat_interleave(group, dim=1)
    logits = torch.matmul(q.float(), keys.float().transpose(-1, -2)) * scale  # [B, H, Q, n_keys]
    logits = logits.masked_fill(~mask, float("-inf"))
    probs = logits.softmax(dim=-1)
    probs = probs.mean(dim=1) if head_agg == "mean" else probs.amax(dim=1)  # [B, Q, n_keys]
    return probs.mean(dim=1) if row_agg == "mean" else probs.amax(dim=1)  # [B, n_keys]


def top_k_candidates(scores: list[torch.Tensor], ratio: float) -> list[torch.Tensor]:
    """Global top k = round(ratio x total tokens) over all chunks; one bool mask per chunk."""
    total = sum(int(s.numel()) for s in scores)
    k = round(ratio * total)
    flat = torch.zeros(total, dtype=torch.bool)
    if k > 0:
        flat[torch.topk(torch.cat(scores), k).indices] = True
    return list(flat.split([int(s.numel()) for s in scores]))


def group_window(candidates: torch.Tensor, window: int, tau: int) -> torch.Tensor:
    """Sliding-window grouping over one chunk's candidate mask [L] -> kept mask [L].

    A window of `window` tokens is evaluated only where it starts on a candidate; it is clipped
    at the sequence end. If it holds at least `tau` candidates, every token in it is kept, gaps
    included. Candidates covered by no passing window are dropped.
    """
    return group_windows(candidates, [int(candidates.numel())], window, tau)


def group_windows(candidates: torch.Tensor, sizes: list[int], window: int, tau: int) -> torch.Tensor:
    """`group_window` of every chunk at once: candidates [sum(sizes)] holds the chunks' masks end
    to end (chunk i has sizes[i] tokens); no window crosses from one chunk into the next.
    Returns the kept mask [sum(sizes)]."""
    n = int(candidates.numel())
    if n == 0:
        return candidates.clone()
    sizes_t = torch.tensor(sizes, dtype=torch.long)
    chunk_start = torch.repeat_interleave(torch.cumsum(sizes_t, 0) - sizes_t, sizes_t)  # [n] first index of its chunk
    chunk_end = chunk_start + torch.repeat_interleave(sizes_t, sizes_t)
    c = torch.cat([torch.zeros(1, dtype=torch.long), candidates.long().cumsum(0)])
    starts = torch.arange(n)
    ends = torch.minimum(starts + window, chunk_end)
    passing = candidates & ((c[ends] - c[starts]) >= tau)
    # Token j is kept if a passing window starts in (j - window, j] within its own chunk.
    s = torch.cat([torch.zeros(1, dtype=torch.long), passing.long().cumsum(0)])
    lo = torch.maximum(starts - window + 1, chunk_start)
    return (s[starts + 1] - s[lo]) > 0


def map_tokens(src_offsets: torch.Tensor, src_selected: torch.Tensor, dst_offsets: torch.Tensor, n_chars: int) -> torch.Tensor:
    """Select every destination token whose character span overlaps a selected source token's span.

    src_offsets [S, 2], src_selected [S] bool, dst_offsets [T, 2] (character spans of the same
    text under two tokenizers). A zero-width span counts as covering its start character.
    Returns [T] bool.
    """
    sel = src_offsets[src_selected].clamp(0, n_chars)
    sel_end = torch.maximum(sel[:, 1], sel[:, 0] + 1)
    diff = torch.zeros(n_chars + 2, dtype=torch.long)  # +1 where a span opens, -1 where it closes
    diff.index_add_(0, sel[:, 0], torch.ones_like(sel[:, 0]))
    diff.index_add_(0, sel_end, -torch.ones_like(sel_end))
    covered = (diff.cumsum(0)[: n_chars + 1] > 0).long()  # [n_chars + 1] character covered?
    cum = torch.cat([torch.zeros(1, dtype=torch.long), covered.cumsum(0)])
    starts = dst_offsets[:, 0].clamp(0, n_chars)
    ends = torch.maximum(dst_offsets[:, 1], dst_offsets[:, 0] + 1).clamp(0, n_chars + 1)
    return (cum[ends] - cum[starts]) > 0


def keep_budget(scores: list[torch.Tensor], ratio: float, window: int, tau: int) -> list[torch.Tensor]:
    """Budget-keeping: the fewest top-scored candidates whose grouped set reaches ratio x tokens.

    Grouping only grows as candidates are added (a window that passes keeps passing and new
    candidates open new windows), so a binary search over the candidate count finds the step
    where the grouped size crosses the target; the side of that step closer to the target is
    returned, so the kept total is within one window of it. Returns one kept mask per chunk.
    """
    sizes = [int(s.numel()) for s in scores]
    total = sum(sizes)
    target = round(ratio * total)
    if target <= 0:
        return [torch.zeros(n, dtype=torch.bool) for n in sizes]
    order = torch.argsort(torch.cat(scores), descending=True, stable=True)

    def grouped(k: int) -> list[torch.Tensor]:
        flat = torch.zeros(total, dtype=torch.bool)
        flat[order[:k]] = True
        return list(group_windows(flat, sizes, window, tau).split(sizes))

    def size(kept: list[torch.Tensor]) -> int:
        return sum(int(m.sum()) for m in kept)

    everything = grouped(total)
    if size(everything) < target:  # chunks shorter than tau can never pass a window
        return everything
    lo, hi = 1, total
    while lo < hi:
        mid = (lo + hi) // 2
        if size(grouped(mid)) >= target:
            hi = mid
        else:
            lo = mid + 1
    over, under = grouped(lo), grouped(lo - 1)
    # One more candidate can add up to two windows of tokens; take whichever side is closer.
    return over if size(over) - target <= target - size(under) else under


def select(
    aux: LoadedModel,
    cfg: SelectConfig,
    ratio: float,
    aux_prefix: ChunkKV,
    aux_chunks: list[ChunkKV],
    query_ids: torch.Tensor,
    budget: str = "keep",
) -> list[ChunkSelection]:
    """Score, pick candidates and group, per chunk, in aux token space. cfg: resolved
    (SelectConfig.resolve), so its scoring layers and aggregations are all set."""
    scores = aux_scores(aux, cfg, aux_prefix, aux_chunks, query_ids)
    if ratio == AUTO:
        ratio = mass_ratio(scores, cfg.auto_share, cfg.auto_floor, cfg.auto_cap)
    return pick(scores, ratio, cfg, budget)


def aux_scores(aux: LoadedModel, cfg: SelectConfig, aux_prefix: ChunkKV, aux_chunks: list[ChunkKV],
               query_ids: torch.Tensor) -> list[torch.Tensor]:
    """One score per aux token of each chunk, as `cfg` (resolved) scores them: [T_i] per chunk."""
    score = score_joint_by_layer if cfg.context == "joint" else score_chunks_by_layer
    per_layer = score(aux, aux_prefix, aux_chunks, query_ids, cfg.score_layers, cfg.head_agg, cfg.row_agg)
    return normalized(mean_over_layers(per_layer), cfg.normalize)


def mass_ratio(scores: list[torch.Tensor], share: float, floor: float, cap: float) -> float:
    """recompute_ratio "auto": the fraction of tokens that the fewest top-scored ones holding
    `share` of the total score mass make up, kept within [floor, cap]. A question whose answer
    sits in one place concentrates its mass on few tokens and recomputes little; one that reads
    several places spreads it and recomputes more."""
    flat = torch.cat(scores).float()
    total = float(flat.sum())
    if flat.numel() == 0 or total <= 0:
        return cap
    cum = torch.cumsum(torch.sort(flat, descending=True).values, 0)
    needed = int(torch.searchsorted(cum, share * total).item()) + 1
    return min(max(needed / flat.numel(), floor), cap)


def normalized(scores: list[torch.Tensor], how: str) -> list[torch.Tensor]:
    """"chunk": each chunk's scores rescaled to sum 1; "none": as they are."""
    if how == "chunk":
        return [s / s.sum() if s.sum() > 0 else s for s in scores]
    return scores


def pick(scores: list[torch.Tensor], ratio: float, cfg: SelectConfig, budget: str = "keep") -> list[ChunkSelection]:
    """Scores -> candidates -> kept tokens, under the paper's rule or budget-keeping."""
    if budget == "keep":
        kept = keep_budget(scores, ratio, cfg.window, cfg.tau)
        return [ChunkSelection(s, k.clone(), k) for s, k in zip(scores, kept)]
    candidates = top_k_candidates(scores, ratio)
    sizes = [int(c.numel()) for c in candidates]
    kept = group_windows(torch.cat(candidates), sizes, cfg.window, cfg.tau).split(sizes)
    return [ChunkSelection(s, c, k) for s, c, k in zip(scores, candidates, kept)]


@torch.inference_mode()
def attention_from_rows(lm: LoadedModel, input_ids: torch.Tensor, rows: torch.Tensor, layers: list[int],
                        heads: str = "mean") -> dict[int, torch.Tensor]:
    """Full prefill of input_ids [N]; at each layer, the attention of `rows` over all N keys,
    averaged over rows and reduced over heads by `heads` ("mean" or "max"): {layer: [N]}. Used
    by the oracle mode and by calibration."""
    fam = lm.family
    wanted = sorted({layer % lm.num_layers for layer in layers})
    captured: dict[int, torch.Tensor] = {}

    def hook(i):
        def capture(module, args, kwargs):
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            captured[i] = hidden[:, rows].clone()

        return capture

    handles = [fam.layers[i].register_forward_pre_hook(hook(i), with_kwargs=True) for i in wanted]
    try:
        out = fam.prefill(input_ids)
    finally:
        for handle in handles:
            handle.remove()
    result = {}
    for i in wanted:
        h = captured[i]
        q, _, _ = fam.qkv(i, h, fam.rope(h, rows[None].to(lm.device)))
        result[i] = rows_attention(lm, i, q, out.cache.layers[i].keys, rows, input_ids.numel(), heads).cpu()
    return {layer: result[layer % lm.num_layers] for layer in layers}


def rows_attention(lm: LoadedModel, layer: int, q: torch.Tensor, keys: torch.Tensor, rows: torch.Tensor,
                   n_keys: int, heads: str = "mean") -> torch.Tensor:
    """The attention of query rows over the first n_keys keys of one layer, as the layer attends
    (causal by sequence index, within its sliding window, its scaling), averaged over rows and
    reduced over query heads by `heads` ("mean" or "max"): [n_keys] fp32.
    q: [1, Hq, R, D] rotated; keys: [1, Hkv, >= n_keys, D]; rows: [R]."""
    h, h_kv, r, d = q.shape[1], keys.shape[1], q.shape[2], q.shape[3]
    group = h // h_kv  # query head i reads key head i // group (transformers' repeat_kv), so the
    # query heads sharing a key head are consecutive: one batched matmul per key head, no copy of
    # the keys per query head (7x fewer keys converted to fp32 for the default primary)
    k = keys[0, :, :n_keys].float()  # [Hkv, N, D]
    logits = torch.bmm(q[0].float().reshape(h_kv, group * r, d), k.transpose(1, 2)) * lm.family.scaling(layer)
    visible = causal_position_mask(rows[None], n_keys, lm.family.window(layer)).to(logits.device)[0]  # [1, R, N]
    logits = logits.view(h_kv, group, r, n_keys).masked_fill(~visible, float("-inf"))
    per_head = logits.softmax(dim=-1).mean(dim=2)  # [Hkv, group, N]
    return per_head.mean(dim=(0, 1)) if heads == "mean" else per_head.amax(dim=(0, 1))


# ----- character space (token weights of two tokenizers compared on one text) ----------------

def to_chars(weights: torch.Tensor, offsets: torch.Tensor, n_chars: int) -> torch.Tensor:
    """Token weights [T] -> character weights [n_chars] (fp64): each token's weight spread evenly
    over its characters (offsets [T, 2]); characters beyond n_chars are cut."""
    starts = offsets[:, 0].clamp(0, n_chars)
    ends = offsets[:, 1].clamp(0, n_chars)
    ok = ends > starts
    per_char = weights.double()[ok] / (ends - starts)[ok]
    diff = torch.zeros(n_chars + 1, dtype=torch.float64)  # + where a token's span opens, - where it closes
    diff.index_add_(0, starts[ok], per_char)
    diff.index_add_(0, ends[ok], -per_char)
    return diff.cumsum(0)[:n_chars]


def top_positions(x: torch.Tensor, frac: float) -> set[int]:
    """Indices of the top `frac` of x (at least one; ties broken by position)."""
    k = max(1, int(frac * x.numel()))
    return set(torch.argsort(x, descending=True, stable=True)[:k].tolist())


def top_jaccard(a: torch.Tensor, b: torch.Tensor, frac: float = 0.2) -> float:
    sa, sb = top_positions(a, frac), top_positions(b, frac)
    return len(sa & sb) / len(sa | sb)
