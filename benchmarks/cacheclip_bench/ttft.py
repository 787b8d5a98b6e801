"""`cacheclip bench ttft`: time to first token per mode on identical requests.

For each length, a synthetic context is chunked and ingested (caches built before timing), then
every mode answers the same question on the same chunk ids, interleaved run by run so drift on
a shared machine hits all modes alike. Reported: median and spread of TTFT, its ratio to `full`
measured in the same run, the breakdown, and the effective recomputed fraction. Peers
(`eval.peers`: llama.cpp) prefill the `full` request's token ids in the same alternation.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from cacheclip_rag import CacheClipEngine
from cacheclip_rag.analysis import needle_context

from . import cost_model
from .stats import median_or_zero
from .needle import ratio_text, request_for, uses_packets, with_full

log = logging.getLogger(__name__)


@dataclass
class TTFTRow:
    length: int
    mode: str
    ratio: float | str
    prompt_tokens: int
    runs: int
    ttft_median: float
    ttft_min: float
    ttft_max: float
    vs_full: float
    selection: float
    load: float
    assemble: float
    recompute: float
    selection_hidden: float
    load_wait: float
    peak_mb: float
    effective_fraction: float
    correct: float
    note: str = ""
    """What a peer's row is (its version, file, threads), or why it has no figures."""
    arithmetic: float = float("nan")
    """The recompute's arithmetic share of a full prefill (`cost_model`): the rows it recomputed,
    counted with the keys each sees; what `recompute` / full's TTFT would be if only arithmetic
    cost time."""


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _rss() -> int:
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * _PAGE
    except OSError:
        return 0


@contextmanager
def peak_rss(result: list[float], interval: float = 0.005):
    """Append the peak resident-set growth (MB) seen while the block runs (sampled)."""
    base = peak = _rss()
    stop = threading.Event()

    def sample():
        nonlocal peak
        while not stop.wait(interval):
            peak = max(peak, _rss())

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        result.append(max(0, max(peak, _rss()) - base) / 2**20)


def run(
    engine: CacheClipEngine,
    lengths: list[int],
    modes: list[tuple[str, float]],
    runs: int = 3,
    seed: int = 1234,
    max_new_tokens: int = 32,
    cold: bool = True,
    budget: str = "keep",
    peers: dict | None = None,
    progress=None,
) -> list[TTFTRow]:
    """modes: (mode, ratio) pairs (registered modes or `needle.BENCH_MODES`); `full` is always
    measured as the reference. budget: the selection budget rule of the ratio modes.
    peers: name -> an open peer (`peers.LlamaCpp`), or the reason it cannot run (a str, kept as
    its row's note). progress(message) is called after each timed request (`requests(...)` of them).

    cold: empty the store's memory tier before each request, so cache loading from disk (the
    OS page cache, in practice) is part of every reuse-mode TTFT.
    """
    modes = with_full(modes)
    rows: list[TTFTRow] = []
    for length in lengths:
        context, question, expected = needle_context(engine.primary.lm.tokenizer, length, seed + length)
        ids = engine.ingest([context], progress=False, packets=uses_packets(modes))  # packet caches too: no timed request builds one
        engine.answer(question, chunk_ids=ids, mode="cacheclip", max_new_tokens=1)  # warm-up
        samples: dict[tuple[str, float], list] = {m: [] for m in modes}
        peaks: dict[tuple[str, float], list] = {m: [] for m in modes}
        live = {name: peer for name, peer in (peers or {}).items() if not isinstance(peer, str)}
        prompt_ids = (engine.prepare(question, chunk_ids=ids, **request_for("full", budget)).layout.input_ids.tolist()
                      if live else [])  # what a peer prefills: the `full` request's token ids
        peer_runs: dict[str, list[tuple[float, int]]] = {name: [] for name in live}
        peer_peaks: dict[str, list[float]] = {name: [] for name in live}
        for _ in range(runs):
            for mode, ratio in modes:
                if cold:
                    engine.store.clear_memory()
                with peak_rss(peaks[(mode, ratio)]):
                    samples[(mode, ratio)].append(
                        engine.answer(question, chunk_ids=ids, recompute_ratio=ratio, max_new_tokens=max_new_tokens,
                                      **request_for(mode, budget))
                    )
                if progress:
                    progress(f"{length} {mode}: {samples[(mode, ratio)][-1].timings['ttft']:.1f} s")
            for name, peer in live.items():
                with peak_rss(peer_peaks[name]):
                    peer_runs[name].append(peer.ttft(prompt_ids))
                if progress:
                    progress(f"{length} {name}: {peer_runs[name][-1][0]:.1f} s")
        full_ttft = median_or_zero([a.timings["ttft"] for a in samples[("full", 1.0)]])
        shape = cost_model.Shape.of(engine.primary.lm)
        for (mode, ratio), answers in samples.items():
            ttft = [a.timings["ttft"] for a in answers]
            rows.append(
                TTFTRow(
                    length=length,
                    mode=mode,
                    ratio=1.0 if mode == "full" else (0.0 if mode in ("reuse", "ape") else ratio),
                    prompt_tokens=answers[0].prompt_tokens,
                    runs=len(answers),
                    ttft_median=median_or_zero(ttft),
                    ttft_min=min(ttft),
                    ttft_max=max(ttft),
                    vs_full=median_or_zero(ttft) / full_ttft if full_ttft else float("nan"),
                    selection=median_or_zero([a.timings["selection"] for a in answers]),
                    load=median_or_zero([a.timings["load"] for a in answers]),
                    assemble=median_or_zero([a.timings["assemble"] for a in answers]),
                    recompute=median_or_zero([a.timings["recompute"] for a in answers]),
                    selection_hidden=median_or_zero([a.timings.get("selection_hidden", 0.0) for a in answers]),
                    load_wait=median_or_zero([a.timings.get("load_wait", 0.0) for a in answers]),
                    peak_mb=median_or_zero(peaks[(mode, ratio)]),
                    effective_fraction=answers[0].effective_fraction,
                    correct=sum(expected in a.text for a in answers) / len(answers),
                    arithmetic=1.0 if mode == "full" else cost_model.arithmetic_share(
                        shape, torch.tensor(answers[0].recomputed, dtype=torch.long), answers[0].prompt_tokens),
                )
            )
        full = samples[("full", 1.0)][0]
        for name, peer in (peers or {}).items():
            rows.append(_peer_row(length, name, peer, peer_runs.get(name, []), peer_peaks.get(name, []), full_ttft,
                                  full, engine.primary.lm.tokenizer))
    return rows


