"""Stage 3 of a request: carry out a plan on the primary model, up to the first token's logits.

Two paths. A full-prefill plan runs the model's own forward over the whole sequence. Every
other plan assembles the request's cache from the chunk caches (one prefix copy, keys re-rotated
to their place; layer by layer, loading layer l + 1 while layer l is recomputed) and recomputes
the plan's rows plus every plain-text row in place. A selector that uses the aux model plans on
a worker thread while the primary caches are opened (CacheClip's CPU/GPU split).
"""

from __future__ import annotations

import time
from concurrent.futures import Executor
from dataclasses import dataclass

import torch

from .assemble import AssembledCache
from .context import Prepared
from .decode import Step, hf_step
from .pipeline import LayerFeeder, start_assembly
from .plan import Plan
from .recompute import LayerHook, loop_prefills_faster, profile_range, recompute_rows
from .selector import Selector


SELECTION = "cacheclip.selection"
"""The profiler range of a selection planned on the request's own thread."""


@dataclass(frozen=True)
class Executed:
    """What execution returns, up to the first token's logits.

    logits: [vocab] for the first new token; step: decodes the following ones; rows: [M] the
    rows recomputed at the last layer; plan: what the selector chose (its `trace` per chunk);
    timings: seconds of selection, load, assemble (taken apart: assemble_read, assemble_rotate,
    assemble_write), recompute and their waits.
    """

    logits: torch.Tensor
    step: Step
    rows: torch.Tensor
    plan: Plan
    timings: dict[str, float]

    @property
    def full_prefill(self) -> bool:
        """The cache came from an ordinary prefill (nothing was reused)."""
        return self.plan.full_prefill

    @property
    def trace(self) -> tuple[dict, ...]:
        return self.plan.trace


def execute(prepared: Prepared, pool: Executor | None) -> Executed:
    """Plan (with the request's selector) and build the request's cache.

    An aux-using selector keeps every token at its own position, so where the pipeline config
    overlaps (`PipelineConfig.overlaps`: by default where the primary is on another device than
    the aux) it plans on `pool`'s worker thread while the primary caches are loaded and
    assembled layer by layer, and recompute starts when the plan arrives (CacheClip's overlap of
    selection with loading). Otherwise it plans first and the loading starts after.
    """
    selector = prepared.selector
    timings = dict.fromkeys(("selection", "load", "assemble", "recompute"), 0.0)
    uses_aux = selector.wants_aux(prepared)
    overlap = uses_aux and pool is not None and prepared.config.pipeline.overlaps(prepared.primary.lm.device,
                                                                                   prepared.aux.lm.device)
    future, plan = None, None
    if overlap:
        future = pool.submit(selector.plan_for, prepared)
    else:
        with profile_range(SELECTION):  # a profile tells the selection's own layer loops from the recompute's
            plan = selector.plan_for(prepared)  # an aux selection first: nothing competes with it
        timings["selection"] = plan.seconds  # on the critical path (ProphetKV's first stage, too)
        if uses_aux:
            _check_keeps_positions(selector, plan)
            timings["selection_wait"] = plan.seconds
            timings["selection_hidden"] = 0.0
        elif plan.full_prefill:
            return _full_prefill(prepared, plan, timings)
    start = time.perf_counter()
    sources = {seg.chunk_id: _source(prepared, seg) for seg in prepared.layout.chunk_segments()}
    timings["load"] = time.perf_counter() - start
    primary, layout = prepared.primary, prepared.layout
    cache, feeder = start_assembly(primary.lm, layout, primary.prefix(), sources,
                                   plan.positions if plan is not None else None,
                                   layout.num_tokens + prepared.request.options.max_new_tokens, primary.rebuild,
                                   pipelined=prepared.config.pipeline.layerwise_loading, on_loaded=primary.remember)
    if future is not None:
        t = time.perf_counter()
        plan = future.result()
        if plan.positions is not None:
            feeder.finish()
        _check_keeps_positions(selector, plan)
        timings["selection"] = plan.seconds
        timings["selection_wait"] = time.perf_counter() - t
        timings["selection_hidden"] = max(0.0, plan.seconds - timings["selection_wait"])
    return _recompute(prepared, plan, cache, feeder, start, timings)


