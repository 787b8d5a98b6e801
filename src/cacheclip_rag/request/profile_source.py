"""Which selection settings a request runs with: the profile source and its resolution.

`ProfileSource` holds the calibrated profiles of one model pair (the store's, else those the
package ships for an embedded pair), read from the store once and again only when they may have
changed: a profile written through it, or a catch-up that found chunks another process ingested
(`refresh`). A request takes the profile calibrated nearest its length (`nearest`), and the
selection settings the engine config leaves open are filled from it (`resolve`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import threading
from collections.abc import Iterable
from pathlib import Path

from ..config import DEFAULT_AUTO_SHARE, STALE_DEFAULTS, SelectConfig
from ..models import lora
from ..models.loading import EMBEDDED, LoadedModel
from ..storage.profiles import Profile, parse
from ..storage.store import KVStore

SHIPPED_DIR = Path(__file__).parent.parent / "data" / "profiles"
"""Profiles shipped with the package, one file per embedded pair, `<primary>+<aux>.json`:
{"profiles": [...]}, one per calibration length (each the "profile" of `cacheclip calibrate --json`)."""


def nearest(profiles: Iterable[Profile], n_tokens: int | None = None) -> Profile | None:
    """The profile calibrated nearest a request of n_tokens, by ratio of lengths (3K sits between
    2K and 4K); with no length, the shortest one; None for no profiles."""
    profiles = list(profiles)
    if not profiles:
        return None
    if n_tokens is None or n_tokens <= 0:
        return min(profiles, key=lambda p: p.length)
    return min(profiles, key=lambda p: (abs(math.log(n_tokens / p.length)), p.length))


def resolve(cfg: SelectConfig, profile: Profile | None) -> SelectConfig:
    """`cfg` with every scoring field set: its own value, else the profile's, else the default
    (last layer, "mean", "mean", "none", "chunk"; auto_share `DEFAULT_AUTO_SHARE`; the staleness
    settings `STALE_DEFAULTS`)."""
    def pick(name: str, default: str) -> str:
        return getattr(cfg, name) or (getattr(profile, name) if profile else None) or default

    layers = cfg.score_layers or (profile.aux_layers if profile else None) or (-1,)
    share = cfg.auto_share or (profile.auto_share if profile else None) or DEFAULT_AUTO_SHARE
    return dataclasses.replace(cfg, score_layers=tuple(layers), head_agg=pick("head_agg", "mean"),
                               row_agg=pick("row_agg", "mean"), normalize=pick("normalize", "none"),
                               context=pick("context", "chunk"), auto_share=share,
                               **{name: pick(name, default) for name, default in STALE_DEFAULTS.items()})


def shipped(primary_name: str, aux_name: str) -> list[Profile]:
    """The package's profiles for a pair of embedded models, shortest first, marked
    source="shipped"; [] for any other pair. Embedded names pin their weights, so these hold in
    any dtype. A primary tuned by its shipped LoRA (named by `lora.tuned_name`) with no profile of
    its own takes its base pair's, marked "shipped for the base primary"."""
    tuned = {lora.tuned_name(base, sha): base for base, (_, sha) in lora.SHIPPED.items()}
    if (primary_name not in EMBEDDED and primary_name not in tuned) or aux_name not in EMBEDDED:
        return []
    own = _read_shipped(SHIPPED_DIR, f"{primary_name}+{aux_name}.json", "shipped")
    if own:
        return list(own)
    if primary_name in tuned:
        return list(_read_shipped(SHIPPED_DIR, f"{tuned[primary_name]}+{aux_name}.json", "shipped for the base primary"))
    return []


@functools.lru_cache(maxsize=8)
def _read_shipped(folder: Path, name: str, source: str) -> tuple[Profile, ...]:
    """A shipped file's profiles, read and validated once (every request asks for them)."""
    path = folder / name
    return tuple(parse(json.loads(path.read_text()), source)) if path.is_file() else ()
def scoring_layers(aux: LoadedModel, layers: tuple[int, ...]) -> list[int]:
    """The aux layers a config scores with, 0-based and sorted; a ValueError for one the aux
    model does not have (negative indices count from the last)."""
    n = aux.num_layers
    bad = [layer for layer in layers if not -n <= layer < n]
    if bad:
        raise ValueError(f"score_layers {bad} are outside the aux model's {n} layers (valid: {-n} to {n - 1})")
    return sorted({layer % n for layer in layers})


class ProfileSource:
    """The calibrated profiles of one model pair and the settings a request takes from them.

    store: where the pair's profiles are kept; primary, aux: the pair (their fingerprints key
    the stored profiles, their names the shipped ones); select: the engine config's selection
    settings, which win over any profile's.
    """

    def __init__(self, store: KVStore, primary: LoadedModel, aux: LoadedModel, select: SelectConfig):
        self.store, self.primary, self.aux, self.select = store, primary, aux, select
        self._lock = threading.Lock()
        self._profiles: tuple[Profile, ...] | None = None

    def all(self) -> list[Profile]:
        """One profile per calibration length, shortest first: the store's for this pair if it
        holds any, else those shipped for an embedded pair (a new store is calibrated out of the
        box). Read from the store on first use and after `refresh`."""
        with self._lock:
            if self._profiles is None:
                stored = self.store.read_profiles(self.primary.fingerprint, self.aux.fingerprint)
                self._profiles = tuple(stored or shipped(self.primary.name, self.aux.name))
            return list(self._profiles)

    def refresh(self) -> None:
        """Read the store again at the next request (another process may have calibrated)."""
        with self._lock:
            self._profiles = None

    def write(self, profile: Profile) -> None:
        """Store a calibrated profile (it replaces the pair's at the same lengths) and use it."""
        self.store.write_profile(profile)
        self.refresh()

    def nearest(self, n_tokens: int | None = None) -> Profile | None:
        """The profile a request of n_tokens uses (calibrated nearest its length), or None."""
        return nearest(self.all(), n_tokens)

    def aux_depth(self) -> int | None:
        """How many layers the aux model's chunk caches keep (`StoreConfig.aux_depth` "auto"): the
        deepest layer that the engine config or any of the pair's profiles scores with, + 1;
        None (every layer) with aux_depth "all", or where one of them scores with the last layer
        (no profile and no score_layers)."""
        if self.store.cfg.aux_depth == "all":
            return None
        sets = [self.select.score_layers] if self.select.score_layers else []
        profiles = self.all()
        if not profiles and not sets:
            return None
        for profile in profiles:
            if not profile.aux_layers:
                return None
            sets.append(profile.aux_layers)
        n = self.aux.num_layers
        deepest = max(layer % n for layers in sets for layer in layers)
        return deepest + 1 if deepest + 1 < n else None

    def settings(self, n_tokens: int | None = None, score_layers: tuple[int, ...] | None = None,
                 context: str | None = None) -> SelectConfig:
        """The selection config a request of n_tokens runs with, every scoring field set:
        `score_layers` and `context` (a request's), else the engine config's, else those of the
        profile calibrated nearest n_tokens, else the defaults."""
        cfg = resolve(self.select, self.nearest(n_tokens))
        cfg = dataclasses.replace(cfg, score_layers=score_layers) if score_layers else cfg
        return dataclasses.replace(cfg, context=context) if context else cfg