def requests(lengths: list[int], modes: list[tuple[str, float]], runs: int, peers: dict | None = None) -> int:
    """How many timed requests `run` makes (its progress steps), peer runs included."""
    live = sum(not isinstance(peer, str) for peer in (peers or {}).values())
    return len(lengths) * runs * (len(with_full(modes)) + live)


def _peer_row(length: int, name: str, peer, runs: list[tuple[float, int]], peaks: list[float], full_ttft: float,
              full, tokenizer) -> TTFTRow:
    """A peer's row beside `full` (an Answer of the same prompt): its prefill is all of its TTFT;
    the note names it and whether its first token is the one `full` generated (the same model on
    the same tokens should agree)."""
    nan = float("nan")
    same = dict(length=length, mode=name, ratio=1.0, prompt_tokens=full.prompt_tokens, selection=0.0, load=0.0,
                assemble=0.0, selection_hidden=0.0, load_wait=0.0, effective_fraction=1.0, correct=nan)
    if isinstance(peer, str):
        return TTFTRow(**same, runs=0, ttft_median=nan, ttft_min=nan, ttft_max=nan, vs_full=nan, recompute=nan,
                       peak_mb=0.0, note=peer)
    times = [t for t, _ in runs]
    pieces = [tokenizer.decode([tok]).strip() for _, tok in runs]
    agree = sum(bool(piece) and full.text.strip().startswith(piece) for piece in pieces)
    median = median_or_zero(times)
    return TTFTRow(**same, runs=len(times), ttft_median=median, ttft_min=min(times), ttft_max=max(times),
                   vs_full=median / full_ttft if full_ttft else nan, recompute=median, peak_mb=median_or_zero(peaks),
                   note=f"llama-cpp-python {peer.version}, {peer.gguf.name}, {peer.threads} threads; first token as "
                        f"full's in {agree}/{len(runs)} runs")


def table(rows: list[TTFTRow]) -> str:
    head = (
        f"{'len':>5} {'mode':<15} {'ratio':>5} {'tokens':>6} {'TTFT s':>7} {'[min-max]':>13} {'/full':>6} "
        f"{'select':>6} {'hidden':>6} {'load':>6} {'asm':>6} {'wait':>6} {'recomp':>6} {'arith':>6} {'peakMB':>7} "
        f"{'eff%':>5} {'ok':>4}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.length:>5} {r.mode:<15} {_ratio_cell(r.ratio):>5} {r.prompt_tokens:>6} {r.ttft_median:>7.3f} "
            f"{f'[{r.ttft_min:.2f}-{r.ttft_max:.2f}]':>13} {r.vs_full:>6.3f} {r.selection:>6.3f} {r.selection_hidden:>6.3f} "
            f"{r.load:>6.3f} {r.assemble:>6.3f} {r.load_wait:>6.3f} {r.recompute:>6.3f} {r.arithmetic:>6.3f} {r.peak_mb:>7.1f} "
            f"{100 * r.effective_fraction:>5.1f} {r.correct:>4.2f}".replace("nan", "  -")
        )
    notes = [f"{r.mode} at {r.length}: {r.note}" for r in rows if r.note]
    notes.append("arith: the recompute's arithmetic share of a full prefill (rows x layers of projections and MLP, "
                 "plus attention over the keys each row sees): the /full it would reach if only arithmetic cost time")
    return "\n".join(lines + notes)


def plot(rows: list[TTFTRow], path: str | Path) -> None:
    """TTFT breakdown per mode and length (stacked) and TTFT/full vs ratio for cacheclip."""
    from . import plots

    stem = Path(path)
    plots.ttft_breakdown(
        [dict(label=r.mode if r.mode in ("full", "reuse", "ape") else f"{r.mode}@{ratio_text(r.ratio)}", length=r.length,
              selection=max(0.0, r.selection - r.selection_hidden), load=r.load, assemble=r.load_wait,
              recompute=r.recompute, ttft=r.ttft_median) for r in rows],
        stem.with_name(stem.stem + "-breakdown.png"),
        title="TTFT breakdown (selection: the part not hidden; assemble: time waited for layers)",
    )
    plots.ratio_curve(
        [(r.length, r.mode, r.ratio, r.vs_full) for r in rows
         if r.mode not in ("full", "reuse", "ape") and not isinstance(r.ratio, str)],
        stem.with_name(stem.stem + "-ratio.png"),
        ylabel="TTFT / TTFT(full)",
        title="TTFT relative to full prefill vs recompute ratio",
    )


def write_json(rows: list[TTFTRow], path: str | Path, machine: str | None = None) -> None:
    """The rows as a JSON list, each naming the machine that measured it (`hardware.machine`), as
    `bench niah --ttft-from` reads them."""
    Path(path).write_text(json.dumps([{**asdict(r), "machine": machine} for r in rows], indent=2))


def _ratio_cell(ratio: float | str) -> str:
    return ratio if isinstance(ratio, str) else f"{ratio:.2f}"
