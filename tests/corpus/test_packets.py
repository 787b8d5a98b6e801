"""KV Packet's adapters: the parallel training form equals the sequential one, and training lowers the KL."""

import pytest
import torch
from conftest import CORPUS
from transformers import DynamicCache

from cacheclip_rag.corpus.encode import encode_prefix, tokenize
from cacheclip_rag.corpus.packets import (
    SOFT_TOKEN,
    PacketAdapters,
    packet_cache,
    student_logits,
)
from cacheclip_rag.corpus.packets import embed as packet_embed
from cacheclip_rag.models.rope import rerotate
from cacheclip_rag.request.assemble import AssembledCache
from cacheclip_rag.request.recompute import recompute_rows


def _windowless(lm):
    if any(lm.family.window(i) is not None for i in range(lm.num_layers)):
        pytest.skip("packet training on sliding-window layers is not built yet")


def _inputs(lm):
    prefix = encode_prefix(lm, "System: answer from the context.\n\n")
    docs = [tokenize(lm, t) for t in CORPUS[:3]]
    tail, _ = tokenize(lm, "\nQuestion: what is the code?\nAnswer: the code is")
    return prefix, docs, tail


def _sequential(lm, adapters, prefix, docs, tail, between=None, picked=None):
    """The served request: packets cached one by one after the prefix, concatenated with keys
    re-rotated into place, then the plain text (and the picked rows) recomputed in place."""
    packets = [packet_cache(lm, adapters, prefix.token_ids, ids, off) for ids, off in docs]
    p, n_h = prefix.num_tokens, adapters.shape[0]
    gap = 0 if between is None else between.numel()
    n = p + sum(k.num_tokens for k in packets) + gap * (len(packets) - 1) + tail.numel()
    cache = AssembledCache.empty(lm, n)
    for layer in range(lm.num_layers):
        cache.keys[layer][0, :, :p] = prefix.keys[layer]
        cache.values[layer][0, :, :p] = prefix.values[layer]
    ids, rows, start = [prefix.token_ids], [], p
    for i, kv in enumerate(packets):
        if i and gap:
            ids.append(between)
            rows.append(torch.arange(start, start + gap))
            start += gap
        for layer in range(lm.num_layers):
            cache.keys[layer][0, :, start : start + kv.num_tokens] = rerotate(kv.keys[layer], start - p, lm.family.inv_freq(layer))
            cache.values[layer][0, :, start : start + kv.num_tokens] = kv.values[layer]
        ids.append(kv.token_ids)
        if picked is not None:
            rows.append(start + n_h + picked[i])
        start += kv.num_tokens
    ids.append(tail)
    rows.append(torch.arange(start, n))
    embed = lambda x: packet_embed(lm, adapters, x)  # noqa: E731 - the soft rows' ids embed as adapters
    return recompute_rows(lm, cache, torch.cat(ids), torch.cat(rows).sort().values, tail=tail.numel(), embed=embed).tail_logits


def test_parallel_form_equals_sequential_packet_caches(tiny_lm):
    """Packets cached one by one after the prefix, concatenated with keys re-rotated into place,
    then the tail recomputed == the one-pass parallel form with the block-diagonal mask."""
    _windowless(tiny_lm)
    lm = tiny_lm
    adapters = PacketAdapters.initial(lm, 3, 2, seed=1)
    prefix, docs, tail = _inputs(lm)
    first = packet_cache(lm, adapters, prefix.token_ids, *docs[0])
    assert first.token_ids[0] == SOFT_TOKEN and first.num_tokens == docs[0][0].numel() + 5
    sequential = _sequential(lm, adapters, prefix, docs, tail)
    with torch.no_grad():
        parallel = student_logits(lm, adapters, prefix.token_ids, [d for d, _ in docs], tail)
    torch.testing.assert_close(parallel, sequential, atol=2e-4, rtol=2e-4)


def test_parallel_form_with_recompute_in_the_loop_equals_the_served_request(tiny_lm):
    """packet+cacheclip's request: separators between the packets, picked text rows of each
    packet recomputed in place beside the plain text; the parallel form (what training with
    recompute in the loop differentiates) gives the logits the served recompute gives."""
    _windowless(tiny_lm)
    lm = tiny_lm
    adapters = PacketAdapters.initial(lm, 3, 2, seed=1)
    prefix, docs, tail = _inputs(lm)
    between, _ = tokenize(lm, "\n\n")
    picked = [torch.tensor([0, 2, 3]), torch.tensor([1]), torch.arange(docs[2][0].numel())]
    sequential = _sequential(lm, adapters, prefix, docs, tail, between, picked)
    with torch.no_grad():
        parallel = student_logits(lm, adapters, prefix.token_ids, [d for d, _ in docs], tail, between=between,
                                  picked=picked)
        unpicked = student_logits(lm, adapters, prefix.token_ids, [d for d, _ in docs], tail, between=between)
    torch.testing.assert_close(parallel, sequential, atol=2e-4, rtol=2e-4)
    assert (parallel - unpicked).abs().max() > 1e-3  # the recomputed rows change what the tail reads
    with torch.no_grad(), pytest.raises(ValueError, match="one index tensor per document"):
        student_logits(lm, adapters, prefix.token_ids, [d for d, _ in docs], tail, picked=picked[:2])
    with torch.no_grad(), pytest.raises(ValueError, match="outside its"):
        student_logits(lm, adapters, prefix.token_ids, [d for d, _ in docs], tail,
                       picked=[torch.tensor([999]), picked[1], picked[2]])


def test_a_few_training_steps_lower_the_kl(tiny_lm):
    _windowless(tiny_lm)
    lm = tiny_lm
    for p_ in lm.model.parameters():
        p_.requires_grad_(False)
    prefix, docs, tail = _inputs(lm)
    with torch.inference_mode():  # teacher: full attention over the plain sequence
        full = torch.cat([prefix.token_ids, *[d for d, _ in docs], tail])
        teacher = lm.model(input_ids=full[None], cache=DynamicCache()).logits[0, -tail.numel():].float().log_softmax(-1)
    teacher = teacher.clone()
    torch.manual_seed(0)
    adapters = PacketAdapters.initial(lm, 4, 4, seed=2)
    adapters.header.requires_grad_(True)
    adapters.trailer.requires_grad_(True)
    opt = torch.optim.Adam([adapters.header, adapters.trailer], lr=0.005)
    losses = []
    for _ in range(8):
        student = student_logits(lm, adapters, prefix.token_ids, [d for d, _ in docs], tail).log_softmax(-1)
        loss = torch.nn.functional.kl_div(student, teacher, log_target=True, reduction="batchmean")
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses
    assert PacketAdapters(adapters.header.detach(), adapters.trailer).digest() != PacketAdapters.initial(lm, 4, 4, seed=2).digest()


def test_adapter_sizes_are_checked(tiny_lm):
    with pytest.raises(ValueError, match="n_header"):
        PacketAdapters.initial(tiny_lm, n_header=-1)
