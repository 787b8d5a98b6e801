"""The Triton sparse-query kernel against its plain-torch reference (interpreted on CPU)."""

import math

import pytest
import torch

pytest.importorskip("triton")

from cacheclip_kernels import sparse_query_attention, sparse_query_attention_ref  # noqa: E402
from cacheclip_kernels.reference import causal_position_mask  # noqa: E402

CASES = [
    # (B, H, H_kv, M, N, D)
    (1, 4, 4, 1, 1, 64),  # one row at position 0 of a one-token cache
    (1, 3, 1, 37, 300, 64),  # GQA 3, ragged M and N
    (2, 7, 1, 20, 129, 128),  # GQA 7, D 128, batch 2
    (1, 2, 2, 70, 70, 64),  # every row selected (dense causal)
    (2, 6, 2, 65, 257, 64),  # M and N just past block multiples
    (1, 4, 2, 5, 513, 128),  # few rows, long cache
]


def _inputs(b, h, h_kv, m, n, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, m, d, generator=g)
    k = torch.randn(b, h_kv, n, d, generator=g)
    v = torch.randn(b, h_kv, n, d, generator=g)
    pos = torch.stack([torch.randperm(n, generator=g)[:m] for _ in range(b)])  # unsorted, distinct
    pos[:, 0] = 0
    if m > 1:
        pos[:, -1] = n - 1
    return q.to(dtype), k.to(dtype), v.to(dtype), pos


def _ref_lse(q, k, pos, scale, window=None):
    group = q.shape[1] // k.shape[1]
    kk = k.float().repeat_interleave(group, dim=1)
    logits = torch.matmul(q.float(), kk.transpose(-1, -2)) * scale
    logits = logits.masked_fill(~causal_position_mask(pos, k.shape[2], window), float("-inf"))
    return torch.logsumexp(logits, dim=-1)


@pytest.mark.parametrize("shape", CASES, ids=lambda s: "x".join(map(str, s)))
def test_fp32_matches_reference(shape):
    q, k, v, pos = _inputs(*shape, torch.float32, seed=sum(shape))
    out, lse = sparse_query_attention(q, k, v, pos, return_lse=True)
    ref = sparse_query_attention_ref(q, k, v, pos)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, _ref_lse(q, k, pos, shape[-1] ** -0.5), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("window", [1, 7, 64, 300, 1000])
@pytest.mark.parametrize("shape", [CASES[1], CASES[4], CASES[5]], ids=lambda s: "x".join(map(str, s)))
def test_sliding_window_matches_reference(shape, window):
    """Windows smaller than a key block, a block, and larger than the cache (== no window)."""
    q, k, v, pos = _inputs(*shape, torch.float32, seed=window)
    out, lse = sparse_query_attention(q, k, v, pos, return_lse=True, window=window)
    ref = sparse_query_attention_ref(q, k, v, pos, window=window)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, _ref_lse(q, k, pos, shape[-1] ** -0.5, window), atol=2e-5, rtol=2e-5)
    if window >= shape[4]:
        torch.testing.assert_close(out, sparse_query_attention_ref(q, k, v, pos), atol=2e-5, rtol=2e-5)


def test_window_reference_is_a_band():
    mask = causal_position_mask(torch.tensor([[0, 3, 5]]), 6, window=2)[0, 0]
    assert mask.int().tolist() == [[1, 0, 0, 0, 0, 0], [0, 0, 1, 1, 0, 0], [0, 0, 0, 0, 1, 1]]


@pytest.mark.parametrize("window", [0, -3, 2.5, True])
def test_bad_window_is_rejected(window):
    q, k, v, pos = _inputs(1, 2, 2, 3, 10, 64, torch.float32, seed=1)
    for fn in (sparse_query_attention, sparse_query_attention_ref):
        with pytest.raises(ValueError, match="window must be a positive int"):
            fn(q, k, v, pos, window=window)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", CASES[1:4], ids=lambda s: "x".join(map(str, s)))
def test_half_precision_within_twice_torch_error(shape, dtype):
    q, k, v, pos = _inputs(*shape, dtype, seed=7)
    exact = sparse_query_attention_ref(q.float(), k.float(), v.float(), pos)
    torch_err = (sparse_query_attention_ref(q, k, v, pos).float() - exact).abs().max().item()
    kernel_err = (sparse_query_attention(q, k, v, pos).float() - exact).abs().max().item()
    # The interpreter has no bf16 type (numpy): its fp32 -> bf16 store truncates instead of
    # rounding to nearest, which alone doubles the output's rounding error. On a GPU, 2x holds.
    factor = 4 if dtype == torch.bfloat16 and not q.is_cuda else 2
    assert kernel_err <= factor * torch_err + 1e-4, (kernel_err, torch_err)


