"""What a decoder family is to the recompute path: its layers, driven on any subset of rows.

Selective recompute, the aux model's query pass and the calibration oracle all run a decoder
layer by layer on scattered rows against a cache we assemble ourselves, so they cannot call the
model's own forward. A `Family` is the one place that knows how a family's layers are put
together: which RoPE each layer uses (several thetas per model), which layers attend through a
sliding window, where the norms sit, how embeddings are scaled and how logits are finished.
Everything else asks the family; nothing tests a model by `hasattr`.

The base class is the Llama layout (pre-norm, one RoPE, full attention everywhere, GQA through
the kv-head count); each family file overrides only what differs. The submodules are
transformers' own, so weights and numerics are the model's.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

FULL, SLIDING = "full_attention", "sliding_attention"

Rope = dict[str, tuple[torch.Tensor, torch.Tensor]]
"""cos, sin [B, M, head_dim] per layer type (one entry per distinct RoPE in the model)."""


class Family:
    """Drives one transformers causal LM of a family layer by layer.

    Subclass per family: set `model_types` (transformers' `config.model_type` values) and
    `qk_norm`, override what differs, and add the class to `families.FAMILIES`.
    """

    model_types: ClassVar[tuple[str, ...]] = ()
    qk_norm: ClassVar[bool] = False
    """Per-head RMS norms on q and k before RoPE (Qwen3, Gemma 3)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.config = model.config
        self.base: nn.Module = model.model
        self.layers: nn.ModuleList = self.base.layers
        self.layer_types: tuple[str, ...] = tuple(self._layer_types())
        if len(self.layer_types) != len(self.layers):
            raise ValueError(f"{type(self).__name__}: {len(self.layer_types)} layer types for {len(self.layers)} layers")
        self.check()

    # ----- structure ---------------------------------------------------------------------------

    def _layer_types(self) -> list[str]:
        """Per layer, FULL or SLIDING. Default: the config's `layer_types`, else all full."""
        return list(getattr(self.config, "layer_types", None) or [FULL] * len(self.layers))

    def check(self) -> None:
        """Refuse a configuration this adapter would compute wrongly (override to add checks)."""
        if getattr(self.config, "attn_logit_softcapping", None):
            raise ValueError(f"{self.config.model_type}: attention logit soft-capping is not supported")

    @property
    def head_dim(self) -> int:
        cfg = self.config
        return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads

    def window(self, layer: int) -> int | None:
        """Sliding window of layer `layer` (a row sees keys at index distance < window), or None."""
        if self.layer_types[layer] == SLIDING and getattr(self.config, "sliding_window", None):
            return int(self.config.sliding_window)
        return None

    def scaling(self, layer: int) -> float:
        """The attention's logit scale (1/sqrt(head_dim), or the family's own)."""
        return float(self.layers[layer].self_attn.scaling)

    # ----- RoPE -------------------------------------------------------------------------------

    def inv_freq(self, layer: int) -> torch.Tensor:
        """[head_dim / 2] RoPE frequencies of layer `layer` (what re-rotating its keys needs)."""
        return self.base.rotary_emb.inv_freq

    def rope(self, like: torch.Tensor, positions: torch.Tensor) -> Rope:
        """cos, sin for positions [B, M] per layer type, exactly as the model's own forward."""
        cos_sin = self.base.rotary_emb(like, positions)
        return {t: cos_sin for t in set(self.layer_types)}

    # ----- one layer on a subset of rows --------------------------------------------------------

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids [..., M] -> hidden rows [..., M, hidden] (with the family's scaling)."""
        return self.base.embed_tokens(ids)

    def qkv(self, layer: int, h: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Hidden rows h [B, M, hidden] -> rotated q [B, H, M, D] and k, v [B, H_kv, M, D]."""
        block = self.layers[layer]
        attn = block.self_attn
        x = block.input_layernorm(h)
        shape = (*x.shape[:2], -1, attn.head_dim)
        q, k = attn.q_proj(x).view(shape), attn.k_proj(x).view(shape)
        v = attn.v_proj(x).view(shape).transpose(1, 2)
        if self.qk_norm:
            q, k = attn.q_norm(q), attn.k_norm(k)
        cos, sin = rope[self.layer_types[layer]]
        q, k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        return q, k, v

    def finish(self, layer: int, h: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Output projection, residual and MLP block (pre-norm). attn_out [B, H, M, D] -> h."""
        block = self.layers[layer]
        h = h + block.self_attn.o_proj(merge_heads(attn_out))
        return h + block.mlp(block.post_attention_layernorm(h))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: h [B, M, hidden] -> logits [B, M, vocab]."""
        out = self.model.lm_head(self.base.norm(h))
        cap = getattr(self.config, "final_logit_softcapping", None)
        return torch.tanh(out / cap) * cap if cap else out

    # ----- whole-sequence prefill -------------------------------------------------------------

    def prefill(self, input_ids: torch.Tensor | None, positions: torch.Tensor | None = None, embeds: torch.Tensor | None = None):
        """The model's own forward over input_ids [N] (or input embeddings [N, hidden], as
        `embed` makes them) keeping every row of every layer's K/V.

        transformers' default cache keeps only the last window of a sliding layer; chunk caches
        and the oracle need all rows, so the cache here is one without a config.
        Returns the base model's output (`.cache.layers[l].keys` is [1, H_kv, N, D]).
        """
        dev = self.model.device
        pos = None if positions is None else positions.reshape(1, -1).to(dev)
        if embeds is not None:
            return self.base(inputs_embeds=embeds[None].to(dev), position_ids=pos, cache=DynamicCache(), use_cache=True)
        return self.base(input_ids=input_ids.reshape(1, -1).to(dev), position_ids=pos, cache=DynamicCache(), use_cache=True)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """[B, H, M, D] -> [B, M, H * D]."""
    b, _, m, _ = x.shape
    return x.transpose(1, 2).reshape(b, m, -1)