def _check_keeps_positions(selector: Selector, plan: Plan) -> None:
    """An aux selector's plan keeps every token at its place (the cache may be assembled while it plans)."""
    if plan.positions is not None:
        raise ValueError(f"selector {selector.name!r} uses the aux model and moves token positions; an aux "
                         "selector's plan must keep positions (the cache is assembled while it plans)")


def _source(prepared: Prepared, seg):
    if prepared.config.pipeline.layerwise_loading:
        return prepared.primary.open_layers(seg.chunk_id, seg.text)
    return prepared.primary.get(seg.chunk_id, seg.text)


def by_loop(prepared: Prepared) -> bool:
    """Whether this request's full prefill runs through the recompute loop (`EngineConfig.full_prefill`)."""
    config, lm = prepared.config, prepared.primary.lm
    if config.full_prefill != "auto":
        return config.full_prefill == "loop"
    return loop_prefills_faster(config.attention_backend, lm.device, lm.dtype)


def _full_prefill(prepared: Prepared, plan: Plan, timings: dict[str, float]) -> Executed:
    """Nothing reused: every row computed, by the model's own forward or by the recompute loop
    over every row into a fresh cache (`by_loop`); the same arithmetic either way."""
    lm, layout = prepared.primary.lm, prepared.layout
    rows = torch.arange(layout.prefix_len, layout.num_tokens)
    t = time.perf_counter()
    if by_loop(prepared):
        every = torch.arange(layout.num_tokens)  # each row, at its own position
        cache = AssembledCache.empty(lm, layout.num_tokens + prepared.request.options.max_new_tokens)
        result = recompute_rows(lm, cache, layout.input_ids, every, backend=prepared.config.attention_backend,
                                embed=prepared.embed())
        timings["recompute"] = time.perf_counter() - t
        return Executed(result.logits, own_step(prepared, cache, every, None), rows, plan, timings)
    with torch.inference_mode():
        out = lm.model(input_ids=layout.input_ids[None].to(lm.device), use_cache=True, logits_to_keep=1)
    timings["recompute"] = time.perf_counter() - t
    return Executed(out.logits[0, -1].float().cpu(), hf_step(lm, out.cache, layout.num_tokens), rows, plan, timings)


def _recompute(prepared: Prepared, plan: Plan, cache: AssembledCache, feeder: LayerFeeder, start: float,
               timings: dict[str, float]) -> Executed:
    """Recompute the plan's rows and every plain-text row in the assembled cache."""
    layout, config = prepared.layout, prepared.config
    t = time.perf_counter()
    positions = plan.positions if plan.positions is not None else torch.arange(layout.num_tokens)
    rows = torch.unique(torch.cat([layout.uncached_rows(), plan.rows]))  # sorted
    result = recompute_rows(prepared.primary.lm, cache, layout.input_ids, rows, positions=positions,
                            backend=config.attention_backend, hook=plan.hook, layer_ready=feeder.wait,
                            embed=prepared.embed())
    feeder.finish()
    timings["assemble"] = feeder.busy  # loading + re-rotation per layer, overlapped when pipelined
    timings.update({f"assemble_{stage}": seconds for stage, seconds in feeder.stages.items()})
    timings["load_wait"] = feeder.waited
    timings["recompute"] = time.perf_counter() - t - feeder.waited
    timings["cache"] = time.perf_counter() - start  # the request's cache built: load + assemble + recompute
    return Executed(result.logits, own_step(prepared, cache, positions, plan.hook), result.rows, plan, timings)


def own_step(prepared: Prepared, cache: AssembledCache, positions: torch.Tensor, hook: LayerHook | None) -> Step:
    """Decode through the same layer loop as recompute, into the preallocated cache rows."""
    lm, layout, backend, embed = prepared.primary.lm, prepared.layout, prepared.config.attention_backend, prepared.embed()
    n = layout.num_tokens
    extra = cache.num_tokens - n
    ids = torch.cat([layout.input_ids, torch.zeros(extra, dtype=torch.long)])
    pos = torch.cat([positions, positions[-1] + 1 + torch.arange(extra)])

    def step(token: int, t: int) -> torch.Tensor:
        ids[n + t] = token
        return recompute_rows(lm, cache, ids, torch.tensor([n + t]), positions=pos, backend=backend, hook=hook,
                              embed=embed).logits

    return step