def test_custom_scale_and_small_blocks():
    q, k, v, pos = _inputs(1, 2, 1, 33, 90, 64, torch.float32, seed=3)
    out = sparse_query_attention(q, k, v, pos, scale=0.3, block_m=16, block_n=32)
    torch.testing.assert_close(out, sparse_query_attention_ref(q, k, v, pos, scale=0.3), atol=2e-5, rtol=2e-5)


def test_repeated_positions_and_empty_selection():
    q, k, v, _ = _inputs(1, 2, 2, 6, 40, 64, torch.float32, seed=4)
    pos = torch.tensor([[5, 5, 0, 39, 39, 12]])
    torch.testing.assert_close(sparse_query_attention(q, k, v, pos), sparse_query_attention_ref(q, k, v, pos), atol=2e-5, rtol=2e-5)
    empty = sparse_query_attention(q[:, :, :0], k, v, pos[:, :0])
    assert empty.shape == (1, 2, 0, 64)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(h_kv=3), "multiple of kv heads"),
        (dict(d=48), "head_dim"),
        (dict(pos_hi=True), r"q_pos must lie in"),
        (dict(pos_shape=True), r"q_pos must be \[B, M\]"),
        (dict(mixed=True), "share one of"),
    ],
)
def test_launcher_rejects_bad_input(change, match):
    h_kv, d = change.get("h_kv", 2), change.get("d", 64)
    q = torch.randn(1, 4, 3, d)
    k = torch.randn(1, h_kv, 10, d)
    v = torch.randn(1, h_kv, 10, d)
    pos = torch.tensor([[0, 4, 9]])
    if change.get("pos_hi"):
        pos = torch.tensor([[0, 4, 10]])
    if change.get("pos_shape"):
        pos = pos[0]
    if change.get("mixed"):
        k, v = k.half(), v.half()
    with pytest.raises(ValueError, match=match):
        sparse_query_attention(q, k, v, pos)


def test_recompute_through_the_kernel_equals_the_torch_path(tiny_lm):
    """Every family, sliding-window layers included, through the kernel and the torch path."""
    from conftest import CORPUS

    from cacheclip_rag.corpus.encode import encode_prefix, encode_segment, tokenize
    from cacheclip_rag.request.assemble import build_layout
    from cacheclip_rag.request.pipeline import assemble
    from cacheclip_rag.request.recompute import recompute_rows

    lm = tiny_lm
    prefix = encode_prefix(lm, "System.\n\n")
    kvs = {f"c{i}": encode_segment(lm, prefix.token_ids, t) for i, t in enumerate(CORPUS[:3])}
    pieces = [(t, f"c{i}") for i, t in enumerate(CORPUS[:3])] + [("\n\nQuestion: code?", None)]
    layout = build_layout(prefix.token_ids, pieces, lambda s, special: tokenize(lm, s, special))
    rows = torch.unique(torch.cat([layout.uncached_rows(), layout.chunk_rows()[::3]]))
    results = {}
    for backend in ("torch", "triton"):
        cache = assemble(lm, layout, prefix, kvs)
        logits = recompute_rows(lm, cache, layout.input_ids, rows, backend=backend).logits
        results[backend] = (logits, cache)
    torch.testing.assert_close(results["triton"][0], results["torch"][0], atol=1e-4, rtol=1e-4)
    for kt, kr in zip(results["triton"][1].keys, results["torch"][1].keys):
        torch.testing.assert_close(kt, kr, atol=1e-4, rtol=1e-4)
    assert not math.isnan(results["triton"][0].sum().item())


@pytest.mark.parametrize("window, kind", [(None, "plain"), (None, "split"), (None, "matmul"), (5, "plain"), (100, "plain"),
                                          (5, "matmul"), (100, "matmul")])
@pytest.mark.parametrize("m, n, blocks", [(1, 1, None), (37, 300, None), (300, 700, None), (300, 700, 5), (64, 64, 3),
                                          (600, 2000, None)])
def test_blocked_cpu_path_matches_reference(m, n, blocks, window, kind):
    from cacheclip_kernels import BlockPlan, blocked_attention

    g = torch.Generator().manual_seed(m + n)
    q, k, v = torch.randn(1, 6, m, 64, generator=g), torch.randn(1, 2, n, 64, generator=g), torch.randn(1, 2, n, 64, generator=g)
    pos = torch.sort(torch.randperm(n, generator=g)[:m]).values
    plan = BlockPlan.build(pos, n, window, blocks, kind=kind)
    got = blocked_attention(q, k, v, plan, scale=0.2)
    torch.testing.assert_close(got, sparse_query_attention_ref(q, k, v, pos[None], scale=0.2, window=window), atol=2e-5, rtol=2e-5)
    parts = {"plain": plan.blocks, "split": plan.split, "matmul": plan.matmul}[kind]
    assert plan.kind == kind and sum(b.rows.stop - b.rows.start for b in parts) == m
    assert all(b.hi - b.lo <= n for b in plan.blocks + plan.matmul + tuple(t for b in plan.split for t in b.tail))
    if kind == "split":  # every row but a block's first is in exactly one masked sub-block
        assert sum(t.rows.stop - t.rows.start for b in plan.split for t in b.tail) == m - len(plan.split)


