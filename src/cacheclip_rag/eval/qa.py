"""`cacheclip eval --dataset FILE`: QA over given contexts, every mode on the same inputs.

The file is JSON Lines, one example a line:
    {"question": str, "contexts": [str | {"title": str, "text": str}], "answers": [str]}
Each example's contexts become its chunks (ingested unsplit, in order; the retriever is
bypassed, as in the paper). Metrics against the best-matching answer: token F1, exact match,
ROUGE-L, and whether an answer string occurs in the prediction.
"""

from __future__ import annotations

import json
import random
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

from ..engine import CacheClipEngine
from .needle import label, request_for, uses_packets
from .metrics import best_of, exact_match, normalize, rouge_l, token_f1


@dataclass
class QAExample:
    question: str
    contexts: list[dict]
    answers: list[str]


@dataclass
class QAResult:
    index: int
    mode: str
    ratio: float
    prediction: str
    f1: float
    em: float
    rouge_l: float
    contains: float
    ttft: float
    effective_fraction: float


def load_dataset(path: str | Path) -> list[QAExample]:
    """Read and validate a JSON Lines QA file; errors name the line."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"dataset {str(path)!r} does not exist")
    examples = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not valid UTF-8 ({err.reason} at byte {err.start})") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{n}: not JSON ({err.msg})") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{path}:{n}: expected an object with question, contexts, answers")
        q, ctxs, answers = obj.get("question"), obj.get("contexts"), obj.get("answers")
        if not isinstance(q, str) or not q.strip():
            raise ValueError(f"{path}:{n}: 'question' must be a non-empty string")
        if not isinstance(ctxs, list) or not ctxs:
            raise ValueError(f"{path}:{n}: 'contexts' must be a non-empty list")
        norm = []
        for c in ctxs:
            if isinstance(c, str) and c.strip():
                norm.append({"text": c})
            elif isinstance(c, dict) and isinstance(c.get("text"), str) and c["text"].strip():
                norm.append({"title": str(c.get("title", "")), "text": c["text"]})
            else:
                raise ValueError(f"{path}:{n}: each context must be a non-empty string or {{title, text}}")
        if not isinstance(answers, list) or not answers or not all(isinstance(a, str) and a for a in answers):
            raise ValueError(f"{path}:{n}: 'answers' must be a non-empty list of strings")
        examples.append(QAExample(q, norm, answers))
    if not examples:
        raise ValueError(f"dataset {path} holds no examples")
    return examples


def run(engine: CacheClipEngine, examples: list[QAExample], modes: list[tuple[str, float]], max_new_tokens: int = 32) -> list[QAResult]:
    if ("full", 1.0) not in modes:
        modes = [("full", 1.0), *modes]
    results = []
    packets = uses_packets(modes)
    for i, ex in enumerate(examples):
        ids = engine.ingest([dict(c) for c in ex.contexts], progress=False, split=False, packets=packets)
        for mode, ratio in modes:
            ans = engine.answer(ex.question, chunk_ids=ids, recompute_ratio=ratio, max_new_tokens=max_new_tokens,
                                **request_for(mode, "keep"))
            pred = ans.text
            results.append(QAResult(
                index=i, mode=mode, ratio=ratio, prediction=pred,
                f1=best_of(token_f1, pred, ex.answers), em=best_of(exact_match, pred, ex.answers),
                rouge_l=best_of(rouge_l, pred, ex.answers),
                contains=float(any(normalize(a) in normalize(pred) for a in ex.answers)),
                ttft=ans.timings["ttft"], effective_fraction=ans.effective_fraction,
            ))
    return results


def summarize(results: list[QAResult]) -> list[dict]:
    rows = []
    for mode, ratio in sorted({(r.mode, r.ratio) for r in results}, key=lambda k: (k[0] != "full", k)):
        sel = [r for r in results if (r.mode, r.ratio) == (mode, ratio)]
        rows.append(dict(mode=mode, ratio=ratio, n=len(sel),
                         f1=statistics.mean(r.f1 for r in sel), em=statistics.mean(r.em for r in sel),
                         rouge_l=statistics.mean(r.rouge_l for r in sel), contains=statistics.mean(r.contains for r in sel),
                         effective_fraction=statistics.mean(r.effective_fraction for r in sel),
                         ttft=statistics.median(r.ttft for r in sel)))
    full = next(r for r in rows if r["mode"] == "full")
    for r in rows:
        r["f1_pct_of_full"] = 100 * r["f1"] / full["f1"] if full["f1"] else float("nan")
        r["ttft_vs_full"] = r["ttft"] / full["ttft"] if full["ttft"] else float("nan")
    return rows


def table(rows: list[dict]) -> str:
    head = f"{'mode':<20} {'n':>3} {'F1':>6} {'EM':>6} {'ROUGE-L':>8} {'contains':>8} {'F1 %full':>8} {'eff%':>5} {'TTFT/full':>9}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{label(r['mode'], r['ratio']):<20} {r['n']:>3} {100 * r['f1']:>6.1f} {100 * r['em']:>6.1f} {100 * r['rouge_l']:>8.1f} "
                     f"{100 * r['contains']:>8.1f} {r['f1_pct_of_full']:>8.1f} {100 * r['effective_fraction']:>5.1f} {r['ttft_vs_full']:>9.3f}")
    return "\n".join(lines)


def write_json(results: list[QAResult], rows: list[dict], path: str | Path) -> None:
    Path(path).write_text(json.dumps({"summary": rows, "examples": [asdict(r) for r in results]}, indent=2))


# ----- the shipped dataset: multi-hop questions over invented facts --------------------------

_FIRST = ["Ilse", "Tomas", "Nadia", "Oskar", "Priya", "Felix", "Mara", "Jonah", "Selma", "Ruben", "Agnes", "Milo",
          "Leona", "Bastian", "Yara", "Emil", "Talia", "Anton", "Freya", "Cyrus"]
_LAST = ["Vanterpool", "Okonkwo-Lind", "Rasmussen-Tal", "Quillfeather", "Draskovic", "Mbeki-Sorensen", "Halloran",
         "Castellane", "Brightwater", "Ostrowski", "Fenwicke", "Ilyasova"]
_CITIES = ["Marrowgate", "Tessaly Port", "Kelvinholm", "Ostrabruck", "Lindqvar", "Port Amsel", "Virelle", "Dunmarsh",
           "Hollin Bay", "Serrano Falls", "Quintaro", "Aldersund"]
_PROVINCES = ["Northmere", "Caldera Reach", "the Saltlands", "Vessen", "Upper Orrin", "the Amber Coast", "Kestria", "Lowfold"]
_PRIZES = ["Halvard Prize", "Silver Quill Award", "Meridian Medal", "Ostara Prize", "Lantern Award", "Corvid Prize"]
_JOBS = ["glassblower", "cartographer", "marine engineer", "beekeeper", "radio astronomer", "violin maker", "pharmacist", "tram driver"]
_FILLER = ["is remembered by neighbours as a patient and curious person", "spent several summers restoring an old sailing boat",
           "once gave a public lecture on the history of lighthouses", "keeps a large collection of antique maps",
           "is known locally for an annual winter charity concert", "learned three languages while travelling as a student"]


def make_invented_qa(n: int = 32, seed: int = 7) -> list[dict]:
    """Two-hop questions: each needs two paragraphs; two distractor paragraphs are mixed in."""
    rng = random.Random(seed)
    people = [f"{f} {l}" for f in _FIRST for l in _LAST]
    rng.shuffle(people)
    out = []
    for i in range(n):
        p, other, spouse = people[3 * i], people[3 * i + 1], people[3 * i + 2]
        city, city2 = rng.sample(_CITIES, 2)
        prov, prov2 = rng.sample(_PROVINCES, 2)
        kind = i % 4
        fill = lambda who: f"{who} {rng.choice(_FILLER)}."  # noqa: E731
        if kind == 0:
            a = f"{p} was born in {city} in {rng.randint(1931, 1999)}. {fill(p)}"
            b = f"{city} is the largest town of the province of {prov}. Its harbour is busy all year."
            d1 = f"{other} was born in {city2}. {fill(other)}"
            d2 = f"{city2} is the largest town of the province of {prov2}. It is known for its bridges."
            q, ans = f"In which province was {p} born?", [prov]
        elif kind == 1:
            co = f"{rng.choice(['Orbis', 'Tallow', 'Nimbus', 'Kepler', 'Arden'])} {rng.choice(['Works', 'Instruments', 'Foundry', 'Labs'])}"
            a = f"{p} founded the company {co} after leaving university. {fill(p)}"
            b = f"{co} is headquartered in {city} and employs about {rng.randint(40, 900)} people."
            d1 = f"{other} founded a small bakery in {city2}. {fill(other)}"
            d2 = f"The bakery in {city2} opens at five every morning."
            q, ans = f"In which city is the company founded by {p} headquartered?", [city]
        elif kind == 2:
            book = f"The {rng.choice(['Glass', 'Quiet', 'Northern', 'Salt', 'Iron'])} {rng.choice(['Orchard', 'Harbour', 'Meridian', 'Lantern', 'Archive'])}"
            prize, prize2 = rng.sample(_PRIZES, 2)
            a = f"{p} wrote the novel {book}, which took nine years to finish. {fill(p)}"
            b = f"{book} won the {prize} in {rng.randint(1980, 2024)}."
            d1 = f"{other} wrote a cookbook about river fish. {fill(other)}"
            d2 = f"The cookbook by {other} won the {prize2}."
            q, ans = f"Which prize did the novel written by {p} win?", [prize]
        else:
            job, job2 = rng.sample(_JOBS, 2)
            a = f"{p} is married to {spouse}; they live in {city}. {fill(p)}"
            b = f"{spouse} works as a {job} and has done so for many years."
            d1 = f"{other} lives in {city2}. {fill(other)}"
            d2 = f"{other} works as a {job2}."
            q, ans = f"What is the profession of the person {p} is married to?", [job]
        contexts = [{"title": f"Note {j + 1}", "text": t} for j, t in enumerate(rng.sample([a, b, d1, d2], 4))]
        out.append({"question": q, "contexts": contexts, "answers": ans})
    return out
