"""`cacheclip bench stages`: a request's cost taken apart, each stage beside its arithmetic share.

For each length a synthetic context is ingested (caches on disk before timing); full prefill and
each mode answer the same request, alternated run by run (unprofiled: the TTFT and the
engine's own stage timings), and then once more each under torch.profiler, whose ranges split
the recompute (`recompute.STAGES`: projections and MLP, cache writes, attention, logits). Every
stage is given as a share of full's TTFT measured in the same run:

- selection: the selector's own time (the aux's prefill and scoring; ProphetKV's first stage);
- read / rotate / write: the layer loader's time reading and dequantizing the records, moving
  keys to their positions, and copying into the request's cache (on its own thread, overlapped
  with recompute; `wait` is what the recompute waited for it);
- dense / attention / writes / logits / other: the recompute's time by profiler range, scaled
  to its unprofiled wall time; `other` is what no range holds (embedding, RoPE tables, block
  plans, per-layer Python);
- full-model: the model's own forward over the same tokens (transformers' SDPA attention,
  its share from the profile), beside the engine's `full`, which may prefill through the
  recompute loop instead (`EngineConfig.full_prefill`);
- the arithmetic shares (`cost_model`): the recomputed rows' projections and MLP, their
  attention over the keys each sees, and of those the question's rows (every uncached row,
  what `reuse` recomputes) - the limit each measured stage could reach if only arithmetic
  cost time.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from cacheclip_rag import CacheClipEngine
from cacheclip_rag.analysis import RECOMPUTE_STAGES as STAGES
from cacheclip_rag.analysis import SELECTION, needle_context

from . import cost_model
from .stats import median_or_zero
from .needle import ratio_text, request_for

FULL_ATTENTION_OPS = ("aten::scaled_dot_product_attention",)
"""The operator that holds a full prefill's attention (transformers' sdpa path): its time, with
its children, over the profiled prefill is full's measured attention share."""


@dataclass
class StageRow:
    """One mode at one length; every time a share of full's median TTFT (full_s)."""

    length: int
    mode: str
    ratio: float
    tokens: int
    rows: int
    question_rows: int
    full_s: float
    ttft: float
    selection: float
    read: float
    rotate: float
    write: float
    wait: float
    recompute: float
    dense: float
    attention: float
    writes: float
    logits: float
    other: float
    arith_dense: float
    arith_attention: float
    arith_question: float

    @property
    def arithmetic(self) -> float:
        return self.arith_dense + self.arith_attention

    @property
    def excess(self) -> float:
        """The recompute's measured share over its arithmetic share (1: at the limit)."""
        return self.recompute / self.arithmetic if self.arithmetic else float("nan")


def _ranges(prof) -> dict[str, float]:
    """Seconds in each recompute range (children included) and in full's attention operator,
    leaving out what ran inside the selection (ProphetKV's first stage runs the same layer loop)."""
    events = prof.events()
    selecting = [(e.time_range.start, e.time_range.end) for e in events if e.name == SELECTION]

    def outside(e) -> bool:
        return not any(start <= e.time_range.start and e.time_range.end <= end for start, end in selecting)

    out = {name: sum(e.cpu_time_total for e in events if e.name == key and outside(e)) / 1e6
           for name, key in STAGES.items()}
    out["full_attention"] = sum(e.cpu_time_total for e in events if e.name in FULL_ATTENTION_OPS) / 1e6
    return out


def run(engine: CacheClipEngine, lengths: list[int], modes: list[tuple[str, float]], runs: int = 3,
        seed: int = 1234, budget: str = "keep", progress=None) -> list[StageRow]:
    """modes: (mode, ratio) pairs besides `full`, which every length measures as the reference.
    progress(message) is called after each request (`requests(...)` of them)."""
    shape = cost_model.Shape.of(engine.primary.lm)
    out: list[StageRow] = []
    for length in lengths:
        context, question, _ = needle_context(engine.primary.lm.tokenizer, length, seed + length)
        ids = engine.ingest([context], progress=False)
        every = [("full", 1.0), *[m for m in modes if m[0] != "full"]]

        def ask(mode: str, ratio: float):
            engine.store.clear_memory()  # caches come from disk (the page cache) in every request
            return engine.answer(question, chunk_ids=ids, recompute_ratio=ratio, max_new_tokens=1,
                                 **request_for(mode, budget))

        forward = _model_forward(engine, question, ids)
        ask("cacheclip", 0.2)  # warm-up
        timed = {m: [] for m in [*every, MODEL_FORWARD]}
        for _ in range(runs):
            for m in every:
                timed[m].append(ask(*m))
                if progress:
                    progress(f"{length} {m[0]}: {timed[m][-1].timings['ttft']:.2f} s")
            timed[MODEL_FORWARD].append(forward())
        profiled = {}
        for m in [*every, MODEL_FORWARD]:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                answer = forward() if m == MODEL_FORWARD else ask(*m)
            profiled[m] = (answer, _ranges(prof))
            if progress:
                progress(f"{length} {m[0]} profiled")
        full_s = median_or_zero([a.timings["ttft"] for a in timed[("full", 1.0)]])
        question = engine.prepare(question, chunk_ids=ids, mode="reuse").layout.uncached_rows()
        for m in [*every, MODEL_FORWARD]:
            out.append(_row(length, m, timed[m], profiled[m], full_s, shape, question))
    return out