def test_the_default_kind_follows_device_dtype_and_window(monkeypatch):
    from cacheclip_kernels import BlockPlan, blocked, blocked_attention

    pos = torch.arange(0, 600, 2)
    assert BlockPlan.build(pos, 600).kind == "split" and BlockPlan.build(pos, 600, window=50).kind == "plain"
    for amx, half_kind in ((False, "matmul"), (True, "plain")):  # AMX runs the flash kernel's bf16 on its tiles
        monkeypatch.setattr(blocked, "cpu_has_amx", lambda amx=amx: amx)
        for dtype in (torch.bfloat16, torch.float16):
            assert BlockPlan.build(pos, 600, dtype=dtype).kind == BlockPlan.build(pos, 600, 50, dtype=dtype).kind == half_kind
        assert BlockPlan.build(pos, 600).kind == "split"  # float32 is not theirs to change
    assert blocked.default_kind(torch.device("cuda"), torch.bfloat16, None) == "plain"
    monkeypatch.setattr(blocked, "DEFAULT_KIND", "split")  # the override, where split blocks cannot go, is plain
    assert BlockPlan.build(pos, 600, dtype=torch.bfloat16).kind == "split" and BlockPlan.build(pos, 600, 50).kind == "plain"
    with pytest.raises(ValueError, match="sliding window"):
        BlockPlan.build(pos, 600, window=50, kind="split")
    with pytest.raises(ValueError, match="kind must be one of"):
        BlockPlan.build(pos, 600, kind="dense")
    q, kv = torch.empty(1, 6, 300, 64, device="meta"), torch.empty(1, 2, 600, 64, device="meta")
    with pytest.raises(ValueError, match="CPU flash kernel"):
        blocked_attention(q, kv, kv, BlockPlan.build(pos, 600, kind="split"))
    with pytest.raises(ValueError, match="share 4 key heads"):
        blocked_attention(torch.zeros(1, 6, 300, 64), torch.zeros(1, 4, 600, 64), torch.zeros(1, 4, 600, 64),
                          BlockPlan.build(pos, 600, kind="matmul"))


def test_matmul_sub_blocks_are_cut_where_rows_spread_thin():
    from cacheclip_kernels import BlockPlan, blocked

    dense = BlockPlan.build(torch.arange(1000, 1200), 1300, kind="matmul")  # contiguous rows: full sub-blocks
    assert [b.rows.stop - b.rows.start for b in dense.matmul] == [64, 64, 64, 8]
    sparse = torch.cat([torch.arange(0, 3200, 40), torch.arange(3200, 3300)])  # 80 rows 40 apart, then 100 in a run
    plan = BlockPlan.build(sparse, 3300, kind="matmul")
    sizes = [b.rows.stop - b.rows.start for b in plan.matmul]
    assert sum(sizes) == 180 and sizes[0] == blocked.MIN_SUB_ROWS  # 256 positions hold 7 rows: the floor holds
    for b in plan.matmul:
        p = sparse[b.rows]
        rows = b.rows.stop - b.rows.start
        assert rows <= blocked.SUB_ROWS
        assert int(p[-1] - p[0]) < blocked.SUB_SPAN or rows == blocked.MIN_SUB_ROWS


@pytest.mark.parametrize("kind, window", [("split", None), ("matmul", None), ("matmul", 256)])
def test_half_precision_blocks_stay_near_the_float32_reference(kind, window):
    from cacheclip_kernels import BlockPlan, blocked_attention

    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, h, m, 64, generator=g) for h, m in ((14, 500), (2, 3000), (2, 3000)))
    pos = torch.sort(torch.randperm(3000, generator=g)[:500]).values
    ref = sparse_query_attention_ref(q, k, v, pos[None], scale=0.125, window=window)
    plan = BlockPlan.build(pos, 3000, window, kind=kind)
    got = blocked_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), plan, scale=0.125)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), ref, atol=3e-2, rtol=0)
    assert (got.float() - ref).abs().mean() < 2e-3


def test_block_plan_rejects_unsorted_or_out_of_range_rows():
    from cacheclip_kernels import BlockPlan

    with pytest.raises(ValueError, match="ascending"):
        BlockPlan.build(torch.tensor([3, 1, 2]), 10)
    with pytest.raises(ValueError, match="ascending"):
        BlockPlan.build(torch.tensor([1, 10]), 10)
