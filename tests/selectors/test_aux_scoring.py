"""Top-k, sliding-window grouping and token mapping."""

import torch
from conftest import CORPUS

from cacheclip_rag.corpus.encode import encode_prefix, encode_segment, tokenize
from cacheclip_rag.selectors.aux_scores import mean_over_layers, score_chunks_by_layer
from cacheclip_rag.selectors.budget import (
    group_window,
    group_windows,
    map_tokens,
    top_k_candidates,
)


def _mask(n, idx):
    m = torch.zeros(n, dtype=torch.bool)
    m[list(idx)] = True
    return m


def _kept(n, idx, w=8, tau=5):
    return torch.nonzero(group_window(_mask(n, idx), w, tau)).flatten().tolist()


def test_dense_run_is_kept_whole_with_its_gaps():
    # Windows starting at 10 (6 candidates) and 11 (5 candidates) pass; 13 (4) does not.
    assert _kept(40, [10, 11, 13, 14, 16, 17]) == list(range(10, 19))


def test_isolated_candidates_are_dropped():
    assert _kept(40, [3, 20, 35]) == []
    # 4 candidates in a window is below tau=5.
    assert _kept(40, [10, 12, 14, 16]) == []


def test_overlapping_windows_merge():
    # Windows starting at 0..4 pass (the one at 4 holds 4..8, five candidates); the one at 5
    # holds four. The union of the passing windows is 0..11.
    kept = _kept(40, [0, 1, 2, 3, 4, 5, 6, 7, 8])
    assert kept == list(range(0, 12))


def test_window_must_start_on_a_candidate():
    # Candidates 2..6 are dense, but a window starting at 0 (not a candidate) is not evaluated:
    # the passing window is the one starting at 2, covering 2..9.
    assert _kept(40, [2, 3, 4, 5, 6]) == list(range(2, 10))


def test_sequence_ends_clip_windows():
    # A run at the very end: the window is clipped at n and still needs tau candidates.
    assert _kept(12, [7, 8, 9, 10, 11]) == [7, 8, 9, 10, 11]
    assert _kept(12, [9, 10, 11]) == []
    # At the start.
    assert _kept(12, [0, 1, 2, 3, 4]) == list(range(0, 8))
    # Shorter than the window.
    assert _kept(5, [0, 1, 2, 3, 4]) == [0, 1, 2, 3, 4]
    assert _kept(0, []) == []


def test_all_candidates_keep_everything():
    assert _kept(50, range(50)) == list(range(50))


def test_grouping_matches_the_papers_loop_on_random_sets():
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        n = int(torch.randint(1, 60, (1,), generator=gen))
        cand = torch.rand(n, generator=gen) < 0.5
        w, tau = 8, 5
        expected = torch.zeros(n, dtype=torch.bool)
        for t in range(n):
            if cand[t] and int(cand[t : t + w].sum()) >= tau:
                expected[t : t + w] = True
        assert torch.equal(group_window(cand, w, tau), expected)


def test_grouping_all_chunks_at_once_equals_grouping_each_alone():
    """No window reaches across a chunk boundary: one call over the chunks end to end keeps the
    same tokens as one call per chunk (the budget search runs it a dozen times per request)."""
    gen = torch.Generator().manual_seed(1)
    for _ in range(200):
        sizes = torch.randint(1, 30, (int(torch.randint(1, 6, (1,), generator=gen)),), generator=gen).tolist()
        cand = torch.rand(sum(sizes), generator=gen) < float(torch.rand(1, generator=gen))
        w, tau = int(torch.randint(1, 10, (1,), generator=gen)), int(torch.randint(1, 6, (1,), generator=gen))
        alone = torch.cat([group_window(c, w, tau) for c in cand.split(sizes)])
        assert torch.equal(group_windows(cand, sizes, w, tau), alone)


def test_top_k_is_global_over_chunks():
    scores = [torch.tensor([0.1, 0.9, 0.2]), torch.tensor([0.8, 0.05, 0.7, 0.3])]
    c = top_k_candidates(scores, 3 / 7)
    assert [m.tolist() for m in c] == [[False, True, False], [True, False, True, False]]
    assert [m.sum().item() for m in top_k_candidates(scores, 0.0)] == [0, 0]
    assert [m.sum().item() for m in top_k_candidates(scores, 1.0)] == [3, 4]


def test_map_tokens_by_character_overlap():
    src = torch.tensor([[0, 3], [3, 7], [7, 10]])
    dst = torch.tensor([[0, 2], [2, 5], [5, 6], [6, 10]])
    sel = torch.tensor([False, True, False])
    assert map_tokens(src, sel, dst, 10).tolist() == [False, True, True, True]
    assert map_tokens(src, torch.zeros(3, dtype=torch.bool), dst, 10).tolist() == [False] * 4
    # Zero-width spans count as covering their start character.
    assert map_tokens(torch.tensor([[4, 4]]), torch.tensor([True]), dst, 10).tolist() == [False, True, False, False]


def test_scores_are_a_distribution_over_chunk_tokens(tiny_pair):
    _, aux = tiny_pair
    prefix = encode_prefix(aux, "System prompt.\n\n")
    chunks = [encode_segment(aux, prefix.token_ids, t) for t in CORPUS[:3]]
    query, _ = tokenize(aux, "Question: what is the code?")
    scores = mean_over_layers(score_chunks_by_layer(aux, prefix, chunks, query))
    assert [s.numel() for s in scores] == [c.num_tokens for c in chunks]
    for s in scores:
        assert (s >= 0).all() and 0 < s.sum() <= 1.0 + 1e-5
    # Batched scoring equals scoring each chunk alone (padding does not leak).
    alone = mean_over_layers(score_chunks_by_layer(aux, prefix, chunks[1:2], query))[0]
    torch.testing.assert_close(alone, scores[1], atol=1e-5, rtol=1e-4)


