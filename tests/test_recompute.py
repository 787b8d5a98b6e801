"""Correctness oracles: full recompute == full prefill, zero recompute == direct reuse, RoPE re-rotation."""

import torch
from transformers import DynamicCache

from cacheclip_rag.assemble import assemble, build_layout, rerotate
from cacheclip_rag.encode import encode_prefix, encode_segment, tokenize
from cacheclip_rag.recompute import decoder, recompute_rows

from conftest import CORPUS

TOL = dict(atol=2e-4, rtol=2e-4)


def _request(lm, with_separators=True):
    prefix = "System: answer from the context.\n\n"
    prefix_kv = encode_prefix(lm, prefix)
    texts = CORPUS[:3]
    kvs = {f"c{i}": encode_segment(lm, prefix_kv.token_ids, t) for i, t in enumerate(texts)}
    pieces = []
    for i, t in enumerate(texts):
        if i and with_separators:
            pieces.append(("\n\n", None))
        pieces.append((t, f"c{i}"))
    pieces.append(("\n\nQuestion: what is the code?\nAnswer:", None))
    layout = build_layout(prefix_kv.token_ids, pieces, lambda s, special: tokenize(lm, s, special))
    return layout, prefix_kv, kvs


def test_full_recompute_reproduces_full_prefill(tiny_lm):
    layout, prefix_kv, kvs = _request(tiny_lm)
    cache = assemble(tiny_lm, layout, prefix_kv, kvs)
    rows = torch.arange(layout.prefix_len, layout.num_tokens)
    logits = recompute_rows(tiny_lm, cache, layout.input_ids, rows).logits

    with torch.inference_mode():
        ref = tiny_lm.model(input_ids=layout.input_ids[None], use_cache=True)
    for layer in range(tiny_lm.num_layers):
        torch.testing.assert_close(cache.keys[layer], ref.cache.layers[layer].keys, **TOL)
        torch.testing.assert_close(cache.values[layer], ref.cache.layers[layer].values, **TOL)
    torch.testing.assert_close(logits, ref.logits[0, -1], **TOL)


def test_zero_recompute_reproduces_direct_reuse(tiny_lm):
    layout, prefix_kv, kvs = _request(tiny_lm, with_separators=False)
    cache = assemble(tiny_lm, layout, prefix_kv, kvs)
    rows = layout.uncached_rows()
    question = layout.segments[-1]
    assert rows.tolist() == list(range(question.start, question.end))
    reused = [(k[:, :, : question.start].clone(), v[:, :, : question.start].clone()) for k, v in zip(cache.keys, cache.values)]
    logits = recompute_rows(tiny_lm, cache, layout.input_ids, rows).logits

    # Direct reuse done by transformers itself: the concatenated caches as past, the question as input.
    past = DynamicCache(reused, config=tiny_lm.config)
    positions = torch.arange(question.start, question.end)[None]
    with torch.inference_mode():
        ref = tiny_lm.model(input_ids=question.ids[None], cache=past, position_ids=positions, use_cache=True)
    torch.testing.assert_close(logits, ref.logits[0, -1], **TOL)
    for layer in range(tiny_lm.num_layers):
        torch.testing.assert_close(cache.keys[layer], ref.cache.layers[layer].keys, **TOL)
        torch.testing.assert_close(cache.values[layer], ref.cache.layers[layer].values, **TOL)


def test_direct_reuse_differs_from_full_prefill(tiny_lm):
    """Guards the two oracles above against passing trivially."""
    layout, prefix_kv, kvs = _request(tiny_lm)
    cache = assemble(tiny_lm, layout, prefix_kv, kvs)
    logits = recompute_rows(tiny_lm, cache, layout.input_ids, layout.uncached_rows()).logits
    with torch.inference_mode():
        ref = tiny_lm.model(input_ids=layout.input_ids[None]).logits[0, -1]
    assert (logits - ref).abs().max() > 1e-2


def test_rerotated_keys_equal_keys_at_shifted_positions(tiny_lm):
    ids, _ = tokenize(tiny_lm, CORPUS[1])
    inv_freq = decoder(tiny_lm).rotary_emb.inv_freq
    with torch.inference_mode():
        base = decoder(tiny_lm)(input_ids=ids[None], use_cache=True).cache
        for delta in (1, 37, 1000):
            pos = torch.arange(ids.numel())[None] + delta
            shifted = decoder(tiny_lm)(input_ids=ids[None], position_ids=pos, use_cache=True).cache
            for layer in range(tiny_lm.num_layers):
                moved = rerotate(base.layers[layer].keys, delta, inv_freq)
                torch.testing.assert_close(moved, shifted.layers[layer].keys, atol=1e-4, rtol=1e-4)
                torch.testing.assert_close(base.layers[layer].values, shifted.layers[layer].values, atol=1e-4, rtol=1e-4)


def test_rerotate_by_zero_and_back_is_identity(tiny_lm):
    k = torch.randn(2, 5, 16)
    inv_freq = decoder(tiny_lm).rotary_emb.inv_freq
    assert rerotate(k, 0, inv_freq) is k
    torch.testing.assert_close(rerotate(rerotate(k, 123, inv_freq), -123, inv_freq), k, atol=1e-5, rtol=1e-5)
