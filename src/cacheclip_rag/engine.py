"""The engine: ingest a corpus once, answer questions from reused chunk caches.

The engine holds only long-lived things (models, store, index, the shared prefixes). Everything
about one request lives in a `request.Request` created per call, so concurrent requests never share
mutable state.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from . import models as model_lib
from .assemble import Layout, ape_positions, build_layout, write_prefix
from .chunking import Chunk, chunk_id, split_document
from .config import EngineConfig, SelectConfig
from .encode import Template, chat_template, encode_prefix, encode_segment, tokenize
from .generate import Step, decode, hf_step
from .index import ChunkIndex
from .models import LoadedModel
from .recognize import ChunkMatcher
from .pipeline import LayerFeeder
from .request import Request, RequestOptions, check_text, prompt_pieces, question_pieces
from .recompute import ApeSpec, AssembledCache, BlendSpec, recompute_rows
from .select import attention_from_rows, map_tokens, pick, scoring_layers, select
from .store import ChunkKV, KVStore

log = logging.getLogger(__name__)

_PREFIX_KEY = "__shared_prefix__"
_MAX_AUX_QUERY_TOKENS = 256


@dataclass
class Answer:
    """The result of one request.

    recomputed: positions (in the request's primary token sequence) whose K/V were computed for
        this request: selected chunk tokens plus every uncached token (separators, question).
    cached_tokens / computed_tokens: prompt tokens whose K/V came from the store / were computed.
    effective_fraction: recomputed chunk tokens / all chunk tokens (0 for reuse, 1 for full).
    budget / score_layers: the selection rule and the aux layers that scored (cacheclip mode;
        score_layers is None in every other mode).
    timings: seconds; selection, load, assemble, recompute, ttft, decode, total.
    """

    text: str
    chunk_ids: list[str]
    mode: str
    recompute_ratio: float
    timings: dict[str, float]
    recomputed: list[int]
    prompt_tokens: int
    context_tokens: int
    cached_tokens: int
    computed_tokens: int
    effective_fraction: float
    generated_tokens: int
    budget: str = "keep"
    score_layers: tuple[int, ...] | None = None

    def metadata(self) -> dict:
        """Everything but the text and the row list: what a caller needs to see reuse happened."""
        return {
            "reused_chunk_ids": list(self.chunk_ids),
            "mode": self.mode,
            "recompute_ratio": self.recompute_ratio,
            "timings": dict(self.timings),
            "prompt_tokens": self.prompt_tokens,
            "context_tokens": self.context_tokens,
            "cached_tokens": self.cached_tokens,
            "computed_tokens": self.computed_tokens,
            "effective_fraction": self.effective_fraction,
            "generated_tokens": self.generated_tokens,
            "budget": self.budget,
            "score_layers": list(self.score_layers) if self.score_layers is not None else None,
        }


class AnswerStream:
    """Iterates over the text pieces of one request; `.answer` holds the `Answer` once done.

    Bad input is refused when the stream is created, not on the first iteration.
    """

    def __init__(self, engine: CacheClipEngine, request: Request):
        self._engine, self._request = engine, request
        self._pieces: list[str] = []
        self._iter = engine._run(request)
        self.answer: Answer | None = None

    @property
    def trace(self) -> list[dict]:
        """CacheClip mode: per chunk, the aux scores and what was recomputed (after iterating)."""
        return self._request.trace

    def __iter__(self) -> AnswerStream:
        return self

    def __next__(self) -> str:
        try:
            piece = next(self._iter)
        except StopIteration:
            if self.answer is None:
                self.answer = self._engine._finish(self._request, "".join(self._pieces))
            raise
        self._pieces.append(piece)
        return piece


@dataclass
class _Model:
    """One model with its prompt frame, shared-prefix ids and store namespace."""

    lm: LoadedModel
    template: Template
    prefix_ids: torch.Tensor
    namespace: str


def _namespace(lm: LoadedModel, prefix_ids: torch.Tensor) -> str:
    digest = hashlib.sha256(lm.fingerprint.encode())
    digest.update(prefix_ids.numpy().tobytes())
    return digest.hexdigest()[:32]


class CacheClipEngine:
    """Chunk-cache reuse with CacheClip selective recompute behind a small API."""

    def __init__(self, primary: LoadedModel, aux: LoadedModel, store_dir: str | Path, config: EngineConfig | None = None):
        self.config = config or EngineConfig()
        self.store = KVStore(store_dir, self.config.store)
        self.store.bind_models({"primary": primary.fingerprint, "aux": aux.fingerprint})
        self.primary = self._frame(primary, "primary")
        self.aux = self._frame(aux, "aux")
        self.index = ChunkIndex(Path(store_dir) / "index", self.config.embedder)
        self.matcher = ChunkMatcher()
        self._ingest_lock = threading.Lock()
        # One worker runs aux selection beside the primary loading (CacheClip's CPU/GPU split).
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cacheclip-aux")
        self._open_corpus()

    def _open_corpus(self) -> None:
        """Load the stored chunk texts into the prompt matcher; index any the index lacks."""
        chunks = self.store.chunks()
        for chunk in chunks:
            self.matcher.add(chunk.id, chunk.text)
        missing = [(c.id, c.text) for c in chunks if c.id not in self.index]
        if missing:
            log.warning("chunk index lacks %d of %d stored chunks; adding them", len(missing), len(chunks))
            self.index.add(missing)

    @classmethod
    def from_pretrained(
        cls,
        primary: str = model_lib.DEFAULT_PRIMARY,
        aux: str = model_lib.DEFAULT_AUX,
        store_dir: str | Path = "cacheclip-store",
        config: EngineConfig | None = None,
    ) -> CacheClipEngine:
        """Load both models (embedded default names, local folders or cached hub ids) and open the store."""
        config = config or EngineConfig()
        return cls(model_lib.load(primary, config.model), model_lib.load(aux, config.model), store_dir, config)

    def _frame(self, lm: LoadedModel, role: str) -> _Model:
        template = chat_template(lm, self.config.prompt)
        prefix_ids, _ = tokenize(lm, template.prefix, special=True)
        frame = _Model(lm, template, prefix_ids, _namespace(lm, prefix_ids))
        self.store.describe_namespace(frame.namespace, {"role": role, "model": lm.name, "fingerprint": lm.fingerprint})
        prefix = self.store.get_kv(frame.namespace, _PREFIX_KEY)
        if prefix is None or not torch.equal(prefix.token_ids, prefix_ids):
            self.store.put_kv(frame.namespace, _PREFIX_KEY, encode_prefix(lm, template.prefix))
        return frame

    # ----- offline --------------------------------------------------------------------------

    def ingest(self, documents: Iterable[str | Mapping], progress: bool = True, split: bool = True) -> list[str]:
        """Chunk, cache (primary and aux) and index documents; return chunk ids in document order.

        A document is a str or a mapping with "text" and optional "title" / "source". Chunks
        already in the store are not recomputed. split=False takes each document as one chunk,
        verbatim: that is how a framework's own nodes become reusable chunks.
        """
        if isinstance(documents, (str, bytes, Mapping)):
            raise ValueError("documents must be a list of documents, not a single document")
        chunks: list[Chunk] = []
        for i, doc in enumerate(documents):
            text, source = _document_text(doc, i)
            if split:
                chunks.extend(split_document(text, self.primary.lm.tokenizer, self.config.chunk, source))
            elif text.strip():
                chunks.append(Chunk(chunk_id(text), text, source, 0, len(text)))
            else:
                raise ValueError(f"document {source!r} is empty or whitespace only")
        if not chunks:
            raise ValueError("empty corpus: expected at least one non-empty document")
        with self._ingest_lock:
            unique = list({c.id: c for c in chunks}.values())
            for chunk in tqdm(unique, desc="ingest", unit="chunk", disable=not progress):
                self.store.put_chunk(chunk)
                for frame in (self.primary, self.aux):
                    self._chunk_kv(frame, chunk.id, chunk.text)
                self.matcher.add(chunk.id, chunk.text)
            self.index.add([(c.id, c.text) for c in unique])
        return [c.id for c in chunks]

    def _chunk_kv(self, frame: _Model, chunk_id: str, text: str | None = None) -> ChunkKV:
        """The model's cache of a chunk: from the store, or encoded from the chunk's text."""
        kv = self.store.get_kv(frame.namespace, chunk_id)
        if kv is not None:
            return kv
        if text is None:
            chunk = self.store.get_chunk(chunk_id)
            if chunk is None:
                raise ValueError(f"unknown chunk id {chunk_id!r}: not in the store {self.store.root}")
            text = chunk.text
        return self._encode_and_store(frame, chunk_id, text)

    def _prefix_kv(self, frame: _Model) -> ChunkKV:
        kv = self.store.get_kv(frame.namespace, _PREFIX_KEY)
        if kv is None:
            kv = encode_prefix(frame.lm, frame.template.prefix)
            self.store.put_kv(frame.namespace, _PREFIX_KEY, kv)
        return kv

    def repair(self, progress: bool = True) -> dict:
        """Heal the store: re-encode every missing or damaged cache from its chunk text, drop
        leftover temporary files, re-index chunks the index lacks. Returns counts."""
        report = self.store.verify()
        for tmp in self.store.root.rglob(".tmp-*"):
            tmp.unlink(missing_ok=True)
        rebuilt = 0
        chunks = self.store.chunks()
        for chunk in tqdm(chunks, desc="repair", unit="chunk", disable=not progress):
            for frame in (self.primary, self.aux):
                if self.store.get_kv(frame.namespace, chunk.id) is None:
                    self._encode_and_store(frame, chunk.id, chunk.text)
                    rebuilt += 1
        self.store.clear_memory()
        self._open_corpus()
        return {"checked": report["checked"], "damaged": len(report["damaged"]), "rebuilt": rebuilt, "chunks": len(chunks)}

    def calibrate(self, lengths: tuple[int, ...] = (2048,), samples: int = 6, **kwargs) -> tuple[dict, list]:
        """Calibrate how the aux model scores tokens for this model pair (cacheclip_rag.calibrate)
        and store the profile, used by default from now on. The generated calibration chunks go
        to a scratch store, never into this one. kwargs: seed, max_run, ratio, answer_tokens, criterion,
        progress (progress bars, default on).
        Returns (profile, candidate scores)."""
        from .calibrate import calibrate

        with tempfile.TemporaryDirectory(prefix="cacheclip-calibrate-") as scratch:
            engine = CacheClipEngine(self.primary.lm, self.aux.lm, scratch, self.config)
            try:
                profile, scores = calibrate(engine, lengths, samples, **kwargs)
            finally:
                engine._pool.shutdown()
        self.store.write_profile(profile)
        return profile, scores

    # ----- online ---------------------------------------------------------------------------

    def retrieve(self, question: str, k: int | None = None) -> list[tuple[str, float]]:
        """Top-k chunk ids for a question from the chunk index, with cosine scores."""
        k = self.config.top_k if k is None else k
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 1024:
            raise ValueError(f"k must be an integer in [1, 1024], got {k!r}")
        if len(self.index) == 0:
            raise ValueError("empty corpus: ingest documents before asking questions")
        hits = self.index.search(question, k)
        live = [(cid, score) for cid, score in hits if self.store.get_chunk(cid) is not None]
        if len(live) < len(hits):
            log.warning("chunk index holds %d ids whose texts are gone from the store; skipped", len(hits) - len(live))
        if not live:
            raise ValueError("no retrievable chunk: the index entries found have no text in the store (run `cacheclip store repair`)")
        return live

    def answer(self, question: str, chunk_ids: list[str] | None = None, **kwargs) -> Answer:
        """Answer a question from the given chunks (their order kept) or the top-k retrieved.

        kwargs: k (chunks to retrieve when chunk_ids is None), and the per-request options of
        `cacheclip_rag.request.RequestOptions`: mode, recompute_ratio, max_new_tokens, temperature,
        stop, epic_tokens, seed, budget ("keep", the default, or "paper"), score_layers. An unknown
        or invalid option is a ValueError.
        """
        return self._finish(*self._collect(self._question_request(question, chunk_ids, **kwargs)))

    def stream(self, question: str, chunk_ids: list[str] | None = None, **kwargs) -> AnswerStream:
        """Like `answer`, yielding the text as it is generated; `.answer` is set at the end."""
        return AnswerStream(self, self._question_request(question, chunk_ids, **kwargs))

    def generate(
        self, prompt: str, chunk_ids: list[str] | None = None, *, retrieve: bool = False, k: int | None = None, **kwargs
    ) -> Answer:
        """Answer a prompt that already holds chunk texts (as a RAG framework builds it).

        Every stored chunk whose text appears in the prompt (any template, order, separators) is
        reused from its cache; the rest of the prompt is recomputed. With chunk_ids, only those
        chunks are looked for and each must be present; if none is, the prompt is taken as the
        question and those chunks are placed before it. With retrieve=True, a prompt holding no
        stored chunk is treated as a bare question: the top-k chunks are retrieved and answered
        from. kwargs as for `answer`.
        """
        return self._finish(*self._collect(self._generate_request(prompt, chunk_ids, retrieve, k, kwargs)))

    def stream_generate(
        self, prompt: str, chunk_ids: list[str] | None = None, *, retrieve: bool = False, k: int | None = None, **kwargs
    ) -> AnswerStream:
        """Like `generate`, yielding text pieces as they are decoded; `.answer` is set at the end."""
        return AnswerStream(self, self._generate_request(prompt, chunk_ids, retrieve, k, kwargs))

    def _generate_request(self, prompt, chunk_ids, retrieve, k, kwargs) -> Request:
        if chunk_ids is not None and not self.matcher.find(prompt, set(self._check_ids(chunk_ids))):
            # Ids handed over without their texts in the prompt: the prompt is the question.
            return self._question_request(prompt, chunk_ids, **kwargs)
        request = self._prompt_request(prompt, chunk_ids, **kwargs)
        if not request.chunk_ids and chunk_ids is None:
            if retrieve:
                return self._question_request(prompt, None, k=k, **kwargs)
            log.warning("no stored chunk text found in the prompt: nothing is reused (%d prompt chars)", len(prompt))
        return request

    def _collect(self, request: Request) -> tuple[Request, str]:
        return request, "".join(self._run(request))

    # ----- request building (validation and pieces: request.py) --------------------------------

    def _question_request(self, question: str, chunk_ids: list[str] | None = None, *, k: int | None = None,
                          **options) -> Request:
        """A question over the given chunks, or the top-k retrieved; options: `RequestOptions`."""
        check_text(question, "question")
        opts = RequestOptions.parse(**options)
        if chunk_ids is None:
            chunk_ids = [cid for cid, _ in self.retrieve(question, k)]
        chunk_ids = self._check_ids(chunk_ids)
        pieces, aux_query = question_pieces(question, [(cid, self._chunk_text(cid)) for cid in chunk_ids],
                                            self.config.prompt)
        return self._new_request(opts, chunk_ids, pieces, aux_query)

    def _prompt_request(self, prompt: str, chunk_ids: list[str] | None = None, **options) -> Request:
        """A finished prompt; the stored chunks found in it (only `chunk_ids`, each required, when given)
        are reused. options: `RequestOptions`."""
        check_text(prompt, "prompt")
        opts = RequestOptions.parse(**options)
        only = set(self._check_ids(chunk_ids)) if chunk_ids is not None else None
        found = self.matcher.find(prompt, only)
        if chunk_ids is not None:
            missing = [cid for cid in chunk_ids if cid not in {c for _, _, c in found}]
            if missing:
                raise ValueError(f"chunk ids {missing} were given but their texts are not in the prompt")
        pieces, aux_query = prompt_pieces(prompt, found)
        return self._new_request(opts, [cid for _, _, cid in found], pieces, aux_query)

    def _new_request(self, opts: RequestOptions, chunk_ids: list[str], pieces, aux_query: str) -> Request:
        if opts.score_layers is not None:
            scoring_layers(self.aux.lm, opts.score_layers)  # range check against the aux model
        return Request.of(opts, self.select_config(opts.score_layers), chunk_ids, pieces, aux_query)

    def _check_ids(self, chunk_ids) -> list[str]:
        if isinstance(chunk_ids, str) or not isinstance(chunk_ids, (list, tuple)):
            raise ValueError(f"chunk_ids must be a list of chunk id strings, got {chunk_ids!r}")
        if not chunk_ids:
            raise ValueError("chunk_ids is empty: give at least one chunk id, or None to retrieve")
        unknown = [cid for cid in chunk_ids if not isinstance(cid, str) or self.store.get_chunk(cid) is None]
        if unknown:
            raise ValueError(f"unknown chunk ids {unknown[:5]}: expected ids returned by ingest()")
        return list(chunk_ids)

    def _chunk_text(self, chunk_id: str) -> str:
        chunk = self.store.get_chunk(chunk_id)
        if chunk is None:
            raise ValueError(f"unknown chunk id {chunk_id!r}")
        return chunk.text

    # ----- running --------------------------------------------------------------------------

    def _layout(self, frame: _Model, request: Request) -> Layout:
        tok = lambda text, special: tokenize(frame.lm, text, special)  # noqa: E731
        layout = build_layout(frame.prefix_ids, request.pieces, tok, suffix=frame.template.suffix)
        limit = frame.lm.max_positions
        needed = layout.num_tokens + (request.options.max_new_tokens if frame is self.primary else 0)
        if needed > limit:
            raise ValueError(
                f"request needs {layout.num_tokens} prompt tokens"
                + (f" + {request.options.max_new_tokens} new tokens" if frame is self.primary else "")
                + f" but {frame.lm.name!r} has a context of {limit} positions; use fewer or shorter chunks"
            )
        return layout

    def _run(self, request: Request) -> Iterator[str]:
        """Build the cache for the request's mode, then stream the decoded text."""
        t0 = time.perf_counter()
        timings = request.timings
        for key in ("selection", "load", "assemble", "recompute"):
            timings[key] = 0.0
        frame = self.primary
        layout = request.layout = self._layout(frame, request)
        if request.mode == "full":
            t = time.perf_counter()
            with torch.inference_mode():
                out = frame.lm.model(input_ids=layout.input_ids[None].to(frame.lm.device), use_cache=True, logits_to_keep=1)
            logits = out.logits[0, -1].float()
            step = hf_step(frame.lm, out.cache, layout.num_tokens)
            timings["recompute"] = time.perf_counter() - t
            request.rows = torch.arange(layout.prefix_len, layout.num_tokens)
        else:
            logits, step = self._reuse(frame, layout, request)
        timings["ttft"] = time.perf_counter() - t0
        t = time.perf_counter()
        pieces = []
        with torch.inference_mode():
            for _, piece in decode(frame.lm, step, logits, request.options):
                request.generated += 1
                pieces.append(piece)
                yield piece
        request.text = "".join(pieces)
        timings["decode"] = time.perf_counter() - t
        timings["total"] = time.perf_counter() - t0

    def _reuse(self, frame: _Model, layout: Layout, request: Request):
        """Assemble the chunk caches, recompute the rows the mode picks; return (logits, decode step).

        In cacheclip mode the aux selection runs on a worker thread while the primary caches are
        opened; with layer-wise loading, layer l + 1 is loaded while layer l is recomputed.
        """
        timings, pipe = request.timings, self.config.pipeline
        start = time.perf_counter()
        needs_aux = request.mode == "cacheclip" and 0 < request.ratio < 1 and bool(layout.chunk_segments())
        future = self._pool.submit(self._aux_select, layout, request) if needs_aux and pipe.overlap_selection else None

        t = time.perf_counter()
        sources = {seg.chunk_id: self._open_chunk(frame, seg.chunk_id, seg.text) for seg in layout.chunk_segments()}
        prefix_kv = self._prefix_kv(frame)
        timings["load"] = time.perf_counter() - t

        picks = None
        if needs_aux:
            t = time.perf_counter()
            picks, timings["selection"] = future.result() if future is not None else self._aux_select(layout, request)
            timings["selection_wait"] = time.perf_counter() - t if future is not None else timings["selection"]
            timings["selection_hidden"] = max(0.0, timings["selection"] - timings["selection_wait"])
        selected, blend, ape = self._mode_plan(layout, sources, picks, request)

        t = time.perf_counter()
        positions = ape_positions(layout) if ape is not None else torch.arange(layout.num_tokens)
        cache = AssembledCache.empty(frame.lm, layout.num_tokens + request.options.max_new_tokens)
        write_prefix(cache, layout, prefix_kv)
        def rebuild(cid: str, err: Exception) -> ChunkKV:
            self.store.discard(frame.namespace, cid, err)
            return self._encode_and_store(frame, cid, None)

        keep = lambda cid, kv: self.store.remember(frame.namespace, cid, kv)  # noqa: E731
        feeder = LayerFeeder(
            frame.lm, layout, sources, positions, cache, rebuild, pipelined=pipe.layerwise_loading, on_loaded=keep
        )

        rows = torch.unique(torch.cat([layout.uncached_rows(), selected]))  # sorted
        result = recompute_rows(
            frame.lm, cache, layout.input_ids, rows, positions=positions, backend=self.config.attention_backend,
            ape=ape, blend=blend, layer_ready=feeder.wait,
        )
        feeder.finish()
        request.rows = result.rows
        timings["assemble"] = feeder.busy  # loading + re-rotation per layer, overlapped when pipelined
        timings["load_wait"] = feeder.waited
        timings["recompute"] = time.perf_counter() - t - feeder.waited
        timings["prepare"] = time.perf_counter() - start
        return result.logits, self._own_step(frame, cache, layout, positions, ape)

    def _open_chunk(self, frame: _Model, chunk_id: str, text: str):
        """A chunk's primary cache for layer-wise loading (memory tier, reader, or fresh encode)."""
        if self.config.pipeline.layerwise_loading:
            source = self.store.open_layers(frame.namespace, chunk_id)
            if source is not None and source.token_ids.numel() == 0:
                source = None
            if source is not None:
                return source
        return self._chunk_kv(frame, chunk_id, text)

    def _encode_and_store(self, frame: _Model, chunk_id: str, text: str | None) -> ChunkKV:
        if text is None:
            text = self._chunk_text(chunk_id)
        kv = encode_segment(frame.lm, frame.prefix_ids, text)
        self.store.put_kv(frame.namespace, chunk_id, kv)
        return kv

    def _mode_plan(self, layout: Layout, sources: dict, picks, request: Request):
        """What the mode recomputes besides the plain-text rows: (selected rows, blend spec, APE spec)."""
        selected = torch.empty(0, dtype=torch.long)
        chunk_rows = layout.chunk_rows()
        mode, ratio = request.mode, request.ratio
        base = self.config.baselines
        if mode == "ape":
            context = torch.zeros(layout.num_tokens + request.options.max_new_tokens, dtype=torch.bool)
            context[chunk_rows] = True
            return selected, None, ApeSpec(context, base.ape_temperature, base.ape_scale)
        if mode == "reuse" or chunk_rows.numel() == 0 or ratio <= 0:
            return selected, None, None
        if mode == "cacheblend":
            candidates = torch.zeros(layout.num_tokens, dtype=torch.bool)
            candidates[chunk_rows] = True
            spec = BlendSpec(candidates, ratio, base.cacheblend_check_layer, base.cacheblend_on)
            return chunk_rows, spec, None
        if ratio >= 1.0:
            return chunk_rows, None, None
        if mode == "epic":
            parts = []
            for seg in layout.chunk_segments():
                n = request.epic_tokens if request.epic_tokens is not None else math.ceil(ratio * (seg.end - seg.start))
                parts.append(torch.arange(seg.start, min(seg.end, seg.start + n)))
            return torch.cat(parts), None, None
        if mode == "oracle":
            return self._oracle_rows(self.primary.lm, layout, request), None, None
        if mode == "random":
            gen = torch.Generator().manual_seed(request.seed)
            k = round(ratio * chunk_rows.numel())
            return chunk_rows[torch.randperm(chunk_rows.numel(), generator=gen)[:k]], None, None
        return self._map_selection(layout, picks, sources, request), None, None

    def _own_step(self, frame: _Model, cache, layout: Layout, positions: torch.Tensor, ape) -> Step:
        """Decode through the same layer loop as recompute, into the preallocated cache rows."""
        n = layout.num_tokens
        extra = cache.num_tokens - n
        ids = torch.cat([layout.input_ids, torch.zeros(extra, dtype=torch.long)])
        pos = torch.cat([positions, positions[-1] + 1 + torch.arange(extra)])
        backend = self.config.attention_backend

        def step(token: int, t: int) -> torch.Tensor:
            ids[n + t] = token
            row = torch.tensor([n + t])
            return recompute_rows(frame.lm, cache, ids, row, positions=pos, backend=backend, ape=ape).logits

        return step

    @property
    def score_layers(self) -> tuple[int, ...]:
        """Aux scoring layers: the config's, else the calibrated profile of this pair, else the last."""
        return self.select_config().score_layers

    def select_config(self, score_layers: tuple[int, ...] | None = None) -> SelectConfig:
        """The selection config a request runs with, every scoring field set: `score_layers`
        (a request's), else the engine config's fields, else the calibrated profile's (read from
        the store now), else defaults."""
        cfg = self.config.select.resolve(self.profile)
        return dataclasses.replace(cfg, score_layers=score_layers) if score_layers else cfg

    @property
    def profile(self) -> dict | None:
        """The calibrated model-pair profile stored with the store, if it is for these models."""
        return self.store.read_profile(self.primary.lm.fingerprint, self.aux.lm.fingerprint)

    def _oracle_rows(self, lm: LoadedModel, layout: Layout, request: Request) -> torch.Tensor:
        """Analysis only: select by the primary's own last-layer attention from a full prefill."""
        segments = layout.chunk_segments()
        query_rows = torch.arange(segments[-1].end, layout.num_tokens)
        attention = attention_from_rows(lm, layout.input_ids, query_rows, [-1])[-1]
        scores = [attention[seg.start : seg.end] for seg in segments]
        picks = pick(scores, request.ratio, request.select, request.budget)
        return torch.cat([seg.start + torch.nonzero(p.kept).flatten() for seg, p in zip(segments, picks)])

    def _aux_select(self, layout: Layout, request: Request):
        """CacheClip on the aux model (thread-safe): per chunk (aux cache, selection); seconds taken."""
        start = time.perf_counter()
        segments = layout.chunk_segments()
        aux_kvs = [self._chunk_kv(self.aux, seg.chunk_id, seg.text) for seg in segments]
        query_ids = self._aux_query_ids(request)
        self._check_aux_length(aux_kvs, query_ids)
        picks = select(self.aux.lm, request.select, request.ratio, self._prefix_kv(self.aux), aux_kvs, query_ids,
                       budget=request.budget)
        return list(zip(segments, aux_kvs, picks)), time.perf_counter() - start

    def _aux_query_ids(self, request: Request) -> torch.Tensor:
        """[Q] aux tokens of the query rows: the question, then the assistant turn's opening."""
        ids = torch.cat([tokenize(self.aux.lm, request.aux_query)[0], tokenize(self.aux.lm, self.aux.template.suffix, True)[0]])
        return ids[-_MAX_AUX_QUERY_TOKENS:]

    def _map_selection(self, layout: Layout, picks, sources: dict, request: Request) -> torch.Tensor:
        """Kept aux tokens -> primary positions [S] through character offsets."""
        rows = []
        for seg, aux_kv, pick in picks:
            primary_offsets = sources[seg.chunk_id].offsets
            mask = map_tokens(aux_kv.offsets, pick.kept, primary_offsets, len(seg.text))
            mask[: request.select.chunk_start_tokens] = True
            rows.append(seg.start + torch.nonzero(mask).flatten())
            request.trace.append(dict(
                chunk_id=seg.chunk_id, text=seg.text, aux_offsets=aux_kv.offsets, aux_scores=pick.scores,
                aux_candidates=pick.candidates, aux_kept=pick.kept, primary_offsets=primary_offsets, recomputed=mask,
            ))
        return torch.cat(rows) if rows else torch.empty(0, dtype=torch.long)

    def _check_aux_length(self, aux_kvs: list[ChunkKV], query_ids: torch.Tensor) -> None:
        longest = max(kv.num_tokens for kv in aux_kvs)
        needed = int(self.aux.prefix_ids.numel()) + longest + int(query_ids.numel())
        if needed > self.aux.lm.max_positions:
            raise ValueError(
                f"a chunk plus the query needs {needed} positions in the aux model "
                f"{self.aux.lm.name!r}, which has {self.aux.lm.max_positions}; use a smaller chunk size"
            )

    def _finish(self, request: Request, text: str) -> Answer:
        layout = request.layout
        assert layout is not None and request.rows is not None
        chunk_rows = layout.chunk_rows()
        n_context = int(chunk_rows.numel())
        recomputed_context = int(torch.isin(request.rows, chunk_rows).sum()) if n_context else 0
        cached = 0 if request.mode == "full" else layout.prefix_len + n_context - recomputed_context
        return Answer(
            text=text.strip(),
            chunk_ids=list(request.chunk_ids),
            mode=request.mode,
            recompute_ratio=request.ratio,
            timings=dict(request.timings),
            recomputed=request.rows.tolist(),
            prompt_tokens=layout.num_tokens,
            context_tokens=n_context,
            cached_tokens=cached,
            computed_tokens=layout.num_tokens - cached,
            effective_fraction=recomputed_context / n_context if n_context else 0.0,
            generated_tokens=request.generated,
            budget=request.budget,
            score_layers=request.select.score_layers if request.mode == "cacheclip" else None,
        )


def _document_text(doc, i: int) -> tuple[str, str]:
    if isinstance(doc, str):
        return doc, f"doc{i}"
    if isinstance(doc, Mapping):
        text = doc.get("text")
        if not isinstance(text, str):
            raise ValueError(f"document {i} must have a 'text' string, got {type(text).__name__}")
        title = doc.get("title")
        source = str(doc.get("source") or title or f"doc{i}")
        return (f"{title}\n{text}" if isinstance(title, str) and title else text), source
    raise ValueError(f"document {i} must be a str or a mapping with 'text', got {type(doc).__name__}")
