"""Group quantization to small integers with float16 scales, shared by the integer codecs.

A group is G neighbouring elements along one axis of a [H, T, D] tensor; each group keeps its
own float16 step (and, asymmetric, its float16 minimum). Scales are rounded *outwards* to
float16 (the minimum down, the step up), so every element of a group maps into the code range
without clamping and the error of each element is at most half its group's stored step.
"""

from __future__ import annotations

import torch

_TINY = 2.0 ** -24
"""float16's smallest positive value."""
_MAX_F16 = 65504.0


def up_f16(x: torch.Tensor) -> torch.Tensor:
    """float32 -> the float16 at or above it (round to nearest moves at most 2^-11 relative)."""
    return (x * (1 + 2.0 ** -10) + _TINY).to(torch.float16)


def down_f16(x: torch.Tensor) -> torch.Tensor:
    """float32 -> the float16 at or below it."""
    return (x - x.abs() * 2.0 ** -10 - _TINY).to(torch.float16)


def check_range(x: torch.Tensor, codec: str) -> None:
    if not torch.isfinite(x).all() or x.abs().max() > _MAX_F16 / 2:
        raise ValueError(f"KV codec {codec!r}: values beyond float16's range or not finite (max |x| "
                         f"{x.abs().max().item():.3g}); store these caches with kv_codec='bf16'")


def groups(x: torch.Tensor, size: int) -> tuple[torch.Tensor, int]:
    """x [..., N] -> [..., ceil(N / size), size] float32, the last group padded by repeating the
    last element (so no group's minimum or maximum changes); and N."""
    n = x.shape[-1]
    pad = (-n) % size
    x = x.float()
    if pad:
        x = torch.cat([x, x[..., -1:].expand(*x.shape[:-1], pad)], dim=-1)
    return x.reshape(*x.shape[:-1], -1, size), n


def ungroup(g: torch.Tensor, n: int) -> torch.Tensor:
    """[..., groups, size] -> [..., n]: the padding dropped."""
    return g.reshape(*g.shape[:-2], -1)[..., :n]


