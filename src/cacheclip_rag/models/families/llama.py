"""Llama: the base layout (pre-norm, one RoPE, no sliding window)."""

from .base import Family


class Llama(Family):
    model_types = ("llama",)
