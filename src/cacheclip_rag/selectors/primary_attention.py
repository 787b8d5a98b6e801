"""Probes of the primary model's own attention: where the rows of a sequence look.

ProphetKV reads the question's attention over the assembled cache with `rows_attention`; the
attention oracle and calibration read a full prefill's with `attention_from_rows`.
"""

from __future__ import annotations

import torch
from cacheclip_kernels import causal_position_mask

from ..models.loading import LoadedModel


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
