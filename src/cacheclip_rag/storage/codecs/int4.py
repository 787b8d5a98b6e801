"""`int4`: 4-bit codes in the manner of KIVI ("KIVI: A Tuning-Free Asymmetric 2bit Quantization
for KV Cache", arXiv 2402.02750): keys per channel (a group is 64 neighbouring tokens of one
channel, since key outliers sit in fixed channels), values per token (a group is 64 channels of
one token); asymmetric, a float16 step and minimum per group, two codes a byte. 4.5 bits an
element: 3.5x fewer bytes than bf16 (a chunk's last, partial key group costs a little more).
Error at most half a step ((max - min) / 30 of its group), plus the float32 arithmetic of the
decode (2^-22 of the value)."""

from __future__ import annotations

import torch

from . import quant
from .base import Kind, register

GROUP = 64


class Int4:
    name = "int4"
    bits = 4 + 32 / GROUP
    layout = 1

    def encode(self, kind: Kind, x: torch.Tensor) -> torch.Tensor:
        quant.check_range(x, self.name)
        if x.shape[-1] % 2:
            raise ValueError(f"KV codec 'int4' packs two channels a byte; head_dim {x.shape[-1]} is odd")
        codes, step, lo = self._quantize(kind, x)
        heads, tokens, dim = x.shape
        if kind == "k":  # codes [H, D, groups, G] along tokens -> [H, T, D] to pack channel pairs
            codes = quant.ungroup(codes, tokens).transpose(1, 2)
        else:
            codes = quant.ungroup(codes, dim)
        return quant.as_bytes(quant.pack4(codes.contiguous()), step, lo, heads=heads)

    def decode(self, kind: Kind, stored: torch.Tensor, tokens: int, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
        if kind == "k":
            n = -(-tokens // GROUP)
            scale_shape = (head_dim, n)
        else:
            n = head_dim // quant.group_size(head_dim, GROUP)
            scale_shape = (tokens, n)
        packed, step, lo = quant.split_bytes(stored, (torch.uint8, (tokens, head_dim // 2)),
                                             (torch.float16, scale_shape), (torch.float16, scale_shape))
        codes = quant.unpack4(packed)  # [H, T, D]
        if kind == "v":
            g = codes.reshape(*codes.shape[:2], n, -1)  # [H, T, groups, G]: channels split evenly
            return quant.dequantize(g, step, lo, head_dim, dtype)
        return quant.dequantize_tokens(codes, step, lo, GROUP, dtype)

    def bound(self, kind: Kind, x: torch.Tensor) -> torch.Tensor:
        _, step, _ = self._quantize(kind, x)
        spread = quant.element_steps(kind, step, x.shape, GROUP)
        return quant.bound_of(spread, x.float().abs() + 15 * spread)  # the product code x step is at most 15 steps

    @staticmethod
    def _quantize(kind: Kind, x: torch.Tensor):
        """codes [..., groups, G], steps and minima [..., groups]: keys along tokens
        ([H, D, groups, G]), values along channels ([H, T, groups, G])."""
        if kind == "k":
            codes, step, lo, _ = quant.asymmetric(x.transpose(1, 2), 4, GROUP)
        else:
            codes, step, lo, _ = quant.asymmetric(x, 4, quant.group_size(x.shape[-1], GROUP))
        return codes, step, lo


register(Int4())