def symmetric(x: torch.Tensor, bits: int, size: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Quantize along the last axis in groups of `size`: codes [..., groups, size] (int8, in
    +-(2^(bits-1) - 1)), steps [..., groups] float16, and the axis length."""
    g, n = groups(x, size)
    top = 2 ** (bits - 1) - 1
    step = up_f16(g.abs().amax(-1) / top)
    codes = torch.round(g / step.float().unsqueeze(-1)).clamp_(-top, top).to(torch.int8)
    return codes, step, n


def asymmetric(x: torch.Tensor, bits: int, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Quantize along the last axis in groups of `size`: codes [..., groups, size] (uint8 in
    [0, 2^bits - 1]), steps and minima [..., groups] float16, and the axis length."""
    g, n = groups(x, size)
    lo = down_f16(g.amin(-1))
    step = up_f16((g.amax(-1) - lo.float()) / (2 ** bits - 1))
    codes = torch.round((g - lo.float().unsqueeze(-1)) / step.float().unsqueeze(-1))
    return codes.clamp_(0, 2 ** bits - 1).to(torch.uint8), step, lo, n


def _scale_into(out: torch.Tensor, codes: torch.Tensor, step: torch.Tensor, lo: torch.Tensor | None) -> None:
    """out = codes x step (+ lo), broadcast, computed in float32 and rounded once into out's dtype.

    The codes are widened to float32 first and scaled in place: torch's CPU loops over mixed
    dtypes (integer codes, float32 scales, a bfloat16 result) cast element by element, while a
    widening copy, a float32 multiply-add and a narrowing copy each run vectorized, together
    about 3x faster on a block of layers of one chunk (the cold read's critical path)."""
    wide = out if out.dtype == torch.float32 else torch.empty(out.shape, dtype=torch.float32)
    wide.copy_(codes)
    if lo is None:
        wide.mul_(step)
    else:
        torch.addcmul(lo, wide, step, out=wide)
    if wide is not out:
        out.copy_(wide)


def dequantize(codes: torch.Tensor, step: torch.Tensor, lo: torch.Tensor | None, n: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """codes [..., groups, size] with steps (and minima) [..., groups] -> [..., n] in `dtype`."""
    out = torch.empty(codes.shape, dtype=dtype)
    _scale_into(out, codes, step.float().unsqueeze(-1), None if lo is None else lo.float().unsqueeze(-1))
    return ungroup(out, n)


def dequantize_tokens(codes: torch.Tensor, step: torch.Tensor, lo: torch.Tensor | None, size: int,
                      dtype: torch.dtype) -> torch.Tensor:
    """Keys quantized per channel along tokens back to values: codes [H, T, D] with steps (and
    minima) [H, D, ceil(T / size)], each shared by `size` neighbouring tokens of one channel ->
    [H, T, D] in `dtype`, decoded group by group straight into the result."""
    heads, tokens, dim = codes.shape
    out = torch.empty(codes.shape, dtype=dtype)
    full = tokens // size * size
    groups = full // size

    def scales(t: torch.Tensor | None, part: slice) -> torch.Tensor | None:
        # [H, g, 1, D], contiguous: a strided inner axis would keep the multiply-add from vectorizing
        return None if t is None else t[..., part].float().transpose(1, 2).contiguous().unsqueeze(2)

    if full:
        _scale_into(out[:, :full].view(heads, groups, size, dim),
                    codes[:, :full].reshape(heads, groups, size, dim),
                    scales(step, slice(0, groups)), scales(lo, slice(0, groups)))
    if full < tokens:
        last = slice(groups, groups + 1)
        _scale_into(out[:, full:].unsqueeze(1), codes[:, full:].unsqueeze(1), scales(step, last), scales(lo, last))
    return out


def token_spread(step: torch.Tensor, size: int, tokens: int) -> torch.Tensor:
    """Per-channel steps [H, D, groups] of `size` tokens each -> [H, T, D] float32, each element's."""
    return ungroup(step.float().unsqueeze(-1).expand(*step.shape, size), tokens).transpose(1, 2)


def channel_spread(step: torch.Tensor, n: int) -> torch.Tensor:
    """Per-token steps [H, T, groups] of channels -> [H, T, n] float32, each element's."""
    size = -(-n // step.shape[-1])
    return ungroup(step.float().unsqueeze(-1).expand(*step.shape, size), n)


def element_steps(kind: str, step: torch.Tensor, shape: torch.Size, size: int) -> torch.Tensor:
    """Each element's step, [H, T, D] float32, for the layout the integer codecs share: keys
    ("k") per channel over `size` tokens, values per token over channels."""
    return token_spread(step, size, shape[1]) if kind == "k" else channel_spread(step, shape[2])


ROUNDING = 2.0 ** -22
"""The decode's float32 arithmetic moves a value by at most this share of the largest value it
handles (a product and a sum, each rounded to within 2^-24 of its own size); a codec's bound adds it."""


def bound_of(step: torch.Tensor, size: torch.Tensor) -> torch.Tensor:
    """Half a step (rounding to the code) plus the float32 arithmetic of the decode on values of
    at most `size` (the decoded value, and the product code x step where a minimum is added)."""
    return step / 2 + (size + step / 2) * ROUNDING


def pack4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes < 16, [..., 2m] -> [..., m]: two codes a byte, the even one in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack4(packed: torch.Tensor) -> torch.Tensor:
    """[..., m] -> uint8 codes [..., 2m] (`pack4` undone)."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(*packed.shape[:-1], -1)


def group_size(n: int, preferred: int) -> int:
    """The group size along an axis of n: `preferred`, or n itself where it does not divide n."""
    return preferred if n % preferred == 0 else n


def as_bytes(*parts: torch.Tensor, heads: int) -> torch.Tensor:
    """Tensors whose first axis is the head, flattened to bytes and laid side by side: [H, bytes]."""
    return torch.cat([p.contiguous().reshape(heads, -1).view(torch.uint8) for p in parts], dim=1).contiguous()


def split_bytes(stored: torch.Tensor, *specs: tuple[torch.dtype, tuple[int, ...]]) -> list[torch.Tensor]:
    """`as_bytes` undone: [H, bytes] -> one tensor per (dtype, shape after the head axis), views
    of `stored` where the byte offsets allow (no copy), else copies."""
    if stored.dim() != 2 or stored.dtype != torch.uint8:
        raise ValueError(f"stored tensor must be [heads, bytes] uint8, got {tuple(stored.shape)} {stored.dtype}")
    heads, out, at = stored.shape[0], [], 0
    for dtype, shape in specs:
        count = 1
        for s in shape:
            count *= s
        width = count * torch.empty((), dtype=dtype).element_size()
        if at + width > stored.shape[1]:
            raise ValueError(f"stored tensor holds {stored.shape[1]} bytes a head; its layout needs at least {at + width}")
        part = stored[:, at:at + width]
        try:
            part = part.view(dtype)
        except RuntimeError:  # offsets not aligned to the dtype: copy
            part = part.contiguous().view(dtype)
        out.append(part.reshape(heads, *shape))
        at += width
    if at != stored.shape[1]:
        raise ValueError(f"stored tensor holds {stored.shape[1]} bytes a head; its layout needs {at}")
    return out
