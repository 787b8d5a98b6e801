"""Stage 1 of a request: from a question or a finished prompt to a `Prepared` request.

`Preparer` turns what a caller gives (a question and chunk ids or none, or a prompt that already
holds chunk texts) into a validated `Request` and the primary model's token layout. The result,
`Prepared` (prepared.py), is what every later stage reads. The mode names a registered selector
(`selector.get`), looked up here once and carried on the `Prepared`; an unknown one is a
ValueError here, before anything runs.
"""

from __future__ import annotations

import logging

from ..config import AUTO, EngineConfig
from ..corpus import packets as packet_lib
from ..corpus.caches import ChunkCaches
from ..corpus.encode import chat_frame, tokenize
from ..corpus.ingest import Ingestor
from ..storage.store import KVStore
from .profile_source import ProfileSource, scoring_layers
from . import selector as registry
from .assemble import Layout, build_layout
from .context import Prepared
from .options import (
    Request,
    RequestOptions,
    chat_pieces,
    check_text,
    prompt_pieces,
    question_pieces,
)

log = logging.getLogger(__name__)

class Preparer:
    """Builds `Prepared` requests; holds only long-lived things (store, index, matcher, caches,
    the profile source), read here and written by nothing a request does.

    ingestor: whose `catch_up` takes in, before a request reads the corpus, the chunks other
    processes ingested meanwhile (a catch-up that found some re-reads the profiles too: the
    process that ingested may have calibrated). profiles: the pair's calibrated profiles.
    """

    def __init__(self, store: KVStore, ingestor: Ingestor, primary: ChunkCaches, aux: ChunkCaches,
                 config: EngineConfig, profiles: ProfileSource, packets: ChunkCaches | None = None):
        self.store, self.ingestor, self.primary, self.aux, self.config = store, ingestor, primary, aux, config
        self.index, self.matcher = ingestor.index, ingestor.matcher
        self.profiles, self.packets = profiles, packets

    def catch_up(self) -> None:
        """Take in what other processes sharing the store ingested (cheap when nothing is new)."""
        if self.ingestor.catch_up():
            self.profiles.refresh()

    def retrieve(self, question: str, k: int | None = None) -> list[tuple[str, float]]:
        """Top-k chunk ids for a question from the chunk index, with cosine scores."""
        k = self.config.top_k if k is None else k
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 1024:
            raise ValueError(f"k must be an integer in [1, 1024], got {k!r}")
        self.catch_up()
        if len(self.index) == 0:
            raise ValueError("empty corpus: ingest documents before asking questions")
        hits = self.index.search(question, k)
        live = [(cid, score) for cid, score in hits if self.store.get_chunk(cid) is not None]
        if len(live) < len(hits):
            log.warning("chunk index holds %d ids whose texts are gone from the store; skipped", len(hits) - len(live))
        if not live:
            raise ValueError("no retrievable chunk: the index entries found have no text in the store (run `cacheclip store repair`)")
        return live

    def question(self, question: str, chunk_ids: list[str] | None = None, *, k: int | None = None,
                 **options) -> Prepared:
        """A question over the given chunks (their order kept), or the top-k retrieved."""
        check_text(question, "question")
        opts = RequestOptions.parse(**options)
        if chunk_ids is None:
            chunk_ids = [cid for cid, _ in self.retrieve(question, k)]
        chunks = self.chunk_texts(chunk_ids)
        pieces, aux_query = question_pieces(question, chunks, self.config.prompt)
        return self._prepared(opts, [cid for cid, _ in chunks], pieces, aux_query)

    def prompt(self, prompt: str, chunk_ids: list[str] | None = None, **options) -> Prepared:
        """A finished prompt; the stored chunks found in it (only `chunk_ids`, each required, when
        given) are reused."""
        return self._from_found(prompt, chunk_ids, self._find(prompt, chunk_ids), options)

    def generate(self, prompt: str, chunk_ids: list[str] | None, retrieve: bool, k: int | None,
                 options: dict) -> Prepared:
        """`engine.generate`'s rule: chunk texts found in the prompt are reused; ids given without
        their texts make the prompt a question over them; retrieve=True answers a prompt with no
        stored chunk from the top-k retrieved."""
        found = self._find(prompt, chunk_ids)  # (caught up there)
        if chunk_ids is not None and not found:
            return self.question(prompt, chunk_ids, **options)
        prepared = self._from_found(prompt, chunk_ids, found, options)
        if not prepared.request.chunk_ids and chunk_ids is None:
            if retrieve:
                return self.question(prompt, None, k=k, **options)
            log.warning("no stored chunk text found in the prompt: nothing is reused (%d prompt chars)", len(prompt))
        return prepared

    def chat(self, messages: list[dict], chunk_ids: list[str] | None, retrieve: bool, k: int | None,
             options: dict) -> Prepared:
        """A conversation through the model's chat template (`encode.chat_frame`); stored chunk
        texts in any message are reused. With chunk_ids, only those are looked for and each must
        be present; if none is, they are placed before the last message, as a question over them.
        With retrieve=True, a conversation holding no stored chunk gets the top-k chunks retrieved
        for its last message, placed the same way."""
        contents, glue = chat_frame(self.primary.lm, self.config.prompt, messages)
        opts = RequestOptions.parse(**options)
        self.catch_up()
        only = set(self.check_ids(chunk_ids)) if chunk_ids is not None else None
        found = [self.matcher.find(c, only) if c else [] for c in contents]
        ids = [cid for hits in found for _, _, cid in hits]
        if not ids and (chunk_ids is not None or retrieve):
            question = contents[-1]
            chunks = self.chunk_texts(chunk_ids) if chunk_ids is not None else \
                self.chunk_texts([cid for cid, _ in self.retrieve(question, k)])
            last, aux_query = question_pieces(question, chunks, self.config.prompt)
            head, _ = chat_pieces(contents[:-1] + [""], glue, found[:-1] + [[]])
            return self._prepared(opts, [cid for cid, _ in chunks], head + last, aux_query)
        if chunk_ids is not None:
            missing = [cid for cid in chunk_ids if cid not in ids]
            if missing:
                raise ValueError(f"chunk ids {missing} were given but their texts are not in the messages")
        pieces, aux_query = chat_pieces(contents, glue, found)
        return self._prepared(opts, ids, pieces, aux_query)

    def _find(self, prompt: str, chunk_ids: list[str] | None) -> list[tuple[int, int, str]]:
        """[(start, end, chunk id)] of the stored chunk texts in the prompt (only `chunk_ids`'s,
        when given, each checked to be a stored chunk)."""
        check_text(prompt, "prompt")
        self.catch_up()
        return self.matcher.find(prompt, set(self.check_ids(chunk_ids)) if chunk_ids is not None else None)

    def _from_found(self, prompt: str, chunk_ids: list[str] | None, found: list[tuple[int, int, str]],
                    options: dict) -> Prepared:
        """The prompt request over the chunks found in it; every given id must have been found."""
        opts = RequestOptions.parse(**options)
        if chunk_ids is not None:
            missing = [cid for cid in chunk_ids if cid not in {c for _, _, c in found}]
            if missing:
                raise ValueError(f"chunk ids {missing} were given but their texts are not in the prompt")
        pieces, aux_query = prompt_pieces(prompt, found)
        return self._prepared(opts, [cid for _, _, cid in found], pieces, aux_query)

    def _prepared(self, opts: RequestOptions, chunk_ids: list[str], pieces, aux_query: str) -> Prepared:
        if opts.score_layers is not None:
            scoring_layers(self.aux.lm, opts.score_layers)  # range check against the aux model
        selector = registry.get(opts.mode)  # a ValueError naming the modes for an unknown one
        if opts.recompute_ratio == AUTO and not selector.adaptive and selector.fixed_ratio is None:
            adaptive = [m for m in registry.modes() if registry.get(m).adaptive]
            raise ValueError(f"recompute_ratio 'auto' needs a mode that sizes its own budget ({adaptive}); "
                             f"mode {opts.mode!r} takes a number in [0, 1]")
        primary = self.primary
        if selector.packets:
            if self.packets is None:
                raise ValueError(f"mode {opts.mode!r} needs KV Packet adapters for {primary.lm.name!r}: none ship for "
                                 "it; train them with `cacheclip train packet --out FILE` and set EngineConfig.packets")
            primary = self.packets
        layout = self.layout(pieces, opts.max_new_tokens, primary)
        # The profile calibrated nearest this request's length sets how the aux model scores.
        select = self.profiles.settings(layout.num_tokens, opts.score_layers, opts.aux_context)
        request = Request.of(opts, select, chunk_ids, pieces, aux_query)
        return Prepared(request, selector, layout, primary, self.aux, self.config)

    def layout(self, pieces: list, max_new_tokens: int, primary: ChunkCaches | None = None) -> Layout:
        """The primary token sequence of a request's pieces (with packet caches: the chunks' soft
        rows around them); a ValueError when prompt + new tokens exceed the model's context."""
        primary = primary or self.primary
        lm, adapters = primary.lm, primary.adapters
        wrap = (lambda ids, offsets: packet_lib.wrap_ids(adapters, ids, offsets)) if adapters is not None else None
        layout = build_layout(primary.prefix_ids, list(pieces), lambda text, special: tokenize(lm, text, special),
                              suffix=primary.template.suffix, wrap=wrap)
        if layout.num_tokens + max_new_tokens > lm.max_positions:
            raise ValueError(f"request needs {layout.num_tokens} prompt tokens + {max_new_tokens} new tokens but "
                             f"{lm.name!r} has a context of {lm.max_positions} positions; use fewer or shorter chunks")
        return layout

    def check_ids(self, chunk_ids) -> list[str]:
        """The ids as a list, each a stored chunk's; a ValueError naming the unknown ones."""
        return [cid for cid, _ in self.chunk_texts(chunk_ids)]

    def chunk_texts(self, chunk_ids) -> list[tuple[str, str]]:
        """[(id, text)] in the given order, each text read from the store once."""
        if isinstance(chunk_ids, str) or not isinstance(chunk_ids, (list, tuple)):
            raise ValueError(f"chunk_ids must be a list of chunk id strings, got {chunk_ids!r}")
        if not chunk_ids:
            raise ValueError("chunk_ids is empty: give at least one chunk id, or None to retrieve")
        chunks = {cid: self.store.get_chunk(cid) for cid in chunk_ids if isinstance(cid, str)}
        unknown = [cid for cid in chunk_ids if not isinstance(cid, str) or chunks[cid] is None]
        if unknown:
            raise ValueError(f"unknown chunk ids {unknown[:5]}: expected ids returned by ingest()")
        return [(cid, chunks[cid].text) for cid in chunk_ids]
