"""KV Packet (arXiv, `shared/papers/kv-packet-paper.md`): trainable boundary adapters around each chunk.

A packet is a chunk wrapped at the embedding level as [header, chunk, trailer], where header and
trailer are N_h and N_t trainable vectors shared by every chunk. Its cache is precomputed after
the shared prefix like a plain chunk's; at request time packet caches are concatenated with keys
re-rotated to their place and nothing in them is recomputed.

This module holds the adapters and the two forms of a packet request that training relies on:

- sequential (`packet_cache`): each packet prefilled alone after the prefix, as serving does;
- parallel (`student_logits`): one layer-by-layer pass over [prefix, packets..., tail] where each
  packet sees the prefix and itself at the positions it is cached at, and the tail (query and
  generated tokens) sees every packet's keys re-rotated to their place. It equals the sequential
  form (tested) and is differentiable in the adapters, which is what self-distillation trains.

Shapes: hidden rows [M, hidden]; K/V per layer [1, H_kv, N, D].
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .assemble import rerotate
from .encode import layers_kv
from .models import LoadedModel
from .store import ChunkKV

SOFT_TOKEN = -1
"""The token id recorded for a header or trailer row (it has an embedding, not a token)."""


@dataclass
class Adapters:
    """header [N_h, hidden] and trailer [N_t, hidden], float32 (trained; cast to the model dtype)."""

    header: torch.Tensor
    trailer: torch.Tensor

    @classmethod
    def initial(cls, lm: LoadedModel, n_header: int = 8, n_trailer: int = 8, seed: int = 0) -> Adapters:
        """Random vectors at the scale of the model's token embeddings (as `Family.embed` gives them)."""
        for name, n in (("n_header", n_header), ("n_trailer", n_trailer)):
            if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= 256:
                raise ValueError(f"{name} must be an integer in [0, 256], got {n!r}")
        g = torch.Generator().manual_seed(seed)
        sample = torch.randint(0, lm.config.vocab_size, (256,), generator=g)
        with torch.no_grad():
            scale = lm.family.embed(sample.to(lm.device)).float().std().item()
        hidden = lm.config.hidden_size
        return cls(torch.randn(n_header, hidden, generator=g) * scale, torch.randn(n_trailer, hidden, generator=g) * scale)

    @property
    def extra_rows(self) -> int:
        return int(self.header.shape[0] + self.trailer.shape[0])

    def digest(self) -> str:
        """Content hash: packet caches are valid only for the adapters that made them."""
        h = hashlib.sha256()
        for t in (self.header, self.trailer):
            t = t.detach().to(torch.float32).contiguous().cpu()
            h.update(str(tuple(t.shape)).encode())
            h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        return h.hexdigest()[:32]


def wrap(lm: LoadedModel, adapters: Adapters, ids: torch.Tensor) -> torch.Tensor:
    """Embeddings [N_h + T + N_t, hidden] of one packet (differentiable in the adapters)."""
    dtype = lm.dtype
    body = lm.family.embed(ids.to(lm.device))
    return torch.cat([adapters.header.to(lm.device, dtype), body, adapters.trailer.to(lm.device, dtype)])


@torch.inference_mode()
def packet_cache(lm: LoadedModel, adapters: Adapters, prefix_ids: torch.Tensor, ids: torch.Tensor,
                 offsets: torch.Tensor) -> ChunkKV:
    """The sequential form: prefill prefix + packet; keep the packet's rows (keys rotated for
    positions [P, P + N_h + T + N_t)). Soft rows carry token id SOFT_TOKEN and an empty span."""
    embeds = torch.cat([lm.family.embed(prefix_ids.to(lm.device)), wrap(lm, adapters, ids)])
    keys, values = layers_kv(lm.family.prefill(None, embeds=embeds).cache, int(prefix_ids.numel()))
    n_h, n_t = int(adapters.header.shape[0]), int(adapters.trailer.shape[0])
    token_ids = torch.cat([torch.full((n_h,), SOFT_TOKEN), ids.cpu(), torch.full((n_t,), SOFT_TOKEN)])
    spans = torch.cat([torch.zeros(n_h, 2, dtype=torch.long), offsets.cpu(), offsets[-1:].cpu().expand(n_t, 2).clone()])
    if n_h:
        spans[:n_h] = offsets[:1].cpu()
    return ChunkKV(keys, values, token_ids, spans, start_pos=int(prefix_ids.numel()))


def student_logits(lm: LoadedModel, adapters: Adapters, prefix_ids: torch.Tensor, docs: list[torch.Tensor],
                   tail_ids: torch.Tensor) -> torch.Tensor:
    """The parallel form: logits [len(tail) , vocab] (fp32) after each tail token of
    [prefix, packet(doc_1), ..., packet(doc_M), tail], each packet seeing the prefix and itself
    at its cached positions, the tail seeing everything with packets re-rotated into place.
    Differentiable in `adapters` (call under `torch.enable_grad`)."""
    fam, dev = lm.family, lm.device
    p = int(prefix_ids.numel())
    embeds = [fam.embed(prefix_ids.to(dev))]
    local, shift, block = [torch.arange(p)], [torch.zeros(p, dtype=torch.long)], [torch.zeros(p, dtype=torch.long)]
    start = p
    for i, ids in enumerate(docs):
        rows = wrap(lm, adapters, ids)
        n = int(rows.shape[0])
        embeds.append(rows)
        local.append(torch.arange(p, p + n))
        shift.append(torch.full((n,), start - p))
        block.append(torch.full((n,), i + 1))
        start += n
    q = int(tail_ids.numel())
    embeds.append(fam.embed(tail_ids.to(dev)))
    local.append(torch.arange(start, start + q))
    shift.append(torch.zeros(q, dtype=torch.long))
    block.append(torch.full((q,), -1))
    h = torch.cat(embeds)[None]  # [1, N, hidden]
    local_pos, delta, blocks = torch.cat(local), torch.cat(shift), torch.cat(block)
    n_all = int(h.shape[1])
    idx = torch.arange(n_all)
    # Rows before the tail: causal within their own block, plus the prefix (block 0).
    same = (blocks[:, None] == blocks[None, :]) | (blocks[None, :] == 0)
    inner = (same & (idx[None, :] <= idx[:, None]))[: n_all - q]
    causal = (idx[None, :] <= idx[:, None])[n_all - q :]  # the tail: everything before it
    inner, causal = inner[None, None].to(dev), causal[None, None].to(dev)
    rope = fam.rope(h, local_pos[None].to(dev))
    for layer in range(len(fam.layers)):
        qs, k, v = fam.qkv(layer, h, rope)
        scale, gqa = fam.scaling(layer), qs.shape[1] != k.shape[1]
        if fam.window(layer) is not None:
            raise ValueError("packet training on sliding-window layers is not supported yet")
        placed = rerotate(k, delta, fam.inv_freq(layer))
        out_inner = F.scaled_dot_product_attention(qs[:, :, : n_all - q], k, v, attn_mask=inner, scale=scale, enable_gqa=gqa)
        out_tail = F.scaled_dot_product_attention(qs[:, :, n_all - q :], placed, v, attn_mask=causal, scale=scale, enable_gqa=gqa)
        h = fam.finish(layer, h, torch.cat([out_inner, out_tail], dim=2))
    return fam.logits(h[:, n_all - q :])[0].float()
