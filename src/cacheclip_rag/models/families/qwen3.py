"""Qwen3: Qwen2's layout plus per-head RMS norms on q and k, applied before RoPE."""

from .base import Family


class Qwen3(Family):
    model_types = ("qwen3",)
    qk_norm = True
