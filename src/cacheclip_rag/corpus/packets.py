"""KV Packet ("KV Packet: Recomputation-Free Context-Independent KV Caching for LLMs", arXiv:2604.13226):
trainable boundary adapters around each chunk.

A packet is a chunk wrapped at the embedding level as [header, chunk, trailer], where header and
trailer are N_h and N_t trainable vectors shared by every chunk. Its cache is precomputed after
the shared prefix like a plain chunk's; at request time packet caches are concatenated with keys
re-rotated to their place and nothing in them is recomputed.

This module holds the adapters and the two forms of a packet request that training relies on:

- sequential (`packet_cache`): each packet prefilled alone after the prefix, as serving does;
- parallel (`student_logits`): one layer-by-layer pass over [prefix, packets..., tail] where each
  packet sees the prefix and itself at the positions it is cached at, and the tail (query and
  generated tokens) sees every packet's keys re-rotated to their place; optionally with fresh
  copies of picked rows recomputed in place, as `packet+cacheclip` serves them. It equals the
  sequential form (tested) and is differentiable in the adapters, which is what
  self-distillation trains.

Shapes: hidden rows [M, hidden]; K/V per layer [1, H_kv, N, D].
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open

from ..models.loading import EMBEDDED, LoadedModel
from ..models.rope import rerotate
from ..storage.record import ChunkKV
from .encode import layers_kv

SOFT_TOKEN = -1
"""Soft rows (header and trailer vectors) have no token; they are recorded with negative ids:
header row i is SOFT_TOKEN - i, trailer row j is SOFT_TOKEN - N_h - j, so an id names its
vector (`embed`) and can never be mistaken for a vocabulary token."""


@dataclass
class PacketAdapters:
    """header [N_h, hidden] and trailer [N_t, hidden], float32 (trained; cast to the model dtype)."""

    header: torch.Tensor
    trailer: torch.Tensor

    @classmethod
    def initial(cls, lm: LoadedModel, n_header: int = 8, n_trailer: int = 8, seed: int = 0) -> PacketAdapters:
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

    @property
    def shape(self) -> tuple[int, int]:
        """(N_h, N_t)."""
        return int(self.header.shape[0]), int(self.trailer.shape[0])

    def soft_ids(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The ids recorded for the header rows [N_h] and the trailer rows [N_t]."""
        n_h, n_t = self.shape
        return SOFT_TOKEN - torch.arange(n_h), SOFT_TOKEN - n_h - torch.arange(n_t)

    def digest(self) -> str:
        """Content hash: packet caches are valid only for the adapters that made them."""
        h = hashlib.sha256()
        for t in (self.header, self.trailer):
            t = t.detach().to(torch.float32).contiguous().cpu()
            h.update(str(tuple(t.shape)).encode())
            h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
        return h.hexdigest()[:32]


ADAPTER_KIND = "cacheclip-kv-packet-adapters"
"""The `kind` an adapter file's metadata carries."""

SHIPPED_DIR = Path(__file__).parent.parent / "data" / "packets"
SHIPPED: dict[str, tuple[str, str]] = {
    # `cacheclip train packet --out adapters.safetensors` (defaults; float32; 3,621 s on 2 cores,
    # no native bf16): held-out KL 0.2463 (initial vectors) -> 0.1054 after 3 epochs. docs/training.md.
    "qwen2.5-coder-0.5b-instruct": ("qwen2.5-coder-0.5b-instruct.safetensors",
                                    "7f2e5c700feef27e2f92170fff274c6e1d2380e9c8a0c0f605d59890a458f2f8"),
}
"""Embedded model name -> (adapter file in the package, the file's pinned sha256). Reproduce with
the command in `docs/training.md`."""


def shipped_adapters(lm: LoadedModel) -> Path | None:
    """The package's adapter file for `lm` (an embedded model), or None."""
    entry = SHIPPED.get(lm.name)
    return SHIPPED_DIR / entry[0] if entry else None


def resolve_adapters(spec: str | None, lm: LoadedModel) -> PacketAdapters | None:
    """The adapters a config names: "auto" the shipped ones for `lm` (None when there are none),
    None no adapters, else a file path (a ValueError if it is missing, damaged or foreign)."""
    if spec is None:
        return None
    if spec == "auto":
        path = shipped_adapters(lm)
        if path is None:
            return None
        expected = SHIPPED[lm.name][1]
        if not path.is_file():
            raise ValueError(f"{path}: the shipped KV Packet adapters are missing from the installed package "
                             f"(expected sha256 {expected}); reinstall it, or set EngineConfig.packets=None")
        actual = hashlib.sha256(path.read_bytes()).hexdigest()
        if actual != expected:
            raise ValueError(f"{path}: the shipped adapters hash to {actual}, pinned {expected}; reinstall the package")
        return load_adapters(path, lm)
    if not Path(spec).is_file():
        raise ValueError(f"KV Packet adapters {spec!r}: no such file (expected a .safetensors file written by "
                         "`cacheclip train packet`, or 'auto' / None)")
    return load_adapters(spec, lm)


