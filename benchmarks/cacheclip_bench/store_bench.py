"""`cacheclip bench store`: what each chunk-cache codec costs and keeps, side by side in one run.

Per codec (`storage/codecs/`), each in its own store over the same loaded models:

- bytes a token as stored, primary and aux (the aux as deep as `StoreConfig.aux_depth` keeps it),
  and the milliseconds to encode and to decode one layer of one 256-token chunk's K and V;
- the needle score of full / reuse / cacheclip@r / prophetkv@r on the same samples, and each
  codec's paired difference from bf16 (per sample, 95% bootstrap interval over samples);
- fidelity: KL(full || mode) teacher-forced on full attention's answers, the same samples;
- TTFT of full / cacheclip@r / prophetkv@r at each length, from a folder store and (given a URL)
  from Redis, codecs and backends alternated run by run, cold (memory tier emptied): each row
  also over bf16's same mode and backend;
- the projected size of a corpus of 10^4..10^7 chunks of 256 tokens, for the measured pair and
  for 7-8B primaries from their published configurations.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import parse_qs, urlencode, urlsplit, urlunsplit

from cacheclip_rag import CacheClipEngine, EngineConfig, StoreConfig
from cacheclip_rag.analysis import LoadedModel, codecs, needle_context

from . import fidelity, needle
from .stats import bootstrap_interval, mean_of_means

log = logging.getLogger(__name__)

CHUNK_TOKENS = 256
PROJECTED_CHUNKS = (10**4, 10**5, 10**6, 10**7)
PEER_PRIMARIES = {
    # (layers, KV heads, head_dim) from the published config.json of each model.
    "Qwen2.5-7B-Instruct": (28, 4, 128),
    "Llama-3.1-8B-Instruct": (32, 8, 128),
}


@dataclass
class CodecCost:
    codec: str
    primary_bytes_per_token: float
    aux_bytes_per_token: float
    aux_layers_stored: int
    encode_ms_per_layer: float
    decode_ms_per_layer: float

    @property
    def bytes_per_token(self) -> float:
        return self.primary_bytes_per_token + self.aux_bytes_per_token


@dataclass
class StoreBench:
    costs: list[CodecCost] = field(default_factory=list)
    needle: dict[str, list[needle.NeedleResult]] = field(default_factory=dict)
    fidelity: dict[str, list[fidelity.FidelityResult]] = field(default_factory=dict)
    ttft: list[dict] = field(default_factory=list)


def open_engines(primary: LoadedModel, aux: LoadedModel, root: Path, names: list[str], cfg: EngineConfig,
                 redis: str | None = None) -> dict[tuple[str, str], CacheClipEngine]:
    """(codec, "file" | "redis") -> an engine over the shared models, a store of its own each."""
    engines = {}
    for codec in names:
        store_cfg = StoreConfig(**{**asdict(cfg.store), "kv_codec": codec})
        ecfg = EngineConfig(**{**{f: getattr(cfg, f) for f in cfg.__dataclass_fields__}, "store": store_cfg})
        engines[(codec, "file")] = CacheClipEngine(primary, aux, root / codec, ecfg)
        if redis:
            engines[(codec, "redis")] = CacheClipEngine(primary, aux, _redis_for(redis, codec), ecfg)
    return engines


def _redis_for(url: str, codec: str) -> str:
    """The URL with a key prefix of the codec's own: the URL's prefix (default "bench-store") + codec."""
    parts = urlsplit(url)
    query = parse_qs(parts.query)
    query["prefix"] = [f"{(query.get('prefix') or ['bench-store'])[0]}-{codec}"]
    return urlunsplit(parts._replace(query=urlencode(query, doseq=True)))


def codec_cost(engine: CacheClipEngine, codec: str, sample_chunk: str, reps: int = 5) -> CodecCost:
    """Bytes a token of what the engine's store holds, and encode/decode ms of one layer (K and V)
    of `sample_chunk`'s primary cache (median over layers and repetitions)."""
    usage = engine.store.usage()["namespaces"]
    kv = engine.primary.get(sample_chunk)
    coder = codecs.get(codec)
    enc, dec = [], []
    for _ in range(reps):
        for k, v in zip(kv.keys, kv.values):
            start = time.perf_counter()
            stored = (coder.encode("k", k), coder.encode("v", v))
            mid = time.perf_counter()
            coder.decode("k", stored[0], k.shape[1], k.shape[2], k.dtype)
            coder.decode("v", stored[1], v.shape[1], v.shape[2], v.dtype)
            enc.append(mid - start)
            dec.append(time.perf_counter() - mid)
    aux_record = engine.store.backend.get(engine.aux.namespace, sample_chunk)
    aux_layers = int(aux_record.meta["num_layers"]) if aux_record is not None else 0
    if aux_record is not None:
        aux_record.close()
    return CodecCost(codec, usage[engine.primary.namespace]["bytes_per_token"] or float("nan"),
                     usage[engine.aux.namespace]["bytes_per_token"] or float("nan"), aux_layers,
                     1000 * statistics.median(enc), 1000 * statistics.median(dec))


