"""`cacheclip bench ttft --cold`: is the first request after loading as fast as the next ones?

For each mode, a fresh process loads the engine (`from_pretrained`, with and without
`warm_up`), answers the same request six times and reports each TTFT; the table gives the first
one over the median of the next five. A fresh process is the honest unit: kernels selected or
built on first use, thread pools started lazily and weights first read from disk all fall on the
first request of a process, and only there.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass

from cacheclip_rag import CacheClipEngine
from cacheclip_rag.analysis import needle_context

REPEATS = 6


@dataclass
class ColdRow:
    length: int
    mode: str
    ratio: float
    warm_up: bool
    warm_up_s: float
    ttfts: list[float]

    @property
    def first_vs_rest(self) -> float:
        """The first request's TTFT over the median of the next ones."""
        return self.ttfts[0] / statistics.median(self.ttfts[1:])


def prepare(engine: CacheClipEngine, length: int, seed: int = 1234) -> tuple[str, list[str]]:
    """The request `bench ttft` times at this length, ingested into the engine's store."""
    context, question, _ = needle_context(engine.primary.lm.tokenizer, length, seed + length)
    return question, engine.ingest([context], progress=False)


def run(args, lengths: list[int], modes: list[tuple[str, float]]) -> list[ColdRow]:
    """One fresh process per (length, mode, warm-up or not), after the parent ingested the requests."""
    rows = []
    for length in lengths:
        for mode, ratio in modes:
            for warm in (False, True):
                child = [sys.executable, "-m", "cacheclip_bench.cold", json.dumps(dict(
                    primary=args.primary, aux=args.aux, store=args.store, dtype=args.dtype, length=length, mode=mode,
                    ratio=ratio, warm_up=warm, chunk_tokens=args.chunk_tokens))]
                done = subprocess.run(child, capture_output=True, text=True, env={**os.environ, "TQDM_DISABLE": "1"})
                if done.returncode != 0:
                    raise ValueError(f"the fresh process for {mode} at {length} failed: {done.stderr[-2000:]}")
                rows.append(ColdRow(**json.loads(done.stdout.strip().splitlines()[-1])))
    return rows


def table(rows: list[ColdRow]) -> str:
    head = f"{'len':>5} {'mode':<16} {'warm-up':>8} {'first s':>8} {'next (median) s':>16} {'first / next':>12}"
    lines = [head, "-" * len(head)]
    for r in rows:
        warm = f"{r.warm_up_s:.2f}s" if r.warm_up else "none"
        lines.append(f"{r.length:>5} {r.mode + ('' if r.mode == 'full' else f'@{r.ratio:g}'):<16} {warm:>8} "
                     f"{r.ttfts[0]:>8.3f} {statistics.median(r.ttfts[1:]):>16.3f} {r.first_vs_rest:>12.2f}")
    return "\n".join(lines)


def write_json(rows: list[ColdRow], path: str, machine: str) -> None:
    doc = {"machine": machine, "rows": [{**asdict(r), "first_vs_rest": r.first_vs_rest} for r in rows]}
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)


def main(argv: list[str]) -> None:
    """The child: load, optionally warm up, answer the request REPEATS times, print one JSON line."""
    from cacheclip_rag import ChunkConfig, EngineConfig, ModelConfig

    spec = json.loads(argv[0])
    config = EngineConfig(model=ModelConfig(dtype=spec["dtype"]),
                          chunk=ChunkConfig(chunk_tokens=spec["chunk_tokens"], overlap_tokens=0))
    engine = CacheClipEngine.from_pretrained(spec["primary"], spec["aux"], spec["store"], config)
    warm_s = engine.warm_up() if spec["warm_up"] else 0.0
    question, ids = prepare(engine, spec["length"])  # already stored by the parent: nothing is encoded here
    ttfts = []
    for _ in range(REPEATS):
        engine.store.clear_memory()
        answer = engine.answer(question, chunk_ids=ids, mode=spec["mode"], recompute_ratio=spec["ratio"],
                               max_new_tokens=1)
        ttfts.append(answer.timings["ttft"])
    print(json.dumps(dict(length=spec["length"], mode=spec["mode"], ratio=spec["ratio"], warm_up=spec["warm_up"],
                          warm_up_s=warm_s, ttfts=ttfts)))


if __name__ == "__main__":
    main(sys.argv[1:])
