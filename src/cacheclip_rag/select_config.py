"""The selection settings: how a request's rows are chosen (`SelectConfig`) and the values its
fields and the calibrated profiles (`storage/profiles.py`) may take. Part of the engine config
(`config.py` re-exports every name); a module of its own so that each stays one concern.
"""

from __future__ import annotations

from dataclasses import dataclass


def check_positive(name: str, value: int) -> None:
    """Refuse anything but a positive integer, naming the setting."""
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def check_stale(layers, on, factor, what: str = "") -> None:
    """Refuse stale_layers other than a positive integer, stale_on other than `STALE_ON` and a
    cascade_factor below 1 (None: unset); `what` prefixes the setting's name ("profile ")."""
    if layers is not None:
        check_positive(f"{what}stale_layers", layers)
    if on not in (*STALE_ON, None):
        raise ValueError(f"{what}stale_on must be one of {list(STALE_ON)} or absent, got {on!r}")
    if factor is not None and (isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor < 1):
        raise ValueError(f"{what}cascade_factor must be a number >= 1, got {factor!r}")


STALE_DEFAULTS = {"stale_layers": 3, "stale_on": "kv", "cascade_factor": 2.5}
"""The staleness selectors' settings where neither the engine config nor the pair's calibrated
profile sets them (`cacheclip bench fidelity` chose them on MuSiQue questions 0-109)."""

STALE_ON = ("k", "v", "kv")

AUX_CONTEXTS = ("chunk", "joint")

SCORING_CHOICES = {"head_agg": ("mean", "max"), "row_agg": ("mean", "max"), "normalize": ("none", "chunk"),
                   "context": AUX_CONTEXTS}
"""The values each aggregation setting of the aux scoring may take (`SelectConfig`, `profile.Profile`)."""

DEFAULT_AUTO_SHARE = 0.5
"""The aux attention mass recompute_ratio="auto" covers where no calibrated profile sets one."""


@dataclass(frozen=True)
class SelectConfig:
    """CacheClip token selection: how aux attention becomes one score per token, and grouping.

    score_layers: aux layers whose query-to-chunk attention is averaged; None means the model
        pair's calibrated profile when the store has one, else the last layer (the paper's choice).
    head_agg, row_agg: aggregation over heads and over query rows ("mean" or "max").
    normalize: "none" keeps each chunk's scores as the softmax gave them (each chunk had its own
        softmax over prefix + chunk + query); "chunk" rescales each chunk's scores to sum 1.
    For each of these five, None means: the calibrated profile's choice, else the default
    (last layer, "mean", "mean", "none", "chunk"); a value set here overrides the profile.
    context: what the aux query reads when it scores. "chunk" (the paper): each chunk with the
        query, as a batch, one softmax per chunk; "joint": every chunk at once at its assembled
        position, one softmax over all of them; the query runs once instead of once per chunk
        and carries what one chunk says into its reading of the next. "joint" needs the whole
        request within the aux model's positions; a longer one is scored per chunk.
    window, tau: grouping window w and density threshold tau (paper defaults 8 and 5).
    auto_share, auto_floor, auto_cap: recompute_ratio="auto" recomputes the fewest top-scored
        tokens that hold `auto_share` of the aux attention mass on the chunks, as a fraction of
        the chunk tokens kept within [auto_floor, auto_cap]; auto_share None: the calibrated
        profile's, else `DEFAULT_AUTO_SHARE`.
    chunk_start_tokens: also recompute the first n tokens of every chunk (experimental, default
        0): each chunk was prefilled as the start of its own sequence, so its first tokens carry
        attention-sink K/V that full attention would not have there (EPIC's argument). They are
        added to the selection and counted in the effective fraction.
    stale_layers, stale_on, stale_target, cascade_factor: the staleness selectors
        (`selectors/aux_staleness.py`): aux layers read, K/V/both, the staleness per row "auto"
        may leave, how many times the budget `cascade` proposes. stale_layers, stale_on and
        cascade_factor None: the calibrated profile's, else `STALE_DEFAULTS`.
    """

    score_layers: tuple[int, ...] | None = None
    head_agg: str | None = None
    row_agg: str | None = None
    normalize: str | None = None
    context: str | None = None
    window: int = 8
    tau: int = 5
    chunk_start_tokens: int = 0
    auto_share: float | None = None
    auto_floor: float = 0.05
    auto_cap: float = 0.5
    stale_layers: int | None = None
    stale_on: str | None = None
    stale_target: float = 0.025
    cascade_factor: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.chunk_start_tokens, int) or isinstance(self.chunk_start_tokens, bool) \
                or self.chunk_start_tokens < 0:
            raise ValueError(f"chunk_start_tokens must be a non-negative integer, got {self.chunk_start_tokens!r}")
        check_positive("window", self.window)
        check_positive("tau", self.tau)
        if self.tau > self.window:
            raise ValueError(f"tau must be <= window ({self.window}), got {self.tau}")
        if self.score_layers is not None:
            if isinstance(self.score_layers, int) or not self.score_layers or not all(
                isinstance(x, int) and not isinstance(x, bool) for x in self.score_layers
            ):
                raise ValueError(f"score_layers must be a non-empty tuple of layer indices or None, got {self.score_layers!r}")
            object.__setattr__(self, "score_layers", tuple(self.score_layers))
        for name in ("auto_share", "auto_floor", "auto_cap", "stale_target"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not 0.0 < value <= 1.0):
                raise ValueError(f"{name} must be a number in (0, 1], got {value!r}")
        check_stale(self.stale_layers, self.stale_on, self.cascade_factor)
        if self.auto_floor > self.auto_cap:
            raise ValueError(f"auto_floor ({self.auto_floor}) must not exceed auto_cap ({self.auto_cap})")
        for name, allowed in SCORING_CHOICES.items():
            if getattr(self, name) not in (*allowed, None):
                raise ValueError(f"{name} must be one of {list(allowed)}, got {getattr(self, name)!r}")


BUDGETS = ("paper", "keep")
"""paper: top-k candidates, then grouping, whatever remains. keep: candidates are added in
score order until the grouped set reaches the requested fraction."""