def ttft_rows(engines: dict[tuple[str, str], CacheClipEngine], lengths: list[int], modes: list[tuple[str, float]],
              runs: int, seed: int = 1234, max_new_tokens: int = 8, progress=None) -> list[dict]:
    """TTFT of each (codec, backend, mode) on the same request per length, alternated run by run,
    cold; medians, each over full's of the same store and over bf16's same mode and backend."""
    rows = []
    for length in lengths:
        any_engine = next(iter(engines.values()))
        context, question, _ = needle_context(any_engine.primary.lm.tokenizer, length, seed + length)
        ids = {}
        for key, engine in engines.items():
            ids[key] = engine.ingest([context], progress=False)
            engine.answer(question, chunk_ids=ids[key], mode="cacheclip", max_new_tokens=1)  # warm-up
        times: dict[tuple, list[float]] = defaultdict(list)
        for _ in range(runs):
            for key, engine in engines.items():
                for mode, ratio in modes:
                    engine.store.clear_memory()
                    ans = engine.answer(question, chunk_ids=ids[key], recompute_ratio=ratio,
                                        max_new_tokens=max_new_tokens, **needle.request_for(mode, "keep"))
                    times[(*key, mode, ratio)].append(ans.timings["ttft"])
                    if progress:
                        progress(f"{length} {key[0]}/{key[1]} {mode}: {ans.timings['ttft']:.2f} s")
        for (codec, backend, mode, ratio), ts in times.items():
            med = statistics.median(ts)
            full = statistics.median(times[(codec, backend, "full", 1.0)])
            base = times.get(("bf16", backend, mode, ratio))
            rows.append(dict(length=length, codec=codec, backend=backend, mode=mode, ratio=ratio, runs=len(ts),
                             ttft=med, vs_full=med / full, vs_bf16=med / statistics.median(base) if base else float("nan")))
    return rows


def paired_vs_bf16(results: dict[str, list], metric: str) -> list[dict]:
    """Per codec other than bf16 and per (length, mode, ratio): mean of codec - bf16 on the same
    samples (mean over variants of per-variant means) and its 95% bootstrap interval."""
    base = {(r.length, r.variant, r.seed, r.mode, r.ratio): getattr(r, metric) for r in results.get("bf16", [])}
    out = []
    for codec, rows in results.items():
        if codec == "bf16":
            continue
        groups: dict[tuple, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
        for r in rows:
            key = (r.length, r.variant, r.seed, r.mode, r.ratio)
            if key in base:
                groups[(r.length, r.mode, r.ratio)][r.variant].append(getattr(r, metric) - base[key])
        for (length, mode, ratio), by_variant in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1])):
            out.append(dict(codec=codec, length=length, mode=mode, ratio=ratio, metric=metric,
                            n=sum(len(v) for v in by_variant.values()), diff=mean_of_means(by_variant),
                            ci95=bootstrap_interval(by_variant)))
    return out


def projection(costs: list[CodecCost], primary: LoadedModel, aux: LoadedModel) -> list[dict]:
    """Bytes of a corpus of N chunks of CHUNK_TOKENS tokens per codec: the measured pair (its
    measured bytes a token), and peer primaries (their shapes at the codec's measured ratio to
    bf16 on this pair's primary) with the same aux."""
    bf16 = next(c for c in costs if c.codec == "bf16")
    rows = []
    for cost in costs:
        shrink = cost.primary_bytes_per_token / bf16.primary_bytes_per_token
        per_token = {f"{primary.name} + {aux.name}": cost.bytes_per_token}
        for name, (layers, heads, dim) in PEER_PRIMARIES.items():
            per_token[f"{name} + {aux.name}"] = layers * heads * dim * 2 * 2 * shrink + cost.aux_bytes_per_token
        for pair, bpt in per_token.items():
            rows.append(dict(codec=cost.codec, pair=pair, bytes_per_token=bpt,
                             **{f"{n:.0e}": bpt * CHUNK_TOKENS * n for n in PROJECTED_CHUNKS}))
    return rows