def load_adapters(path: str | Path, lm: LoadedModel) -> PacketAdapters:
    """PacketAdapters saved for `lm`; a damaged file, or one trained for another model, is a ValueError
    naming the file and what was expected. An embedded model's adapters serve it in any dtype
    (its name pins its weights); any other model's must match its weights fingerprint."""
    path = Path(path)
    try:
        with safe_open(str(path), framework="pt") as fh:
            meta = fh.metadata() or {}
            header, trailer = fh.get_tensor("header"), fh.get_tensor("trailer")
    except Exception as err:  # noqa: BLE001 - any parse failure means a damaged file
        raise ValueError(f"{path}: not a readable KV Packet adapter file ({err})") from err
    if meta.get("kind") != ADAPTER_KIND:
        raise ValueError(f"{path}: expected KV Packet adapters (metadata kind {ADAPTER_KIND!r}), got {meta.get('kind')!r}")
    same_weights = meta.get("fingerprint") == lm.fingerprint or (lm.name in EMBEDDED and meta.get("model") == lm.name)
    if not same_weights:
        raise ValueError(f"{path}: adapters for model {meta.get('model')!r} (fingerprint {meta.get('fingerprint')!r}); "
                         f"this model is {lm.name!r} ({lm.fingerprint!r})")
    if header.ndim != 2 or trailer.ndim != 2 or header.shape[-1] != lm.config.hidden_size \
            or trailer.shape[-1] != lm.config.hidden_size:
        raise ValueError(f"{path}: adapters of shape {tuple(header.shape)} / {tuple(trailer.shape)}, expected "
                         f"[N, {lm.config.hidden_size}] (the model's hidden size)")
    adapters = PacketAdapters(header.to(torch.float32), trailer.to(torch.float32))
    if adapters.digest() != meta.get("sha256"):
        raise ValueError(f"{path}: adapter tensors hash to {adapters.digest()}, the file records {meta.get('sha256')!r}")
    return adapters


def wrap(lm: LoadedModel, adapters: PacketAdapters, ids: torch.Tensor) -> torch.Tensor:
    """Embeddings [N_h + T + N_t, hidden] of one packet (differentiable in the adapters)."""
    dtype = lm.dtype
    body = lm.family.embed(ids.to(lm.device))
    return torch.cat([adapters.header.to(lm.device, dtype), body, adapters.trailer.to(lm.device, dtype)])


def wrap_ids(adapters: PacketAdapters, ids: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A chunk's token ids [T] and character spans [T, 2] as a packet's: [N_h + T + N_t] ids with
    the soft ids around them, and spans where the soft rows are empty (at the chunk's first and
    last character), so no text maps to them."""
    head, tail = adapters.soft_ids()
    ids, offsets = ids.cpu(), offsets.cpu().to(torch.long)
    start = offsets[:1, :1] if offsets.numel() else torch.zeros(1, 1, dtype=torch.long)
    end = offsets[-1:, 1:] if offsets.numel() else start
    spans = torch.cat([start.expand(head.numel(), 2), offsets, end.expand(tail.numel(), 2)])
    return torch.cat([head, ids.to(torch.long), tail]), spans


def embed(lm: LoadedModel, adapters: PacketAdapters, ids: torch.Tensor) -> torch.Tensor:
    """Embeddings [M, hidden] of request rows by id: vocabulary tokens through the model,
    soft ids (< 0) as their adapter vectors."""
    soft = ids < 0
    if not bool(soft.any()):
        return lm.family.embed(ids)
    vectors = torch.cat([adapters.header, adapters.trailer]).to(ids.device, lm.dtype)  # [N_h + N_t, hidden]
    index = (SOFT_TOKEN - ids).clamp(min=0)
    if int(index.max()) >= vectors.shape[0]:
        raise ValueError(f"soft row id {int(ids.min())} is beyond these adapters' {vectors.shape[0]} vectors")
    plain = lm.family.embed(torch.where(soft, torch.zeros_like(ids), ids))
    return torch.where(soft[:, None], vectors[index], plain)


@torch.inference_mode()
def packet_cache(lm: LoadedModel, adapters: PacketAdapters, prefix_ids: torch.Tensor, ids: torch.Tensor,
                 offsets: torch.Tensor) -> ChunkKV:
    """The sequential form: prefill prefix + packet; keep the packet's rows (keys rotated for
    positions [P, P + N_h + T + N_t)), recorded with `wrap_ids`'s ids and spans."""
    embeds = torch.cat([lm.family.embed(prefix_ids.to(lm.device)), wrap(lm, adapters, ids)])
    keys, values = layers_kv(lm.family.prefill(None, embeds=embeds).cache, int(prefix_ids.numel()))
    token_ids, spans = wrap_ids(adapters, ids, offsets)
    return ChunkKV(keys, values, token_ids, spans, start_pos=int(prefix_ids.numel()))


