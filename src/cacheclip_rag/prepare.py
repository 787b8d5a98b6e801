"""Stage 1 of a request: from a question or a finished prompt to a `Prepared` request.

`Preparer` turns what a caller gives (a question and chunk ids or none, or a prompt that already
holds chunk texts) into a validated `Request` and the primary model's token layout. The result,
`Prepared` (prepared.py), is what every later stage reads. The mode names a registered selector
(`plan.get`); an unknown one is a ValueError here, before anything runs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from . import packets as packet_lib
from . import plan
from .assemble import Layout, build_layout
from .caches import ChunkCaches
from .config import AUTO, EngineConfig, SelectConfig
from .encode import chat_frame, tokenize
from .prepared import Prepared
from .recognize import ChunkMatcher
from .request import Request, RequestOptions, chat_pieces, check_text, prompt_pieces, question_pieces
from .select import scoring_layers
from .store import KVStore

log = logging.getLogger(__name__)

class Preparer:
    """Builds `Prepared` requests; holds only long-lived, read-only things (store, matcher, caches).

    retrieve: (question, k) -> [(chunk id, score)], the engine's retrieval. select_config:
    (score layers or None, aux context or None, request tokens) -> the resolved selection config
    a request runs with (the profile calibrated nearest its length).
    """

    def __init__(self, store: KVStore, matcher: ChunkMatcher, primary: ChunkCaches, aux: ChunkCaches,
                 config: EngineConfig, retrieve: Callable, select_config: Callable[..., SelectConfig],
                 packets: ChunkCaches | None = None, catch_up: Callable[[], int] | None = None):
        self.store, self.matcher, self.primary, self.aux, self.config = store, matcher, primary, aux, config
        self.packets = packets
        self._catch_up = catch_up or (lambda: 0)
        """Before a request reads the corpus: take in what other processes ingested meanwhile."""
        self._retrieve, self._select_config = retrieve, select_config

    def question(self, question: str, chunk_ids: list[str] | None = None, *, k: int | None = None,
                 **options) -> Prepared:
        """A question over the given chunks (their order kept), or the top-k retrieved."""
        check_text(question, "question")
        opts = RequestOptions.parse(**options)
        if chunk_ids is None:
            chunk_ids = [cid for cid, _ in self._retrieve(question, k)]
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
        self._catch_up()
        only = set(self.check_ids(chunk_ids)) if chunk_ids is not None else None
        found = [self.matcher.find(c, only) if c else [] for c in contents]
        ids = [cid for hits in found for _, _, cid in hits]
        if not ids and (chunk_ids is not None or retrieve):
            question = contents[-1]
            chunks = self.chunk_texts(chunk_ids) if chunk_ids is not None else \
                self.chunk_texts([cid for cid, _ in self._retrieve(question, k)])
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
        self._catch_up()
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
        request = Request.of(opts, None, chunk_ids, pieces, aux_query)
        primary = self.primary
        selector = plan.get(opts.mode)  # a ValueError naming the modes for an unknown one
        if opts.recompute_ratio == AUTO and not selector.adaptive and selector.fixed_ratio is None:
            adaptive = [m for m in plan.modes() if plan.get(m).adaptive]
            raise ValueError(f"recompute_ratio 'auto' needs a mode that sizes its own budget ({adaptive}); "
                             f"mode {opts.mode!r} takes a number in [0, 1]")
        if selector.packets:
            if self.packets is None:
                raise ValueError(f"mode {opts.mode!r} needs KV Packet adapters for {primary.lm.name!r}: none ship for "
                                 "it; train them with `cacheclip train packet --out FILE` and set EngineConfig.packets")
            primary = self.packets
        layout = self.layout(request, primary)
        # The profile calibrated nearest this request's length sets how the aux model scores.
        request.select = self._select_config(opts.score_layers, opts.aux_context, layout.num_tokens)
        return Prepared(request, layout, primary, self.aux, self.config)

    def layout(self, request: Request, primary: ChunkCaches | None = None) -> Layout:
        """The primary token sequence (with packet caches: the chunks' soft rows around them); a
        ValueError when prompt + new tokens exceed the model's context."""
        primary = primary or self.primary
        lm, adapters = primary.lm, primary.adapters
        wrap = (lambda ids, offsets: packet_lib.wrap_ids(adapters, ids, offsets)) if adapters is not None else None
        layout = build_layout(primary.prefix_ids, request.pieces, lambda text, special: tokenize(lm, text, special),
                              suffix=primary.template.suffix, wrap=wrap)
        new = request.options.max_new_tokens
        if layout.num_tokens + new > lm.max_positions:
            raise ValueError(f"request needs {layout.num_tokens} prompt tokens + {new} new tokens but {lm.name!r} has "
                             f"a context of {lm.max_positions} positions; use fewer or shorter chunks")
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