def cost_table(costs: list[CodecCost]) -> str:
    bf16 = next((c for c in costs if c.codec == "bf16"), None)
    head = (f"{'codec':<6} {'primary KiB/tok':>15} {'aux KiB/tok':>11} {'aux layers':>10} {'total KiB/tok':>13} "
            f"{'x fewer':>7} {'encode ms/layer':>15} {'decode ms/layer':>15}")
    lines = [head]
    for c in costs:
        fewer = bf16.bytes_per_token / c.bytes_per_token if bf16 else float("nan")
        lines.append(f"{c.codec:<6} {c.primary_bytes_per_token / 1024:>15.2f} {c.aux_bytes_per_token / 1024:>11.2f} "
                     f"{c.aux_layers_stored:>10} {c.bytes_per_token / 1024:>13.2f} {fewer:>7.2f} "
                     f"{c.encode_ms_per_layer:>15.3f} {c.decode_ms_per_layer:>15.3f}")
    return "\n".join(lines)


def paired_table(pairs: list[dict], scale: float, digits: int) -> str:
    head = f"{'codec':<6} {'len':>5} {'mode':<16} {'n':>4} {'codec - bf16':>12} {'95% CI':>20}"
    lines = [head]
    for p in pairs:
        ci = f"[{p['ci95'][0] * scale:+.{digits}f}, {p['ci95'][1] * scale:+.{digits}f}]"
        lines.append(f"{p['codec']:<6} {p['length']:>5} {needle.label(p['mode'], p['ratio']):<16} {p['n']:>4} "
                     f"{p['diff'] * scale:>+12.{digits}f} {ci:>20}")
    return "\n".join(lines)


def ttft_table(rows: list[dict]) -> str:
    head = f"{'len':>5} {'codec':<6} {'store':<6} {'mode':<16} {'runs':>4} {'TTFT s':>8} {'/ full':>7} {'/ bf16':>7}"
    lines = [head]
    for r in sorted(rows, key=lambda r: (r["length"], r["backend"], r["mode"], r["codec"])):
        lines.append(f"{r['length']:>5} {r['codec']:<6} {r['backend']:<6} {needle.label(r['mode'], r['ratio']):<16} "
                     f"{r['runs']:>4} {r['ttft']:>8.3f} {r['vs_full']:>7.3f} {r['vs_bf16']:>7.3f}")
    return "\n".join(lines)


def projection_table(rows: list[dict]) -> str:
    head = f"{'codec':<6} {'pair':<58} {'KiB/tok':>8} " + " ".join(f"{f'{n:.0e} chunks':>14}" for n in PROJECTED_CHUNKS)
    lines = [head]
    for r in rows:
        lines.append(f"{r['codec']:<6} {r['pair']:<58} {r['bytes_per_token'] / 1024:>8.2f} "
                     + " ".join(f"{_size(r[f'{n:.0e}']):>14}" for n in PROJECTED_CHUNKS))
    return "\n".join(lines)


def _size(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n / 1e3:.1f} kB"


def write_json(bench: StoreBench, extra: dict, path: str | Path) -> None:
    doc = {**extra, "costs": [asdict(c) for c in bench.costs], "ttft": bench.ttft,
           "needle": {c: [asdict(r) for r in rs] for c, rs in bench.needle.items()},
           "fidelity": {c: [asdict(r) for r in rs] for c, rs in bench.fidelity.items()}}
    Path(path).write_text(json.dumps(doc, indent=1, default=float))


def first_chunk(engine: CacheClipEngine) -> str:
    """A stored chunk of the engine's own (the cost sample): the longest."""
    chunks = engine.store.chunks()
    if not chunks:
        raise ValueError(f"store {engine.store.location} holds no chunk to measure")
    return max(chunks, key=lambda c: len(c.text)).id


def clear(engines: dict) -> None:
    for engine in engines.values():
        engine.close()


__all__ = ["CodecCost", "StoreBench", "codec_cost", "open_engines", "paired_vs_bf16", "projection", "ttft_rows"]
