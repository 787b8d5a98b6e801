"""What both offline trainers share: their configuration, the self-distillation examples, the fit loop.

Teacher: the frozen model's own greedy continuation G of [prefix, D_1..D_M, Q] under full
attention, and its log-probabilities over G. Training requests are generated (`traindata`: needle
haystacks, two-hop facts, plain prose, in turn) with seeds disjoint from every evaluation and
calibration seed (TRAIN_SEED_BASE and up). Updates average `batch` requests (gradient
accumulation) with Adam and a linear learning-rate decay; the epoch with the lowest held-out KL is
kept (the paper selects its epoch on a disjoint set too).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..config import PromptConfig
from ..corpus.chunking import encode_text
from ..corpus.encode import chat_template, tokenize
from ..corpus.packets import PacketAdapters, student_logits
from ..models.loading import LoadedModel
from ..request.decode import hf_step
from .traindata import ALL_KINDS, KINDS, make_request

log = logging.getLogger(__name__)

TRAIN_SEED_BASE = 5_000_000
"""Training samples use seeds from here on: above the evaluation (< 1,000,000) and calibration ranges."""


@dataclass(frozen=True)
class TrainConfig:
    """samples: generated training requests (held_out more for the held-out KL); length: context
    tokens per request; chunk_tokens: tokens per document (packet) where a kind does not give its
    documents; answer_tokens: |G|; batch: requests averaged per update; lr: the initial learning
    rate, decayed linearly to zero; kinds: the request kinds (`traindata`), taken in turn."""

    samples: int = 144
    held_out: int = 12
    epochs: int = 3
    length: int = 512
    chunk_tokens: int = 128
    answer_tokens: int = 8
    n_header: int = 8
    n_trailer: int = 8
    batch: int = 4
    lr: float = 1e-3
    seed: int = 0
    kinds: tuple[str, ...] = KINDS
    recompute: float = 0.0
    """CacheClip's recompute in the loop: the ratio its selection recomputes in every training
    request (0: the packets are trained for plain reuse, as the shipped ones were). Above 0 the
    requests are made by an engine (its aux model selects) in the served geometry."""

    def __post_init__(self) -> None:
        if isinstance(self.recompute, bool) or not isinstance(self.recompute, (int, float)) \
                or not 0 <= self.recompute <= 1:
            raise ValueError(f"recompute must be a ratio in [0, 1], got {self.recompute!r}")
        if (not isinstance(self.kinds, (tuple, list)) or not self.kinds
                or any(k not in ALL_KINDS for k in self.kinds) or len(set(self.kinds)) != len(self.kinds)):
            raise ValueError(f"kinds must be distinct names among {ALL_KINDS}, got {self.kinds!r}")
        object.__setattr__(self, "kinds", tuple(self.kinds))
        for name in ("samples", "held_out", "epochs", "length", "chunk_tokens", "answer_tokens", "batch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "held_out" else 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.lr, (int, float)) or not 0 < self.lr < 1:
            raise ValueError(f"lr must be a number in (0, 1), got {self.lr!r}")


@dataclass
class Example:
    """One training request: documents [ids], the tail Q + G[:-1] and the teacher's log-probs
    [|G|, vocab]; for a request in the served geometry also the separator between documents
    [S] and, with recompute in the loop, the picked rows of each document [K_i] (token indices,
    as CacheClip's selection marks them)."""

    docs: list[torch.Tensor]
    tail: torch.Tensor
    teacher: torch.Tensor
    between: torch.Tensor | None = None
    picked: list[torch.Tensor] | None = None


@torch.inference_mode()
def continuation(lm: LoadedModel, seq: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The frozen model's greedy continuation of `seq` [N] under full attention: the generated
    tokens G[:-1] [n - 1] and the log-probabilities [n, vocab] before each of the n tokens."""
    out = lm.model(input_ids=seq[None].to(lm.device), use_cache=True, logits_to_keep=1)
    step = hf_step(lm, out.cache, seq.numel())
    logits, generated, rows = out.logits[0, -1].float().cpu(), [], []
    for t in range(n):
        rows.append(logits.log_softmax(-1))
        if t + 1 < n:
            generated.append(int(logits.argmax()))
            logits = step(generated[-1], t)
    return torch.tensor(generated, dtype=torch.long), torch.stack(rows).cpu()


def documents(sample, tokenizer, chunk_tokens: int) -> list[str]:
    """The request's documents: given, or its context cut every `chunk_tokens` tokens."""
    if sample.documents:
        return list(sample.documents)
    ids, offsets = encode_text(tokenizer, sample.context)
    return [sample.context[offsets[i][0] : offsets[min(i + chunk_tokens, len(ids)) - 1][1]]
            for i in range(0, len(ids), chunk_tokens)]


def make_example(lm: LoadedModel, prefix_ids: torch.Tensor, suffix: str, prompt: PromptConfig, kind: str,
                 seed: int, cfg: TrainConfig) -> Example:
    sample = make_request(kind, cfg.length, seed, lm.tokenizer)
    if sample.documents:
        docs = [torch.tensor(encode_text(lm.tokenizer, d)[0]) for d in sample.documents]
    else:
        ids, _ = encode_text(lm.tokenizer, sample.context)
        docs = [torch.tensor(ids[i : i + cfg.chunk_tokens]) for i in range(0, len(ids), cfg.chunk_tokens)]
    question = prompt.question_template.format(question=sample.question)
    q = torch.cat([tokenize(lm, question)[0], tokenize(lm, suffix, special=True)[0]])
    generated, rows = continuation(lm, torch.cat([prefix_ids, *docs, q]), cfg.answer_tokens)
    return Example(docs, torch.cat([q, generated]), rows)


def served_example(engine, kind: str, seed: int, cfg: TrainConfig) -> tuple[torch.Tensor, Example]:
    """A training request made the way `engine` serves it: its documents ingested as chunks,
    asked through the engine's prompt frame (separators between chunks), CacheClip's selection
    at cfg.recompute by the engine's aux model and profile. Returns the prefix ids [P] and the
    example (teacher: the full-attention continuation of the served token sequence)."""
    lm = engine.primary.lm
    sample = make_request(kind, cfg.length, seed, lm.tokenizer)
    chunk_ids = engine.ingest(documents(sample, lm.tokenizer, cfg.chunk_tokens), progress=False, split=False)
    prepared = engine.prepare(sample.question, chunk_ids, mode="cacheclip", recompute_ratio=cfg.recompute)
    plan = prepared.selector.plan(prepared)
    layout = prepared.layout
    chunks = layout.chunk_segments()
    gaps = [seg.ids for seg in layout.segments if not seg.cached and seg.start < chunks[-1].start]
    if len(gaps) != len(chunks) - 1 or any(not torch.equal(g, gaps[0]) for g in gaps):
        raise ValueError("the engine's prompt frame puts something other than one separator between chunks; "
                         "training in the served geometry expects [prefix, chunk, separator, chunk, ..., question]")
    generated, rows = continuation(lm, layout.input_ids, cfg.answer_tokens)
    picked = [torch.nonzero(step["recomputed"]).flatten() for step in plan.trace] if cfg.recompute else None
    ids = layout.input_ids.clone()  # plain tensors: autograd may save them
    example = Example([seg.ids.clone() for seg in chunks], torch.cat([ids[chunks[-1].end :], generated]), rows,
                      between=gaps[0].clone() if gaps else None, picked=picked)
    return ids[: layout.prefix_len], example


def examples(lm: LoadedModel, cfg: TrainConfig, prompt: PromptConfig | None = None,
             progress: Callable[[str], None] | None = None,
             engine=None) -> tuple[torch.Tensor, list[Example], list[Example]]:
    """The shared prefix ids [P] and the generated (train, held-out) examples with their teacher;
    progress(message) is called after each of the samples + held_out examples. With an engine
    (whose primary is `lm`) the requests are made as it serves them (`served_example`)."""
    prompt = prompt or PromptConfig()
    template = chat_template(lm, prompt)
    prefix_ids, _ = tokenize(lm, template.prefix, special=True)
    first = TRAIN_SEED_BASE + cfg.seed * 100_000
    made = []
    for i, s in enumerate(range(first, first + cfg.samples + cfg.held_out)):
        kind = cfg.kinds[i % len(cfg.kinds)]
        if engine is not None:
            prefix_ids, example = served_example(engine, kind, s, cfg)
        else:
            example = make_example(lm, prefix_ids, template.suffix, prompt, kind, s, cfg)
        made.append(example)
        if progress:
            progress(f"{kind} request {i + 1}")
    log.info("made %d training examples (teacher continuations of %d tokens)", len(made), cfg.answer_tokens)
    return prefix_ids, made[: cfg.samples], made[cfg.samples :]


@dataclass
class Objective:
    """What `fit` trains: params (the only tensors with gradients), loss(example) -> scalar
    tensor, held(example) -> the held-out measures ({name: float}, averaged over the held-out
    set and logged per epoch), criterion: the measure whose lowest epoch is kept, snapshot() -> a
    copy of the current trained state (the best epoch's is returned)."""

    params: list[torch.Tensor]
    loss: Callable[[Example], torch.Tensor]
    held: Callable[[Example], dict[str, float]]
    snapshot: Callable[[], object]
    criterion: str = "held_out_kl"


def fit(objective: Objective, train_set: list[Example], held: list[Example], cfg: TrainConfig,
        progress: Callable[[str], None] | None = None) -> tuple[object, list[dict]]:
    """Adam with a linear decay over `cfg.epochs`, `cfg.batch` examples per update; the held-out
    measure after every epoch; returns the best epoch's snapshot and the curve (one row per
    epoch, 0 = untrained, the kept one marked "kept"; when no epoch beats the untrained state,
    that state is returned, with a warning)."""
    rng = random.Random(cfg.seed)
    torch.manual_seed(cfg.seed)
    opt = torch.optim.Adam(objective.params, lr=cfg.lr)
    updates = cfg.epochs * -(-len(train_set) // cfg.batch)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda u: max(0.0, 1 - u / updates))

    def held_measures() -> dict[str, float]:
        with torch.no_grad():
            rows = [objective.held(ex) for ex in held]
        if not rows:
            return {objective.criterion: float("nan")}
        return {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]}

    curve = [dict(epoch=0, train_loss=float("nan"), **held_measures())]
    best, best_kl, kept = objective.snapshot(), curve[0][objective.criterion], 0
    for epoch in range(1, cfg.epochs + 1):
        order = list(range(len(train_set)))
        rng.shuffle(order)
        total = 0.0
        opt.zero_grad()
        for step, i in enumerate(order, 1):
            loss = objective.loss(train_set[i])
            (loss / cfg.batch).backward()
            if step % cfg.batch == 0 or step == len(order):
                opt.step()
                sched.step()
                opt.zero_grad()
            total += loss.item()
            if progress:
                progress(f"epoch {epoch}/{cfg.epochs} step {step}/{len(order)} loss {loss.item():.4f}")
        curve.append(dict(epoch=epoch, train_loss=total / len(order), **held_measures()))
        log.info("epoch %d: train loss %.4f, held-out %s", epoch, curve[-1]["train_loss"],
                 ", ".join(f"{k} {v:.4f}" for k, v in curve[-1].items() if k.startswith("held_out")))
        if not held or curve[-1][objective.criterion] < best_kl:
            best, best_kl, kept = objective.snapshot(), curve[-1][objective.criterion], epoch
    for row in curve:
        row["kept"] = row["epoch"] == kept
    if kept == 0:
        log.warning("no epoch lowered the held-out %s below the untrained state's (%.4f): the result is the "
                    "untrained state", objective.criterion, best_kl)
    return best, curve


def kl(lm: LoadedModel, adapters: PacketAdapters, prefix_ids: torch.Tensor, ex: Example) -> torch.Tensor:
    """KL(teacher || student) per generated token, averaged over them."""
    student = student_logits(lm, adapters, prefix_ids, ex.docs, ex.tail, between=ex.between,
                             picked=ex.picked)[-ex.teacher.shape[0] :].log_softmax(-1)
    return torch.nn.functional.kl_div(student, ex.teacher.to(student.device), log_target=True, reduction="batchmean")