def student_logits(lm: LoadedModel, adapters: PacketAdapters, prefix_ids: torch.Tensor, docs: list[torch.Tensor],
                   tail_ids: torch.Tensor, *, between: torch.Tensor | None = None,
                   picked: list[torch.Tensor] | None = None) -> torch.Tensor:
    """The parallel form: logits [len(tail), vocab] (fp32) after each tail token of
    [prefix, packet(doc_1), between, packet(doc_2), ..., packet(doc_M), tail].

    Two sets of rows go through the layers side by side:

    - the isolated rows (prefix and packets): each packet sees the prefix and itself at the
      positions it is cached at, as `packet_cache` computes it;
    - the recomputed rows, at their global positions: every plain-text row (`between`, the
      separator the served prompt puts between chunks, and the tail) and, with `picked`, a fresh
      copy of the picked text rows of each packet (picked[i]: indices [K_i] into doc i's tokens,
      as CacheClip's selection marks them). They see every row before them: the isolated rows
      re-rotated into place, except where a fresh copy replaces one.

    That is the served `packet+cacheclip` request (packet caches assembled, the picked rows and
    the plain text recomputed) in one differentiable pass (call under `torch.enable_grad`); with
    picked=None it is `packet` (nothing but plain text recomputed). Tested equal to both.
    """
    fam, dev = lm.family, lm.device
    p, n_h = int(prefix_ids.numel()), adapters.shape[0]
    if picked is not None and len(picked) != len(docs):
        raise ValueError(f"picked must hold one index tensor per document ({len(docs)}), got {len(picked)}")
    iso_rows, local, place, block = [fam.embed(prefix_ids.to(dev))], [torch.arange(p)], [torch.arange(p)], [torch.zeros(p, dtype=torch.long)]
    fresh_rows, fresh_pos = [], []
    start = p

    def plain(ids: torch.Tensor) -> None:
        nonlocal start
        fresh_rows.append(fam.embed(ids.to(dev)))
        fresh_pos.append(torch.arange(start, start + int(ids.numel())))
        start += int(ids.numel())

    for i, ids in enumerate(docs):
        if i and between is not None and between.numel():
            plain(between)
        rows = wrap(lm, adapters, ids)
        n = int(rows.shape[0])
        iso_rows.append(rows)
        local.append(torch.arange(p, p + n))
        place.append(torch.arange(start, start + n))
        block.append(torch.full((n,), i + 1))
        if picked is not None and picked[i].numel():
            at = picked[i].to(torch.long).sort().values + n_h
            if int(at[-1]) >= n_h + int(ids.numel()) or int(at[0]) < n_h:
                raise ValueError(f"picked rows of document {i} fall outside its {int(ids.numel())} tokens")
            fresh_rows.append(rows[at.to(dev)])
            fresh_pos.append(start + at)
        start += n
    plain(tail_ids)
    q = int(tail_ids.numel())
    h_iso, h_new = torch.cat(iso_rows)[None], torch.cat(fresh_rows)[None]  # [1, I, hidden], [1, R, hidden]
    local_pos, global_iso, blocks, new_pos = torch.cat(local), torch.cat(place), torch.cat(block), torch.cat(fresh_pos)
    n_iso, n_all = int(h_iso.shape[1]), start
    # Where each global row's K/V comes from in cat([isolated, recomputed]): a fresh copy wins.
    source = torch.empty(n_all, dtype=torch.long)
    source[global_iso] = torch.arange(n_iso)
    source[new_pos] = n_iso + torch.arange(int(new_pos.numel()))
    idx = torch.arange(n_iso)
    # Isolated rows: causal within their own block, plus the prefix (block 0).
    inner = ((blocks[:, None] == blocks[None, :]) | (blocks[None, :] == 0)) & (idx[None, :] <= idx[:, None])
    causal = torch.arange(n_all)[None, :] <= new_pos[:, None]  # [R, N]
    inner, causal, source, delta = inner[None, None].to(dev), causal[None, None].to(dev), source.to(dev), global_iso - local_pos
    rope_iso, rope_new = fam.rope(h_iso, local_pos[None].to(dev)), fam.rope(h_new, new_pos[None].to(dev))
    for layer in range(len(fam.layers)):
        if fam.window(layer) is not None:
            raise ValueError("packet training on sliding-window layers is not supported yet")
        q_iso, k_iso, v_iso = fam.qkv(layer, h_iso, rope_iso)
        q_new, k_new, v_new = fam.qkv(layer, h_new, rope_new)
        scale, gqa = fam.scaling(layer), q_iso.shape[1] != k_iso.shape[1]
        placed = rerotate(k_iso, delta, fam.inv_freq(layer))
        keys = torch.cat([placed, k_new], dim=2).index_select(2, source)  # [1, H_kv, N, D]
        values = torch.cat([v_iso, v_new], dim=2).index_select(2, source)
        out_iso = F.scaled_dot_product_attention(q_iso, k_iso, v_iso, attn_mask=inner, scale=scale, enable_gqa=gqa)
        out_new = F.scaled_dot_product_attention(q_new, keys, values, attn_mask=causal, scale=scale, enable_gqa=gqa)
        h_iso, h_new = fam.finish(layer, h_iso, out_iso), fam.finish(layer, h_new, out_new)
    return fam.logits(h_new[:, -q:])[0].float()
