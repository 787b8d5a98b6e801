"""The analysis seam: what the benchmark harness (`benchmarks/`, the `cacheclip-bench` package)
may use of the library beyond its public names (`cacheclip_rag.__all__`).

The harness measures the library from outside; it imports `cacheclip_rag` and this module, and
nothing else of the library (`tests/test_layering.py` holds it to that). Nothing in the library
imports this module. A name lands here when a bench needs it and the user-facing API has no
business exposing it; the groups below say why each is needed.

Teacher forcing and the reference
    `reference` prefills a request in full and greedily answers it (the oracle every fidelity
    number is measured against); `packet_reference` is the same over KV Packet's wrapped
    sequence; `kl_positions` and `top1_agreement` compare a mode's teacher-forced logits with it.

Analysis-only modes
    `register` adds a selector under a mode name (the harness's `oracle` and the bench variants
    register through it); `Selector` and `Plan` are what one implements and returns; `pick` is the
    one rule that turns scores and a ratio into rows; the scoring functions of the shipped
    selectors let a variant recombine them (`aux_scores`, `aux_deviation`, `relative_deviation`:
    how far a reused cache is from a full pass's, as the staleness selectors and the ceilings read it). `selector_registry` lists and looks up modes.

The layer loop, for profiling
    `assemble`, `AssembledCache`, `recompute_rows` and `attention_path` run and name the stages of
    one request's recompute (`bench recompute-profile`, `bench deviation`).

Inputs the benches generate
    The needle suite (`needle_samples`, `needle_score`, `NeedleSample`, `VARIANTS`), the reader of
    QA files (`qa_data`: the public evaluation format, CacheBlend's and LongBench's), filler prose
    (`prose`, `needle_context`), the seeds calibration owns (`CALIBRATION_SEED_BASE`), and
    aux-to-primary character mapping (`to_chars`, `top_jaccard`, `encode_text`, `split_document`).

Parts measured on their own
    Models (`load_model`, `wrap`, `LoadedModel`, `gguf_path`), the chunk index (`ChunkIndex`),
    codecs (`codecs`, `codec_names`), the store's `hit_rate`, the HTTP server (`create_app`,
    `BackgroundServer`, `Keys`: imported on first use, as they need FastAPI), and the command line's engine flags (`add_common`, `add_dtype`,
    `engine_from_args`, `engine_config`, `progress_bar`, `ratio_arg`) so that a bench takes the same
    engine flags as `cacheclip ask`.
"""

from __future__ import annotations

from .cli.common import (
    add_common,
    add_dtype,
    engine_config,
    engine_from_args,
    progress_bar,
)
from .config import AUTO, PipelineConfig
from .corpus.chunking import encode_text, split_document
from .corpus.index import ChunkIndex
from .hardware import describe as describe_cpu
from .hardware import machine
from .models.loading import LoadedModel, gguf_path, wrap
from .models.loading import load as load_model
from .offline import qa_data
from .offline.calibrate import CALIBRATION_SEED_BASE
from .offline.haystack import needle_context, prose
from .offline.niah import VARIANTS, NeedleSample
from .offline.niah import generate as needle_samples
from .offline.niah import score as needle_score
from .offline.overlap import to_chars, top_jaccard
from .offline.qa_data import QAExample
from .offline.reference import (
    Reference,
    kl_positions,
    packet_reference,
    reference,
    top1_agreement,
)
from .paths import cache_dir, read_user_text
from .request import selector as selector_registry
from .request.assemble import AssembledCache
from .request.execute import SELECTION
from .request.options import ratio_arg
from .request.pipeline import assemble
from .request.plan import Plan
from .request.recompute import STAGES as RECOMPUTE_STAGES
from .request.recompute import attention_path, recompute_rows
from .request.selector import Selector, register
from .selectors.aux_scores import aux_scores
from .selectors.aux_staleness import CacheClipStale, Cascade, aux_deviation, relative_deviation
from .selectors.budget import pick
from .selectors.cacheclip import CacheClip
from .selectors.primary_attention import attention_from_rows, rows_attention
from .selectors.prophetkv import ProphetKV, query_attention
from .storage import codecs
from .storage.codecs import names as codec_names
from .storage.store import hit_rate

__all__ = [
    "AUTO", "AssembledCache", "CALIBRATION_SEED_BASE", "CacheClip", "CacheClipStale", "Cascade", "ChunkIndex",
    "LoadedModel", "NeedleSample", "PipelineConfig", "Plan", "ProphetKV", "QAExample", "RECOMPUTE_STAGES", "Reference",
    "SELECTION", "Selector", "VARIANTS",
    "add_common", "add_dtype", "assemble", "attention_from_rows", "attention_path", "aux_deviation", "aux_scores", "cache_dir",
    "codec_names", "codecs", "describe_cpu", "encode_text", "engine_config", "engine_from_args",
    "gguf_path", "hit_rate", "kl_positions", "load_model", "machine", "needle_context", "needle_samples",
    "needle_score", "packet_reference", "pick", "progress_bar", "prose", "qa_data", "query_attention", "ratio_arg",
    "read_user_text", "recompute_rows", "reference", "register", "relative_deviation", "rows_attention", "selector_registry",
    "split_document", "to_chars", "top1_agreement", "top_jaccard", "wrap",
]

_SERVING = {"BackgroundServer", "create_app", "Keys"}
"""Served by `__getattr__` (not in `__all__`): the server's names, imported on first use."""


def __getattr__(name: str):
    """The server's names, imported on first use: they need the `serve` extra (FastAPI), which a
    bare GPU machine running the GPU check does not have."""
    if name in _SERVING:
        from .serving.access import Keys
        from .serving.server import BackgroundServer, create_app

        return {"BackgroundServer": BackgroundServer, "create_app": create_app, "Keys": Keys}[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
