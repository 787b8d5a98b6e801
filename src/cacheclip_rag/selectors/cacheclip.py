"""`cacheclip`: CacheClip's selection (arXiv:2510.10129). The aux model reuses its own cache of
each chunk and computes only the query rows; their attention over the chunk's tokens at the
scoring layers (calibrated per model pair, else the last) ranks the aux tokens; the top ones
become candidates, sliding-window grouping keeps dense runs, and the kept aux tokens map to
primary tokens through character offsets. Runs on the aux worker thread, beside the loading of
the primary caches."""

from __future__ import annotations

import dataclasses
import logging
import time

import torch

from ..config import AUTO, SelectConfig
from ..models.loading import LoadedModel
from ..request.plan import Plan
from ..request.profile_source import scoring_layers
from ..request.selector import Selector, register
from ..storage.record import ChunkKV
from .aux_scores import aux_scores, joint_positions
from .budget import ChunkSelection, map_tokens, mass_ratio, pick

log = logging.getLogger(__name__)


def select(
    aux: LoadedModel,
    cfg: SelectConfig,
    ratio: float,
    aux_prefix: ChunkKV,
    aux_chunks: list[ChunkKV],
    query_ids: torch.Tensor,
    budget: str = "keep",
) -> list[ChunkSelection]:
    """Score, pick candidates and group, per chunk, in aux token space. cfg: resolved
    (`ProfileSource.settings`), so its scoring layers and aggregations are all set."""
    scores = aux_scores(aux, cfg, aux_prefix, aux_chunks, query_ids)
    if ratio == AUTO:
        ratio = mass_ratio(scores, cfg.auto_share, cfg.auto_floor, cfg.auto_cap)
    return pick(scores, ratio, cfg, budget)


class CacheClip(Selector):
    name = "cacheclip"
    uses_aux = True
    adaptive = True  # recompute_ratio "auto": `select.mass_ratio` over the aux scores

    def plan(self, prepared) -> Plan:
        start = time.perf_counter()
        request = prepared.request
        segments = prepared.layout.chunk_segments()
        cfg, aux_kvs, query_ids = self.scoring(prepared)
        picks = select(prepared.aux.lm, cfg, request.ratio, prepared.aux_prefix_kv(), aux_kvs, query_ids,
                       budget=request.budget)
        rows, trace = [], []
        for seg, aux_kv, pick in zip(segments, aux_kvs, picks):
            text_rows = seg.ids >= 0  # a packet's soft rows (negative ids) hold no text: never picked
            mask = map_tokens(aux_kv.offsets, pick.kept, seg.offsets, len(seg.text)) & text_rows
            mask[torch.nonzero(text_rows).flatten()[: request.select.chunk_start_tokens]] = True
            rows.append(seg.start + torch.nonzero(mask).flatten())
            trace.append(dict(
                chunk_id=seg.chunk_id, text=seg.text, aux_offsets=aux_kv.offsets, aux_scores=pick.scores,
                aux_candidates=pick.candidates, aux_kept=pick.kept, primary_offsets=seg.offsets, recomputed=mask,
            ))
        return Plan(rows=torch.cat(rows), trace=tuple(trace),
                    seconds=time.perf_counter() - start)


    @staticmethod
    def scoring(prepared) -> tuple[SelectConfig, list, torch.Tensor]:
        """What the aux model scores a request with: the request's selection config (per chunk where
        the joint sequence would not fit the aux model), the chunks' aux caches up to the deepest
        scoring layer, and the query's aux tokens. Calibration scores through this too."""
        aux = prepared.aux
        deepest = max(scoring_layers(aux.lm, prepared.request.select.score_layers)) + 1
        aux_kvs = prepared.aux_kvs(layers=deepest)  # scoring stops there; so does reading
        query_ids = prepared.aux_query_ids()
        return _fitting(prepared.request.select, prepared, aux_kvs, query_ids), aux_kvs, query_ids


def _fitting(cfg: SelectConfig, prepared, aux_kvs, query_ids: torch.Tensor) -> SelectConfig:
    """cfg, scored per chunk where the joint sequence would not fit the aux model's positions;
    a ValueError when not even one chunk plus the query fits."""
    aux = prepared.aux
    fixed = int(aux.prefix_ids.numel()) + int(query_ids.numel())
    needed = fixed + max(kv.num_tokens for kv in aux_kvs)
    if needed > aux.lm.max_positions:
        raise ValueError(f"a chunk plus the query needs {needed} positions in the aux model {aux.lm.name!r}, "
                         f"which has {aux.lm.max_positions}; use a smaller chunk size")
    joint = joint_positions(prepared.aux_prefix_kv(), aux_kvs, query_ids)
    if cfg.context == "joint" and joint > aux.lm.max_positions:
        log.info("joint aux scoring needs %d positions, the aux model has %d: scoring per chunk", joint,
                 aux.lm.max_positions)
        return dataclasses.replace(cfg, context="chunk")
    return cfg


register(CacheClip())
