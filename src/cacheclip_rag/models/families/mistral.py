"""Mistral: the Llama layout; a set `sliding_window` applies to every layer (Mistral 7B v0.1)."""

from .base import FULL, SLIDING, Family


class Mistral(Family):
    model_types = ("mistral",)

    def _layer_types(self) -> list[str]:
        kind = SLIDING if getattr(self.config, "sliding_window", None) else FULL
        return [kind] * len(self.layers)
