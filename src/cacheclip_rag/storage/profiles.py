"""The calibrated selection profile of a model pair: which aux layers score tokens, and how.

`cacheclip calibrate` measures it offline (`calibrate.py`); the store keeps one per model pair and
calibration length; the package ships them for the default pair. At request time the engine
takes the profile calibrated nearest the request's length (`nearest`) and fills the selection
settings the engine config leaves open from it (`resolve`). This module is the one place that
reads, validates, chooses and applies profiles; it knows neither the engine nor calibration.

On disk (store document "profile", shipped files) a profile is a flat JSON object: the fields of
`Profile`, plus what calibration measured (`Profile.measured`: criterion, KL, baselines, ...).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from ..config import SCORING_CHOICES
from ..select_config import check_stale

log = logging.getLogger(__name__)

DEFAULT_LENGTH = 2048
"""The length a profile that names none counts as (calibration's default)."""


@dataclass(frozen=True)
class Profile:
    """How the aux model of one pair scores tokens, as calibrated at some request lengths.

    primary, aux: the weights fingerprints of the pair it was calibrated for.
    aux_layers: the aux layers whose query-to-chunk attention is averaged.
    head_agg, row_agg, normalize, context: as `SelectConfig`'s fields of those names.
    lengths: the request lengths (tokens) of the calibration inputs.
    auto_share: the aux attention mass recompute_ratio="auto" covers (`auto_share.calibrate_share`:
        the share whose mean recomputed fraction on calibration inputs equals a fixed ratio's).
    stale_layers, stale_on, cascade_factor: the staleness selectors' settings for this pair
        (`SelectConfig`'s fields of those names, chosen by `cacheclip bench fidelity`), or None.
    source: "store", "shipped", or "shipped for the base primary" (a tuned primary's fallback).
    measured: what calibration measured (criterion, kl, baselines, ...), for reports only.
    """

    primary: str
    aux: str
    aux_layers: tuple[int, ...]
    head_agg: str = "mean"
    row_agg: str = "mean"
    normalize: str = "none"
    context: str = "chunk"
    lengths: tuple[int, ...] = (DEFAULT_LENGTH,)
    auto_share: float | None = None
    stale_layers: int | None = None
    stale_on: str | None = None
    cascade_factor: float | None = None
    primary_name: str = ""
    aux_name: str = ""
    created: str = ""
    source: str = "store"
    measured: Mapping[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        for name in ("primary", "aux"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"profile {name} must be a weights fingerprint (a non-empty string), "
                                 f"got {getattr(self, name)!r}")
        object.__setattr__(self, "aux_layers", _int_tuple("aux_layers", self.aux_layers, minimum=None))
        object.__setattr__(self, "lengths", _int_tuple("lengths", self.lengths, minimum=1))
        for name, allowed in SCORING_CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"profile {name} must be one of {list(allowed)}, got {getattr(self, name)!r}")
        share = self.auto_share
        if share is not None and (isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1):
            raise ValueError(f"profile auto_share must be a number in (0, 1] or absent, got {share!r}")
        check_stale(self.stale_layers, self.stale_on, self.cascade_factor, "profile ")
        object.__setattr__(self, "measured", MappingProxyType(dict(self.measured)))

    @property
    def length(self) -> float:
        """The length it was calibrated at: the geometric mean of its lengths."""
        return math.exp(sum(math.log(n) for n in self.lengths) / len(self.lengths))

    @property
    def key(self) -> tuple:
        """What identifies it in a store: the pair and the calibration lengths."""
        return self.primary, self.aux, tuple(sorted(self.lengths))

    def describe(self) -> str:
        """One line of its settings, for the CLI."""
        stale = "".join(f", {name} {getattr(self, name)}" for name in ("stale_layers", "stale_on", "cascade_factor")
                        if getattr(self, name) is not None)
        return (f"aux layers {list(self.aux_layers)}, heads {self.head_agg}, rows {self.row_agg}, "
                f"normalize {self.normalize}, context {self.context}{stale}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str | None = None) -> Profile:
        """A profile from its JSON object; a ValueError naming the first bad field."""
        if not isinstance(data, Mapping):
            raise ValueError(f"a profile must be a JSON object, got {type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls)} - {"measured"}
        known = {k: v for k, v in data.items() if k in names}
        missing = [name for name in ("primary", "aux", "aux_layers") if name not in known]
        if missing:
            raise ValueError(f"a profile needs {missing}; got the fields {sorted(data)}")
        if source is not None:
            known["source"] = source
        measured = {k: v for k, v in data.items() if k not in names}
        return cls(**known, measured=measured)

    def to_dict(self) -> dict[str, Any]:
        """The flat JSON object it is stored as (`from_dict` reads it back)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "measured"}
        out.update(aux_layers=list(self.aux_layers), lengths=list(self.lengths))
        return {**dict(self.measured), **out}


def _int_tuple(name: str, value, minimum: int | None) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or not value or any(
            not isinstance(x, int) or isinstance(x, bool) or (minimum is not None and x < minimum) for x in value):
        bound = f" >= {minimum}" if minimum is not None else ""
        raise ValueError(f"profile {name} must be a non-empty list of integers{bound}, got {value!r}")
    return tuple(value)


def parse(doc: Any, source: str | None = None) -> list[Profile]:
    """The profiles of a stored document, shortest calibration length first: {"profiles": [...]},
    or one profile object (stores written before profiles were kept per length). A profile that
    does not validate is skipped with a warning (it was written by another version, or damaged)."""
    if doc is None:
        return []
    items = doc.get("profiles", [doc]) if isinstance(doc, Mapping) else []
    out = []
    for item in items if isinstance(items, list) else []:
        try:
            out.append(Profile.from_dict(item, source))
        except (ValueError, TypeError) as err:
            log.warning("skipping an invalid selection profile: %s", err)
    return sorted(out, key=lambda p: p.length)


def document(profiles: Iterable[Profile]) -> dict:
    """The stored document of `profiles` (shortest first): {"profiles": [...]}."""
    return {"profiles": [p.to_dict() for p in sorted(profiles, key=lambda p: p.length)]}


def merged(profiles: Iterable[Profile], new: Profile) -> list[Profile]:
    """`profiles` with `new` added: one for the same pair at the same lengths is replaced, those
    at other lengths are kept (requests take the one nearest their length)."""
    return sorted([*(p for p in profiles if p.key != new.key), new], key=lambda p: p.length)