def test_one_pass_over_many_layers_equals_one_pass_per_layer(tiny_pair):
    _, aux = tiny_pair
    prefix = encode_prefix(aux, "System prompt.\n\n")
    chunks = [encode_segment(aux, prefix.token_ids, t) for t in CORPUS[:2]]
    query, _ = tokenize(aux, "Question: what is the code?")
    both = score_chunks_by_layer(aux, prefix, chunks, query, layers=(0, -1), head_agg="max", row_agg="max")
    assert sorted(both) == [0, aux.num_layers - 1]
    for layer in both:
        alone = score_chunks_by_layer(aux, prefix, chunks, query, layers=(layer,), head_agg="max", row_agg="max")[layer]
        for a, b in zip(alone, both[layer]):
            torch.testing.assert_close(a, b)


def test_aux_scores_equal_a_full_prefills_attention_on_every_family(tiny_lm):
    """The aux pass reuses [prefix + chunk_i] and computes only the query rows: for each chunk,
    its scores must equal the attention of the query rows in a full prefill of
    [prefix + chunk_i + query] (sliding windows, RoPE per layer type and norms included)."""
    from cacheclip_rag.selectors.primary_attention import attention_from_rows

    prefix = encode_prefix(tiny_lm, "System prompt.\n\n")
    texts = [CORPUS[1], CORPUS[3] + " " + CORPUS[0]]
    chunks = [encode_segment(tiny_lm, prefix.token_ids, t) for t in texts]
    query, _ = tokenize(tiny_lm, "Question: what is the code of the record?")
    layers = tuple(range(tiny_lm.num_layers))
    scores = score_chunks_by_layer(tiny_lm, prefix, chunks, query, layers=layers)
    p, q = prefix.num_tokens, query.numel()
    for i, chunk in enumerate(chunks):
        ids = torch.cat([prefix.token_ids, chunk.token_ids, query])
        rows = torch.arange(ids.numel() - q, ids.numel())
        ref = attention_from_rows(tiny_lm, ids, rows, list(layers))
        for layer in layers:
            torch.testing.assert_close(scores[layer][i], ref[layer][p : p + chunk.num_tokens].float(), atol=2e-5, rtol=1e-4)


def _from_full_prefill(lm, prefix, texts):
    """Chunk caches cut from one full prefill of [prefix + texts...], keys rotated back to
    [P, P + L_i) as if each chunk had been encoded alone: joint scoring over them re-rotates them
    to where they were, so it must reproduce the full prefill's attention exactly."""
    from cacheclip_rag.models.rope import rerotate
    from cacheclip_rag.storage.record import ChunkKV

    parts = [tokenize(lm, t)[0] for t in texts]
    ids = torch.cat([prefix.token_ids, *parts])
    cache = lm.family.prefill(ids).cache
    p, start, chunks = prefix.num_tokens, prefix.num_tokens, []
    for part in parts:
        end = start + part.numel()
        keys = [rerotate(cache.layers[i].keys[0, :, start:end].float(), p - start, lm.family.inv_freq(i))
                for i in range(lm.num_layers)]
        values = [cache.layers[i].values[0, :, start:end].float() for i in range(lm.num_layers)]
        offsets = torch.stack([torch.arange(part.numel()), torch.arange(part.numel()) + 1], dim=1)
        chunks.append(ChunkKV(keys, values, part, offsets, p))
        start = end
    return ids, chunks


def test_joint_scores_equal_a_full_prefills_attention_on_every_family(tiny_lm):
    """Joint scoring reads every chunk at its assembled position: over caches that hold the
    cross-chunk context (cut from a full prefill) it must equal the attention of the query rows in a
    full prefill of [prefix + chunks + query], chunk columns in order."""
    from cacheclip_rag.selectors.aux_scores import score_joint_by_layer
    from cacheclip_rag.selectors.primary_attention import attention_from_rows

    prefix = encode_prefix(tiny_lm, "System prompt.\n\n")
    ids, chunks = _from_full_prefill(tiny_lm, prefix, [CORPUS[1], CORPUS[3], CORPUS[0]])
    query, _ = tokenize(tiny_lm, "Question: what is the code of the record?")
    layers = tuple(range(tiny_lm.num_layers))
    scores = score_joint_by_layer(tiny_lm, prefix, chunks, query, layers=layers)
    full = torch.cat([ids, query])
    rows = torch.arange(ids.numel(), full.numel())
    ref = attention_from_rows(tiny_lm, full, rows, list(layers))
    p = prefix.num_tokens
    for layer in layers:
        got = torch.cat(scores[layer])
        torch.testing.assert_close(got, ref[layer][p : ids.numel()].float(), atol=2e-5, rtol=1e-4)


def test_joint_scoring_over_one_chunk_is_per_chunk_scoring(tiny_pair):
    from cacheclip_rag.selectors.aux_scores import score_joint_by_layer

    _, aux = tiny_pair
    prefix = encode_prefix(aux, "System prompt.\n\n")
    chunk = encode_segment(aux, prefix.token_ids, CORPUS[2])
    query, _ = tokenize(aux, "Question: what is the code?")
    joint = score_joint_by_layer(aux, prefix, [chunk], query, layers=(0, -1))
    alone = score_chunks_by_layer(aux, prefix, [chunk], query, layers=(0, -1))
    for layer in joint:
        torch.testing.assert_close(joint[layer][0], alone[layer][0], atol=1e-5, rtol=1e-4)
