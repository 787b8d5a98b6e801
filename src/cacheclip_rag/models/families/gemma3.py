"""Gemma 3 (text): the family that differs most from Llama.

- RoPE per layer type: local (sliding) layers use one theta, global layers another; the
  rotary module holds `<type>_inv_freq` and takes the layer type as an argument.
- Sliding-window layers (5 local : 1 global in the released models) from `config.layer_types`.
- Sandwich norms: the attention output and the MLP output are normed before each residual
  add, besides the usual pre-norms; q and k get per-head RMS norms before RoPE.
- Embeddings scaled by sqrt(hidden_size) (inside transformers' scaled embedding module) and
  the logit scale is query_pre_attn_scalar^-0.5 (the attention module's `scaling`).
- Optional final logit soft-capping (in `Family.logits`); attention soft-capping is refused.
"""

import torch

from .base import Family, Rope, merge_heads


class Gemma3(Family):
    model_types = ("gemma3_text",)
    qk_norm = True

    def inv_freq(self, layer: int) -> torch.Tensor:
        return getattr(self.base.rotary_emb, f"{self.layer_types[layer]}_inv_freq")

    def rope(self, like: torch.Tensor, positions: torch.Tensor) -> Rope:
        return {t: self.base.rotary_emb(like, positions, t) for t in set(self.layer_types)}

    def finish(self, layer: int, h: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        block = self.layers[layer]
        h = h + block.post_attention_layernorm(block.self_attn.o_proj(merge_heads(attn_out)))
        return h + block.post_feedforward_layernorm(block.mlp(block.pre_feedforward_layernorm(h)))
