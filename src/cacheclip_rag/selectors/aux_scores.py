"""The aux model's forward passes that score chunk tokens for CacheClip.

For each retrieved chunk i the aux model reuses its own cache of [prefix + chunk_i] and computes
only the query rows of [prefix + chunk_i + query]; all chunks run as one padded batch. At the
scoring layer the attention of the query rows over the chunk's tokens (prefix and query columns
excluded, softmax over the whole row) is averaged over rows and heads: one score per aux token.
With context "joint" the query rows run once over every chunk at its assembled position instead
(`score_joint_by_layer`). What is kept from the scores is `budget.py`'s job.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from cacheclip_kernels import causal_position_mask

from ..config import SelectConfig
from ..models.loading import LoadedModel
from ..models.rope import rerotate
from ..request.profile_source import scoring_layers
from ..storage.record import ChunkKV


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


def aux_scores(aux: LoadedModel, cfg: SelectConfig, aux_prefix: ChunkKV, aux_chunks: list[ChunkKV],
               query_ids: torch.Tensor) -> list[torch.Tensor]:
    """One score per aux token of each chunk, as `cfg` (resolved) scores them: [T_i] per chunk."""
    score = score_joint_by_layer if cfg.context == "joint" else score_chunks_by_layer
    per_layer = score(aux, aux_prefix, aux_chunks, query_ids, cfg.score_layers, cfg.head_agg, cfg.row_agg)
    return normalized(mean_over_layers(per_layer), cfg.normalize)


def normalized(scores: list[torch.Tensor], how: str) -> list[torch.Tensor]:
    """"chunk": each chunk's scores rescaled to sum 1; "none": as they are."""
    if how == "chunk":
        return [s / s.sum() if s.sum() > 0 else s for s in scores]
    return scores