MODEL_FORWARD = ("full-model", 1.0)
"""A reference row: the full prefill by the model's own forward (transformers' SDPA attention),
whichever way the engine's `full` mode prefills (`EngineConfig.full_prefill`)."""


@dataclass
class _Timed:
    """What `_row` reads of a model-forward prefill, shaped as an Answer's fields."""

    timings: dict[str, float]
    prompt_tokens: int
    recomputed: list[int]


def _model_forward(engine: CacheClipEngine, question: str, ids: list[str]):
    """A callable timing the model's own forward over the `full` request's tokens (logits of the last row)."""
    lm = engine.primary.lm
    input_ids = engine.prepare(question, chunk_ids=ids, mode="full").layout.input_ids

    def forward() -> _Timed:
        start = time.perf_counter()
        with torch.inference_mode():
            lm.model(input_ids=input_ids[None].to(lm.device), use_cache=True, logits_to_keep=1)
        seconds = time.perf_counter() - start
        n = int(input_ids.numel())
        return _Timed({"ttft": seconds, "recompute": seconds}, n, list(range(n)))

    return forward


def _row(length: int, mode: tuple[str, float], answers: list, profiled: tuple, full_s: float,
         shape: cost_model.Shape, question: torch.Tensor) -> StageRow:
    name, ratio = mode
    first = answers[0]
    n = first.prompt_tokens

    def share(key: str) -> float:
        return median_or_zero([a.timings.get(key, 0.0) for a in answers]) / full_s

    answer, ranges = profiled
    recompute = share("recompute")
    if name == MODEL_FORWARD[0]:
        rows = torch.arange(n)
        whole = answer.timings["recompute"]
        attention = recompute * min(1.0, ranges["full_attention"] / whole) if whole else 0.0
        parts = dict(dense=recompute - attention, attention=attention, writes=0.0, logits=0.0, other=0.0)
    else:
        rows = torch.arange(n) if name == "full" else torch.tensor(first.recomputed, dtype=torch.long)
        whole = answer.timings["recompute"]  # the profiled run's wall time, ranges included
        parts = {stage: recompute * ranges[stage] / whole if whole else 0.0 for stage in STAGES}
        parts["other"] = max(0.0, recompute - sum(parts.values()))
    arith_dense, arith_attention = cost_model.shares(shape, rows, n)
    return StageRow(
        length=length, mode=name, ratio=ratio, tokens=n, rows=int(rows.numel()), question_rows=int(question.numel()),
        full_s=full_s, ttft=share("ttft"), selection=share("selection"), read=share("assemble_read"),
        rotate=share("assemble_rotate"), write=share("assemble_write"), wait=share("load_wait"),
        recompute=recompute, **parts, arith_dense=arith_dense, arith_attention=arith_attention,
        arith_question=0.0 if name in ("full", MODEL_FORWARD[0]) else cost_model.arithmetic_share(shape, question, n),
    )


def requests(lengths: list[int], modes: list[tuple[str, float]], runs: int) -> int:
    """How many requests `run` makes (its progress steps)."""
    every = 1 + sum(m[0] != "full" for m in modes)
    return len(lengths) * (every * (runs + 1) + 1)


def label(row: StageRow) -> str:
    return row.mode if row.mode in ("full", MODEL_FORWARD[0], "reuse", "ape") else f"{row.mode}@{ratio_text(row.ratio)}"


def table(rows: list[StageRow]) -> str:
    """Shares of full's TTFT: what each stage measured, and the arithmetic limit beside it."""
    head = (f"{'len':>5} {'mode':<15} {'rows':>5} {'TTFT':>6} {'select':>6} {'read':>6} {'rotate':>6} {'write':>6} "
            f"{'wait':>6} {'recomp':>6} {'dense':>6} {'attn':>6} {'writes':>6} {'logits':>6} {'other':>6} | "
            f"{'a.dense':>7} {'a.attn':>6} {'a.sum':>6} {'a.quest':>7} {'x arith':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.length:>5} {label(r):<15} {r.rows:>5} {r.ttft:>6.3f} {r.selection:>6.3f} {r.read:>6.3f} "
            f"{r.rotate:>6.3f} {r.write:>6.3f} {r.wait:>6.3f} {r.recompute:>6.3f} {r.dense:>6.3f} {r.attention:>6.3f} "
            f"{r.writes:>6.3f} {r.logits:>6.3f} {r.other:>6.3f} | {r.arith_dense:>7.3f} {r.arith_attention:>6.3f} "
            f"{r.arithmetic:>6.3f} {r.arith_question:>7.3f} {r.excess:>7.2f}"
        )
    fulls = {r.length: r.full_s for r in rows if r.mode == "full"}
    lines.append("every column a share of full's median TTFT at that length ("
                 + ", ".join(f"{n}: {s:.2f} s" for n, s in fulls.items()) + "); read/rotate/write run on the "
                 "loader's thread beside the recompute (wait: what the recompute waited for them); dense/attn/"
                 "writes/logits/other split the recompute by profiler range; a.*: arithmetic shares (a.quest: "
                 "the question's rows, inside a.sum); x arith: recomp / a.sum; full-model: the model's own forward "
                 "(transformers' SDPA), beside the engine's full")
    return "\n".join(lines)


def write_json(rows: list[StageRow], path: str | Path, machine: str | None = None) -> None:
    Path(path).write_text(json.dumps([{**asdict(r), "arithmetic": r.arithmetic, "excess": r.excess,
                                       "machine": machine} for r in rows], indent=1))
