"""Correctness oracles on a tiny random model of every family: full recompute == full prefill,
zero recompute == direct reuse, RoPE re-rotation (per layer type), sliding windows included."""

import pytest
import torch
from conftest import CORPUS
from transformers import DynamicCache

from cacheclip_rag.corpus.encode import encode_prefix, encode_segment, tokenize
from cacheclip_rag.models.rope import rerotate
from cacheclip_rag.request.assemble import build_layout
from cacheclip_rag.request.pipeline import assemble
from cacheclip_rag.request.recompute import recompute_rows

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

    with torch.inference_mode():  # a cache without config keeps every row of sliding layers
        ref = tiny_lm.model(input_ids=layout.input_ids[None], cache=DynamicCache(), use_cache=True)
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
    past = DynamicCache(reused)
    positions = torch.arange(question.start, question.end)[None]
    with torch.inference_mode():
        ref = tiny_lm.model(input_ids=question.ids[None], cache=past, position_ids=positions, use_cache=True)
    torch.testing.assert_close(logits, ref.logits[0, -1], **TOL)
    for layer in range(tiny_lm.num_layers):
        torch.testing.assert_close(cache.keys[layer], ref.cache.layers[layer].keys, **TOL)
        torch.testing.assert_close(cache.values[layer], ref.cache.layers[layer].values, **TOL)


def test_direct_reuse_differs_from_full_prefill(tiny_lm):
    """Guards the two oracles above against passing trivially: the reused cache differs from a
    full prefill's (and so do the logits, unless every layer's window hides the chunks from the
    last row, as a 3-layer Mistral with a 12-token window does)."""
    layout, prefix_kv, kvs = _request(tiny_lm)
    cache = assemble(tiny_lm, layout, prefix_kv, kvs)
    logits = recompute_rows(tiny_lm, cache, layout.input_ids, layout.uncached_rows()).logits
    with torch.inference_mode():
        ref = tiny_lm.model(input_ids=layout.input_ids[None], cache=DynamicCache(), use_cache=True)
    key_gap = max((cache.keys[i] - ref.cache.layers[i].keys).abs().max() for i in range(tiny_lm.num_layers))
    assert key_gap > 1e-2
    if tiny_lm.config.model_type != "mistral":
        assert (logits - ref.logits[0, -1]).abs().max() > 1e-2


def test_rerotated_keys_equal_keys_at_shifted_positions(tiny_lm):
    ids, _ = tokenize(tiny_lm, CORPUS[1])
    fam = tiny_lm.family
    with torch.inference_mode():
        base = fam.prefill(ids).cache
        for delta in (1, 37, 1000):
            shifted = fam.prefill(ids, torch.arange(ids.numel()) + delta).cache
            for layer in range(tiny_lm.num_layers):
                moved = rerotate(base.layers[layer].keys, delta, fam.inv_freq(layer))
                torch.testing.assert_close(moved, shifted.layers[layer].keys, atol=1e-4, rtol=1e-4)
                torch.testing.assert_close(base.layers[layer].values, shifted.layers[layer].values, atol=1e-4, rtol=1e-4)


def test_rerotate_by_zero_and_back_is_identity(tiny_lm):
    k = torch.randn(2, 5, 16)
    inv_freq = tiny_lm.family.inv_freq(0)
    assert rerotate(k, 0, inv_freq) is k
    torch.testing.assert_close(rerotate(rerotate(k, 123, inv_freq), -123, inv_freq), k, atol=1e-5, rtol=1e-5)


def test_windows_matter_on_the_windowed_families(tiny_lm):
    """Guards the oracles on windowed families: the request is longer than the window, and
    attending without it would give other logits."""
    from cacheclip_rag.request import recompute

    windows = {tiny_lm.family.window(i) for i in range(tiny_lm.num_layers)} - {None}
    if not windows:
        pytest.skip("no sliding-window layers in this family")
    layout, prefix_kv, kvs = _request(tiny_lm)
    assert layout.num_tokens > 2 * max(windows)
    rows = torch.arange(layout.prefix_len, layout.num_tokens)
    windowed = recompute_rows(tiny_lm, assemble(tiny_lm, layout, prefix_kv, kvs), layout.input_ids, rows).logits
    original = tiny_lm.family.window
    try:
        tiny_lm.family.window = lambda layer: None
        unwindowed = recompute_rows(tiny_lm, assemble(tiny_lm, layout, prefix_kv, kvs), layout.input_ids, rows).logits
    finally:
        tiny_lm.family.window = original
    assert (windowed - unwindowed).abs().max() > 1e-3
    del recompute


def test_two_rope_thetas_are_kept_apart():
    """Gemma 3's local and global layers rotate keys with their own frequencies."""
    from conftest import _tokenizer, tiny_model

    fam = tiny_model("gemma3", _tokenizer(), layers=3).family
    local, glob = fam.inv_freq(0), fam.inv_freq(2)
    assert fam.layer_types[0] == "sliding_attention" and fam.layer_types[2] == "full_attention"
    assert not torch.allclose(local, glob)


@pytest.mark.parametrize("kind", [None, "split", "matmul", "plain"])
def test_oracles_hold_in_bf16(tiny_lm, kind, monkeypatch):
    """The same two oracles with the model in bf16 (the dtype "auto" picks on CUDA and on CPUs with
    native bf16), through the blocked attention path, within bf16 rounding: its default kind for
    bf16 on this CPU (plain blocks with AMX, else matmul blocks) and each kind by name."""
    import copy

    import cacheclip_kernels.blocked as blocked

    from cacheclip_rag.models.loading import wrap

    monkeypatch.setattr(blocked, "DEFAULT_KIND", kind)

    lm = wrap(copy.deepcopy(tiny_lm.model).to(torch.bfloat16), tiny_lm.tokenizer, name=tiny_lm.name + "-bf16")
    layout, prefix_kv, kvs = _request(lm)
    with torch.inference_mode():
        ref = lm.model(input_ids=layout.input_ids[None], cache=DynamicCache(), use_cache=True).logits[0, -1].float()
    full = recompute_rows(lm, assemble(lm, layout, prefix_kv, kvs), layout.input_ids, torch.arange(layout.prefix_len, layout.num_tokens)).logits
    assert (full - ref).abs().max() <= 0.05 * ref.abs().max()
    assert int(full.argmax()) == int(ref.argmax())
    layout, prefix_kv, kvs = _request(lm, with_separators=False)
    cache = assemble(lm, layout, prefix_kv, kvs)
    question = layout.segments[-1]
    reused = [(k[:, :, : question.start].clone(), v[:, :, : question.start].clone()) for k, v in zip(cache.keys, cache.values)]
    zero = recompute_rows(lm, cache, layout.input_ids, layout.uncached_rows()).logits
    with torch.inference_mode():
        direct = lm.model(input_ids=question.ids[None], cache=DynamicCache(reused), use_cache=True,
                          position_ids=torch.arange(question.start, question.end)[None]).logits[0, -1].float()
    assert (zero - direct).abs().max() <= 0.05 * direct.abs().max()
