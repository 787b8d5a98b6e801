"""RoPE arithmetic on cached keys: moving a key from the position it was computed at to another.
"""

from __future__ import annotations

import torch


def rerotate(keys: torch.Tensor, delta: int | torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Move RoPE keys [..., T, D] by `delta` positions: k cos(d) + rotate_half(k) sin(d).

    delta: one int for every row, or [T] per row. Computed in fp32 and cast back (differentiable
    in `keys`). RoPE rotations compose, so a key rotated for position p becomes exactly the key
    for p + delta; attention scaling is already inside the cached key.
    """
    if isinstance(delta, int) and delta == 0:
        return keys
    angle = torch.as_tensor(delta, dtype=torch.float64)[..., None] * inv_freq.to(torch.float64).cpu()  # [(T,) D/2]
    cos = angle.cos().to(torch.float32).to(keys.device)
    sin = angle.sin().to(torch.float32).to(keys.device)
    k = keys.to(torch.float32)
    half = k.shape[-1] // 2
    # rotate_half(k) is [-k2, k1]: two multiply-adds on the halves instead of building it.
    out = k * torch.cat([cos, cos], dim=-1)
    out[..., :half].addcmul_(k[..., half:], -sin)
    out[..., half:].addcmul_(k[..., :half], sin)
    return out.to(keys.dtype)
