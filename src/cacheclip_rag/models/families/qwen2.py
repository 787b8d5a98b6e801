"""Qwen2 / Qwen2.5: the Llama layout with q/k/v biases (inside the projections); when
`use_sliding_window` is on, the layers its config's `layer_types` mark attend through a window."""

from .base import Family


class Qwen2(Family):
    model_types = ("qwen2",)
