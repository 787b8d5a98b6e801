"""`int8`: 8-bit codes with float16 scales, 8.25 bits an element at head_dim 64 (1.94x fewer bytes
than bf16; a chunk's last, partial key group costs a little more):

- keys per channel, as KIVI ("KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache",
  arXiv 2402.02750) groups them (a key's outlier channels would otherwise set the step of every
  channel of its token), asymmetric: a group is 128 neighbouring tokens of one channel with a
  float16 step and minimum. A rotated key's low-frequency channels sit off zero, which a
  symmetric step pays for with half its codes: on the default primary's real caches the
  relative error of the keys is 0.26% against 0.38% for symmetric 64-token groups, at the same
  bits (0.23% for asymmetric 64-token groups would cost 0.25 bit more);
- values per token, symmetric: a float16 step per 64 channels of one token (the whole head
  where 64 does not divide it).

Error at most half a step ((max - min) / 510 of a key group, |x| max / 254 of a value group),
plus the float32 arithmetic of the decode (2^-22 of the value).

Layout 3. Layout 1 (keys per token) was replaced after `cacheclip bench store` measured its
ProphetKV KL at 2K outside bf16's interval (0.0203 against [0.0166, 0.0186]); layout 2 (keys
symmetric per 64 tokens) after ProphetKV's needle score stayed 2.1 points under bf16's at n = 180.
Records of an older layout are rebuilt from their text when read."""

from __future__ import annotations

import torch

from . import quant
from .base import Kind, register

GROUP = 64
"""Channels a value step covers."""
KEY_GROUP = 128
"""Tokens a key step and minimum cover."""


class Int8:
    name = "int8"
    bits = 8 + 16 / GROUP
    layout = 3

    def encode(self, kind: Kind, x: torch.Tensor) -> torch.Tensor:
        quant.check_range(x, self.name)
        codes, step, lo = self._quantize(kind, x)
        if kind == "k":  # codes [H, D, groups, G] along tokens -> [H, T, D]
            codes = quant.ungroup(codes, x.shape[1]).transpose(1, 2)
            return quant.as_bytes(codes.contiguous(), step, lo, heads=x.shape[0])
        return quant.as_bytes(codes.contiguous(), step, heads=x.shape[0])

    def decode(self, kind: Kind, stored: torch.Tensor, tokens: int, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
        if kind == "k":
            scales = (torch.float16, (head_dim, -(-tokens // KEY_GROUP)))
            codes, step, lo = quant.split_bytes(stored, (torch.uint8, (tokens, head_dim)), scales, scales)
            return quant.dequantize_tokens(codes, step, lo, KEY_GROUP, dtype)
        size = quant.group_size(head_dim, GROUP)
        n = head_dim // size
        codes, step = quant.split_bytes(stored, (torch.int8, (tokens, n, size)), (torch.float16, (tokens, n)))
        return quant.dequantize(codes, step, None, head_dim, dtype)

    def bound(self, kind: Kind, x: torch.Tensor) -> torch.Tensor:
        _, step, _ = self._quantize(kind, x)
        spread = quant.element_steps(kind, step, x.shape, KEY_GROUP)  # the size is the keys' token group
        product = 255 * spread if kind == "k" else 0  # asymmetric keys: the product code x step, up to 255 steps
        return quant.bound_of(spread, x.float().abs() + product)

    @staticmethod
    def _quantize(kind: Kind, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """codes [..., groups, G], steps and (keys) minima [..., groups]: keys along tokens
        ([H, D, groups, G], uint8, asymmetric), values along channels ([H, T, groups, G], int8)."""
        if kind == "k":
            codes, step, lo, _ = quant.asymmetric(x.transpose(1, 2), 8, KEY_GROUP)
            return codes, step, lo
        codes, step, _ = quant.symmetric(x, 8, quant.group_size(x.shape[-1], GROUP))
        return codes, step, None


register(Int8())
