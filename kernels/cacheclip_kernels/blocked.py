"""Sparse-query attention on the CPU at about the cost of the keys each row can see.

The reference scores every selected row against every key and masks the future away, so M rows
cost M x N whatever their positions (one fused SDPA call with a boolean mask does not skip
masked blocks). Here the rows, sorted by position, are cut into a few blocks; each block is one
fused SDPA call over only the keys up to its last row (and, on a sliding-window layer, from its
first row's window start). Measured on a 2-core CPU, 4K keys and 20% of the rows: 0.29 of a
dense causal prefill's attention against 0.42 for the single masked call. The plan (blocks, key
ranges, masks) depends only on the rows, so a layer loop builds it once per request.

Split blocks (layers without a sliding window, where the CPU flash kernel that returns its
log-sum-exp is available): a block's keys up to its first row's position are seen by every row of
the block, so they go through one call without a mask; the keys after it go through small masked
sub-blocks of rows, and the two partial softmaxes are merged through their log-sum-exps. Rows
spread over the request then stop paying for the keys their block's last row sees: on a 2-core
AVX512-BF16 CPU (bf16, 4,462 keys, ~800 rows, per layer) 97 ms against 113 ms for late-weighted
rows and 76 against 86 ms for evenly spread ones; a 4K request's recompute spent 10-14% less in
attention (2-6% less in all).

Matmul blocks (rows in bf16 or fp16 on the CPU, any window): sub-blocks of up to 64 rows, cut
shorter (to no fewer than 16) where the rows spread over more than 256 positions, each two
batched matmuls over only the keys its rows can see, the query heads grouped under their shared
key head (GQA without expanding the cache), the causal and window masks applied to the scores
of the keys after the sub-block's first row (or in its window band), and a softmax in between.
The CPU flash kernel runs half precision at about its float32 speed; the batched matmuls use the
CPU's bf16 dot products: on a 2-core AVX512-BF16 CPU (4,462 keys, ~760 late-weighted rows, bf16,
per layer) 44 ms against split blocks' 86 ms. Cutting sub-blocks by spread as well as by rows
(a row is computed up to its sub-block's last row and masked after its own), medians of seven
alternated runs on that CPU, 14 query / 2 key heads, 20% of the rows: 0.88x the time of fixed
64-row sub-blocks for late-weighted rows at 4K keys, 0.91x for evenly spread ones, 0.95x and
0.99x at 8K. The scores are rounded to the input dtype before
the softmax, as transformers' eager attention rounds them (mean error against the float32
reference 1.0e-4 against split blocks' 0.6e-4). In float32 split blocks stay the default (about
equal there). On a CPU with AMX the flash kernel runs bf16 on the tiles and plain blocks are the
half-precision default instead (`default_kind`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .reference import check_window


@dataclass(frozen=True)
class Block:
    rows: slice
    lo: int  # first key any row of the block can see
    hi: int  # one past the last
    mask: torch.Tensor  # [1, 1, rows, hi - lo] bool


@dataclass(frozen=True)
class MatmulBlock:
    """Rows that see keys [lo, hi); `hidden` [rows, hi - masked_from] marks the keys from
    `masked_from` on that a row must not see (after it, or before its window)."""

    rows: slice
    lo: int
    hi: int
    masked_from: int
    hidden: torch.Tensor


@dataclass(frozen=True)
class SplitBlock:
    """Rows that all see keys [0, shared); `tail` covers keys from `shared` on, in masked
    sub-blocks over the rows after the first (the first row's own position is shared - 1)."""

    rows: slice
    shared: int
    tail: tuple[Block, ...]


def _flash_with_lse():
    """The CPU flash-attention op that also returns the log-sum-exp, or None where this torch lacks it."""
    return getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


SUB_ROWS = 64
"""Rows per masked sub-block of a split block; the most rows of a matmul sub-block."""

SUB_SPAN = 256
"""Positions a matmul sub-block's rows may spread over: each row is computed up to the block's
last row and masked after its own, so rows spread thinly (the early, sparse part of a selection)
would pay for keys they cannot see."""

MIN_SUB_ROWS = 16
"""The fewest rows of a matmul sub-block cut short by SUB_SPAN (fewer rows make matmuls too thin)."""

KINDS = ("plain", "split", "matmul")

DEFAULT_KIND: str | None = None
"""The kind `BlockPlan.build` plans when not told; None picks by device and dtype (`default_kind`).
Set it to compare the paths end to end."""


@functools.cache
def cpu_has_amx() -> bool:
    """Whether this CPU has AMX tiles (Intel Xeon from Sapphire Rapids on), as /proc/cpuinfo says;
    False where it cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return "amx_tile" in line.split()
    except OSError:
        pass
    return False


def default_kind(device: torch.device, dtype: torch.dtype, window: int | None) -> str:
    """Half precision on the CPU: plain blocks where the CPU has AMX, else matmul blocks; float32
    there: split blocks where the layer has no window and the flash op exists, else plain; plain
    blocks on other devices (the Triton kernel is the CUDA path).

    Why AMX decides it: with AMX the CPU flash kernel runs bf16 on the tiles, and one fused call a
    block beats the matmul blocks' scores written out, masked and softmaxed (Intel Xeon with
    amx_bf16, 2 cores, 14 query / 2 key heads, per layer: 4,173 keys and 834 scattered rows 13.3 ms
    against 23.5; 2,100 keys and 420 rows 3.9 against 7.9; with a 512-token window 6.1 against
    9.1); without AMX that kernel runs bf16 at its float32 speed and the matmul blocks win (the
    module docstring's 44 against 86 ms)."""
    if DEFAULT_KIND is not None:
        return "plain" if DEFAULT_KIND == "split" and window is not None else DEFAULT_KIND
    if device.type != "cpu":
        return "plain"
    if dtype in (torch.bfloat16, torch.float16):
        return "plain" if cpu_has_amx() else "matmul"
    return "split" if window is None and _flash_with_lse() is not None else "plain"


@dataclass(frozen=True)
class BlockPlan:
    """How M rows at sorted positions attend to N keys: in `blocks` of consecutive rows (kind
    "plain"), in `split` blocks or in `matmul` blocks (see the module docstring)."""

    n_keys: int
    window: int | None
    kind: str = "plain"
    blocks: tuple[Block, ...] = ()
    split: tuple[SplitBlock, ...] = ()
    matmul: tuple[MatmulBlock, ...] = ()
    _biases: dict = field(default_factory=dict, compare=False, repr=False)  # (part, dtype) -> masks as biases

    @classmethod
    def build(cls, positions: torch.Tensor, n_keys: int, window: int | None = None, blocks: int | None = None,
              kind: str | None = None, dtype: torch.dtype = torch.float32) -> BlockPlan:
        """positions: [M] ascending, in [0, n_keys). kind: "plain", "split" or "matmul" (default:
        `default_kind` for the rows' device, `dtype` (the q/k/v the plan will serve) and the
        window; split blocks on a windowed layer are a ValueError). blocks: how many plain or split
        blocks (default: one per 128 rows, at most 8, plain: fewer calls cost less overhead, more
        skip more keys; one per 256 rows, at most 8, split); matmul blocks are SUB_ROWS rows each."""
        check_window(window)
        if positions.dim() != 1:
            raise ValueError(f"positions must be [M], got {tuple(positions.shape)}")
        m = int(positions.numel())
        if m and (int(positions[0]) < 0 or int(positions[-1]) >= n_keys or bool((positions[1:] < positions[:-1]).any())):
            raise ValueError(f"positions must be ascending in [0, {n_keys})")
        kind = default_kind(positions.device, dtype, window) if kind is None else kind
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        if kind == "matmul":
            return cls(n_keys, window, kind, matmul=_matmul_blocks(positions, window))
        if kind == "split":
            if window is not None:
                raise ValueError(f"split blocks are for layers without a sliding window, got window={window}")
            count = max(1, min(8, m // 256)) if blocks is None else blocks
            return cls(n_keys, window, kind, split=_split_blocks(positions, count))
        count = max(1, min(8, m // 128)) if blocks is None else blocks
        out = []
        for start, stop in _bounds(m, count):
            p = positions[start:stop]
            hi = int(p[-1]) + 1
            lo = 0 if window is None else max(0, int(p[0]) - window + 1)
            out.append(Block(slice(start, stop), lo, hi, _visible(p, lo, hi, window)[None, None]))
        return cls(n_keys, window, kind, tuple(out))

    def tail_biases(self, dtype: torch.dtype) -> tuple[tuple[torch.Tensor, ...], ...]:
        """Per split block, its sub-blocks' masks as additive biases in `dtype` (the flash op takes
        no boolean mask); made once per dtype, as the plan serves every layer."""
        key = ("tail", dtype)
        if key not in self._biases:
            self._biases[key] = tuple(tuple(_bias(b.mask, dtype) for b in block.tail) for block in self.split)
        return self._biases[key]

    def block_biases(self, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """Plain blocks' masks as additive biases in `dtype`, made once per dtype: SDPA turns a
        boolean mask into one at every call (about 15% of a plain block's time on a 2-core CPU)."""
        key = ("blocks", dtype)
        if key not in self._biases:
            self._biases[key] = tuple(_bias(b.mask, dtype) for b in self.blocks)
        return self._biases[key]


def _bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean visibility mask as an additive bias: 0 where visible, -inf where not."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def _visible(p: torch.Tensor, lo: int, hi: int, window: int | None) -> torch.Tensor:
    """[rows, hi - lo] bool: which of keys [lo, hi) each row at positions p may see (causally,
    and within its window on a sliding-window layer)."""
    keys = torch.arange(lo, hi, device=p.device)[None, :]
    mask = keys <= p[:, None]
    if window is not None:
        mask &= p[:, None] - keys < window
    return mask


def _bounds(m: int, count: int) -> list[tuple[int, int]]:
    edges = [round(i * m / count) for i in range(count + 1)]
    return [(a, b) for a, b in zip(edges, edges[1:]) if b > a]


def _split_blocks(positions: torch.Tensor, count: int) -> tuple[SplitBlock, ...]:
    out = []
    for start, stop in _bounds(int(positions.numel()), count):
        shared = int(positions[start]) + 1
        tail = []
        for a in range(start + 1, stop, SUB_ROWS):
            p = positions[a : min(a + SUB_ROWS, stop)]
            hi = int(p[-1]) + 1
            tail.append(Block(slice(a, a + p.numel()), shared, hi, _visible(p, shared, hi, None)[None, None]))
        out.append(SplitBlock(slice(start, stop), shared, tuple(tail)))
    return tuple(out)


def _matmul_cuts(positions: torch.Tensor) -> list[tuple[int, int]]:
    """Sub-blocks of consecutive rows: at most SUB_ROWS rows, and no more than SUB_SPAN positions
    from a sub-block's first row to its last unless that leaves fewer than MIN_SUB_ROWS rows."""
    m = int(positions.numel())
    span_end = torch.searchsorted(positions, positions + SUB_SPAN).tolist()  # first row past each row's span
    cuts, a = [], 0
    while a < m:
        b = min(a + SUB_ROWS, m, max(a + MIN_SUB_ROWS, span_end[a]))
        cuts.append((a, b))
        a = b
    return cuts


def _matmul_blocks(positions: torch.Tensor, window: int | None) -> tuple[MatmulBlock, ...]:
    out = []
    for a, b in _matmul_cuts(positions):
        p = positions[a:b]
        first, hi = int(p[0]), int(p[-1]) + 1
        lo = 0 if window is None else max(0, first - window + 1)
        masked_from = first + 1 if window is None else lo  # without a window every row sees [0, first]
        out.append(MatmulBlock(slice(a, a + p.numel()), lo, hi, masked_from, ~_visible(p, masked_from, hi, window)))
    return tuple(out)


def _matmul_attention(q, k, v, plan: BlockPlan, scale: float | None) -> torch.Tensor:
    """q: [1, H, M, D]; k, v: [1, H_kv, N, D] with H a multiple of H_kv (query head h reads key
    head h // (H / H_kv), as transformers' repeat_kv lays them out). Returns [1, H, M, D]."""
    h, h_kv, d = q.shape[1], k.shape[1], q.shape[3]
    if h % h_kv:
        raise ValueError(f"{h} query heads do not share {h_kv} key heads evenly")
    group = h // h_kv
    q = q[0] * (d**-0.5 if scale is None else scale)  # [H, M, D]
    out = q.new_empty(h, q.shape[1], v.shape[3])
    for b in plan.matmul:
        r = b.rows.stop - b.rows.start
        scores = torch.bmm(q[:, b.rows].reshape(h_kv, group * r, d), k[0, :, b.lo : b.hi].transpose(1, 2))
        scores = scores.view(h_kv, group, r, b.hi - b.lo)
        scores[..., b.masked_from - b.lo :].masked_fill_(b.hidden, float("-inf"))
        probs = torch.softmax(scores, dim=-1).view(h_kv, group * r, b.hi - b.lo)
        out[:, b.rows] = torch.bmm(probs, v[0, :, b.lo : b.hi]).view(h, r, -1)
    return out[None]


def _split_attention(q, k, v, block: SplitBlock, biases: tuple[torch.Tensor, ...], scale: float | None) -> torch.Tensor:
    """One split block (biases: its tail's, from `BlockPlan.tail_biases`): [1, H, rows, D],
    merged in float32 and returned in q's dtype."""
    flash = _flash_with_lse()
    s = block.rows
    out, lse = flash(q[:, :, s], k[:, :, : block.shared], v[:, :, : block.shared], 0.0, False, scale=scale)
    if not block.tail:
        return out
    tail_out = torch.zeros_like(out)  # the first row sees no tail key: weight exp(-inf) = 0
    tail_lse = torch.full_like(lse, float("-inf"))
    for b, bias in zip(block.tail, biases):
        r = slice(b.rows.start - s.start, b.rows.stop - s.start)
        tail_out[:, :, r], tail_lse[:, :, r] = flash(q[:, :, b.rows], k[:, :, b.lo : b.hi], v[:, :, b.lo : b.hi], 0.0, False,
                                                     attn_mask=bias, scale=scale)
    top = torch.maximum(lse, tail_lse)  # [1, H, rows], float32
    w1, w2 = torch.exp(lse - top)[..., None], torch.exp(tail_lse - top)[..., None]
    out = (out.float() * w1 + tail_out.float() * w2) / (w1 + w2)
    return out.to(q.dtype)


def blocked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BlockPlan, *, scale: float | None = None) -> torch.Tensor:
    """`sparse_query_attention_ref` for batch 1 and rows at the plan's sorted positions.

    q: [1, H, M, D]; k, v: [1, H_kv, N, D]. Returns [1, H, M, D].
    """
    if q.shape[0] != 1 or k.shape[2] != plan.n_keys:
        raise ValueError(f"blocked attention takes batch 1 and the plan's {plan.n_keys} keys; got q {tuple(q.shape)}, k {tuple(k.shape)}")
    if q.shape[2] == 0:
        return q.new_empty(q.shape[:3] + v.shape[3:])
    if plan.kind == "matmul":
        return _matmul_attention(q, k, v, plan, scale)
    if plan.kind == "split":
        if q.device.type != "cpu":
            raise ValueError(f"split blocks run the CPU flash kernel; got q on {q.device} (build the plan with another kind)")
        parts = [_split_attention(q, k, v, b, bias, scale) for b, bias in zip(plan.split, plan.tail_biases(q.dtype))]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
    gqa = q.shape[1] != k.shape[1]
    parts = [
        F.scaled_dot_product_attention(q[:, :, b.rows], k[:, :, b.lo : b.hi], v[:, :, b.lo : b.hi], attn_mask=bias,
                                       scale=scale, enable_gqa=gqa)
        for b, bias in zip(plan.blocks, plan.block_biases(q.dtype))
    ]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
