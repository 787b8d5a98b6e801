"""The `Selector` protocol and registry: every KV method is one selector, keyed by its mode name.

A selector turns a `Prepared` request into a `Plan` (plan.py). The API, the CLI and the benches
list modes from this registry, so a new method is one file that calls `register`. Built-in
selectors live in `cacheclip_rag.selectors`, one file each, and register when that package is
imported (the engine imports it, so `import cacheclip_rag` registers them); analysis-only ones
(the attention oracle) register from the benchmark harness, through `cacheclip_rag.analysis`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from ..config import AUTO
from .plan import Plan

if TYPE_CHECKING:  # a Prepared request carries its selector: the two types name each other
    from .context import Prepared


class Selector:
    """One KV method. Subclass, set the class attributes, implement `plan`, then `register()` it.

    name: the mode name users pass. fixed_ratio: the recompute ratio the method always has (full
    1.0, reuse 0.0), None when the request's ratio applies. uses_aux: the plan runs the aux model;
    the executor runs it on a worker thread while the primary caches load and are assembled, so
    such a plan must keep every token at its own position (`Plan.positions` None). analysis_only: needs
    more than full attention costs (shown starred in tables). row_set: the plan is a set of rows
    and nothing else, so an analysis can replay it (teacher-forced fidelity). packets: the request
    runs on KV Packet caches (each chunk wrapped in the trained adapters; its layout holds their
    soft rows), so it needs the engine's adapters. adaptive: takes recompute_ratio="auto" (the
    plan decides how many rows from its own scores); other methods refuse it.
    """

    name: ClassVar[str]
    fixed_ratio: ClassVar[float | None] = None
    uses_aux: ClassVar[bool] = False
    packets: ClassVar[bool] = False
    adaptive: ClassVar[bool] = False
    analysis_only: ClassVar[bool] = False
    row_set: ClassVar[bool] = True

    def plan(self, prepared: Prepared) -> Plan:
        """The rows this method recomputes for the request (shapes: see `Plan`). For a method
        without a fixed ratio it is called only for 0 < ratio < 1 and a request with chunks."""
        raise NotImplementedError

    def plan_for(self, prepared: Prepared) -> Plan:
        """The plan, with the edges every ratio-driven method shares: nothing at ratio 0 (or
        without chunks), every chunk row at ratio 1 (the oracles: direct reuse, full prefill)."""
        if self.fixed_ratio is not None:
            return self.plan(prepared)
        chunk_rows, ratio = prepared.layout.chunk_rows(), prepared.request.ratio
        if chunk_rows.numel() == 0 or (ratio != AUTO and ratio <= 0):
            return Plan()
        if ratio != AUTO and ratio >= 1:
            return Plan(rows=chunk_rows)
        return self.plan(prepared)

    def wants_aux(self, prepared: Prepared) -> bool:
        """Whether this request's plan needs the aux model (it is skipped at ratio 0 or 1)."""
        ratio = prepared.request.ratio
        return self.uses_aux and (ratio == AUTO or 0 < ratio < 1) and bool(prepared.layout.chunk_segments())


_REGISTRY: dict[str, Selector] = {}


def register(selector: Selector) -> Selector:
    """Add a selector under its name (a second registration of one name replaces the first)."""
    name = getattr(selector, "name", None)
    if not isinstance(name, str) or not name or not name.replace("-", "").replace("+", "").replace("_", "").isalnum():
        raise ValueError(f"a selector needs a mode name of letters, digits, '-', '+' or '_', got {name!r}")
    _REGISTRY[name] = selector
    return selector


def unregister(name: str) -> None:
    _REGISTRY.pop(name, None)


def modes() -> tuple[str, ...]:
    """Every registered mode name, built-ins first, in registration order."""
    return tuple(_REGISTRY)


def get(name: str) -> Selector:
    """The selector of a mode; a ValueError naming the registered modes for an unknown one."""
    selector = _REGISTRY.get(name) if isinstance(name, str) else None
    if selector is None:
        raise ValueError(f"mode must be one of {list(_REGISTRY)}, got {name!r}")
    return selector
