"""Selective recompute: run chosen rows through the primary model, layer by layer, in context.

The rows (selected chunk tokens, every uncached segment, the question) are computed at their
full-context positions. At each layer their new K/V are written into the assembled cache first,
then each row attends causally, by absolute position, to the whole cache, where rows recomputed
at this layer already hold their new K/V. With every non-prefix row selected this is exactly a
full prefill; with only the uncached rows it is exactly direct reuse.

The decoder layers are driven through their own submodules (norms, projections, MLP), so the
weights and numerics are transformers' own; only the attention call is ours, behind `attend`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from cacheclip_kernels import sparse_query_attention, sparse_query_attention_ref

from .models import LoadedModel


@dataclass
class AssembledCache:
    """Per-layer K/V for one request's whole token sequence.

    keys[l], values[l]: [1, kv_heads, N, head_dim] in the model dtype, preallocated once.
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @property
    def num_tokens(self) -> int:
        return int(self.keys[0].shape[2])

    @classmethod
    def empty(cls, lm: LoadedModel, n_tokens: int) -> AssembledCache:
        cfg = lm.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        shape = (1, cfg.num_key_value_heads, n_tokens, head_dim)
        keys = [torch.zeros(shape, dtype=lm.dtype, device=lm.device) for _ in range(lm.num_layers)]
        values = [torch.zeros(shape, dtype=lm.dtype, device=lm.device) for _ in range(lm.num_layers)]
        return cls(keys, values)


def decoder(lm: LoadedModel) -> nn.Module:
    """The base model (embeddings, layers, final norm, rotary embedding) without the LM head."""
    return lm.model.model


def rope(lm: LoadedModel, like: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, M, head_dim] for positions [B, M], exactly as the model's own forward."""
    return decoder(lm).rotary_emb(like, positions)


def layer_qkv(
    layer: nn.Module, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Project hidden rows h [B, M, hidden] to rotated q [B, H, M, D] and k, v [B, H_kv, M, D]."""
    attn = layer.self_attn
    x = layer.input_layernorm(h)
    b, m, _ = x.shape
    shape = (b, m, -1, attn.head_dim)
    q = attn.q_proj(x).view(shape)
    k = attn.k_proj(x).view(shape)
    v = attn.v_proj(x).view(shape).transpose(1, 2)
    if hasattr(attn, "q_norm"):  # Qwen3-style per-head norms, applied before RoPE
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    return q, k, v


def layer_finish(layer: nn.Module, h: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
    """Output projection, residual and MLP block. attn_out [B, H, M, D] -> new h [B, M, hidden]."""
    b, _, m, _ = attn_out.shape
    h = h + layer.self_attn.o_proj(attn_out.transpose(1, 2).reshape(b, m, -1))
    return h + layer.mlp(layer.post_attention_layernorm(h))


BACKENDS = ("auto", "torch", "triton")


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float, backend: str = "auto"
) -> torch.Tensor:
    """Sparse-query attention: each row sees keys at positions <= its own. Shapes as the kernel's.

    backend "auto" runs the Triton kernel on CUDA tensors and the torch reference elsewhere;
    "torch" and "triton" force one (triton on CPU works only under TRITON_INTERPRET=1).
    """
    if backend == "triton" or (backend == "auto" and q.is_cuda):
        return sparse_query_attention(q, k, v, q_pos, scale=scale)
    return sparse_query_attention_ref(q, k, v, q_pos, scale=scale)


@torch.inference_mode()
def recompute_rows(
    lm: LoadedModel, cache: AssembledCache, input_ids: torch.Tensor, rows: torch.Tensor, backend: str = "auto"
) -> torch.Tensor:
    """Recompute `rows` of the request in place in `cache`; return the last row's logits.

    input_ids: [N] the request's tokens. rows: [M] sorted unique positions; must end at N - 1
    (the question is never cached). Returns logits [vocab] for the token after position N - 1.
    """
    n = cache.num_tokens
    assert input_ids.shape == (n,), f"input_ids {tuple(input_ids.shape)} vs cache of {n} tokens"
    assert rows.numel() > 0 and int(rows[-1]) == n - 1, "the last position must be recomputed"
    base = decoder(lm)
    rows = rows.to(lm.device)
    pos = rows[None]  # [1, M]
    h = base.embed_tokens(input_ids.to(lm.device)[rows])[None]  # [1, M, hidden]
    cos, sin = rope(lm, h, pos)
    for layer_idx, layer in enumerate(base.layers):
        q, k, v = layer_qkv(layer, h, cos, sin)
        cache.keys[layer_idx][:, :, rows] = k
        cache.values[layer_idx][:, :, rows] = v
        out = attend(q, cache.keys[layer_idx], cache.values[layer_idx], pos, layer.self_attn.scaling, backend)
        h = layer_finish(layer, h, out)
    last = base.norm(h[:, -1:])
    return lm.model.lm_head(last)[0, -1].float()
