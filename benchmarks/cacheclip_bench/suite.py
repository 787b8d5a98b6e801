"""The needle suite's parameters, one type: which lengths, variants, samples and seeds a bench runs.

`bench niah`, `fidelity`, `deviation` and `store` all run on the same generated samples; each takes
a `Suite` (built from the command line by `Suite.from_args`) instead of four loose arguments.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cacheclip_rag.analysis import VARIANTS


@dataclass(frozen=True)
class Suite:
    """lengths: context lengths in primary tokens; variants: needle variants (None: all eight);
    samples: samples per variant and length; seed: the first sample's seed (seeds run from it)."""

    lengths: Sequence[int] = (2048,)
    variants: Sequence[str] | None = None
    samples: int = 5
    seed: int = 0

    def __post_init__(self) -> None:
        if self.samples < 1:
            raise ValueError(f"samples must be at least 1, got {self.samples}")
        if not self.lengths or any(n < 1 for n in self.lengths):
            raise ValueError(f"lengths must be positive token counts, got {list(self.lengths)}")
        unknown = [v for v in self.variants or () if v not in VARIANTS]
        if unknown:
            raise ValueError(f"unknown needle variants {unknown}; known: {list(VARIANTS)}")

    @classmethod
    def from_args(cls, args, samples: int | None = None) -> Suite:
        """The suite of a bench's --lengths, --variants, --samples and --seed (samples: overrides)."""
        return cls(lengths=tuple(args.lengths), variants=tuple(args.variants) if args.variants else None,
                   samples=args.samples if samples is None else samples, seed=args.seed)

    @property
    def variant_names(self) -> tuple[str, ...]:
        return tuple(self.variants or VARIANTS)

    def __len__(self) -> int:
        """How many samples the suite holds (what a progress bar counts)."""
        return len(self.lengths) * len(self.variant_names) * self.samples

    def holds(self, length: int, variant: str, seed: int) -> bool:
        """Whether a sample of this (length, variant, seed) belongs to the suite."""
        return length in self.lengths and variant in self.variant_names and self.seed <= seed < self.seed + self.samples
