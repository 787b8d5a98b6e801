"""Typed configuration, one dataclass per concern, validated on construction.

Everything a request may vary (mode, recompute ratio, max_new_tokens) is an argument of the
request, not a field here: these objects describe how the engine is built.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .hardware import DTYPES, resolve_device, resolve_dtype
from .select_config import (  # noqa: F401  (re-exported: the selection settings are part of the engine config)
    AUX_CONTEXTS,
    BUDGETS,
    DEFAULT_AUTO_SHARE,
    SCORING_CHOICES,
    STALE_DEFAULTS,
    STALE_ON,
    SelectConfig,
    check_positive,
)


@dataclass(frozen=True)
class IndexConfig:
    """The chunk index (FAISS over the chunks' embeddings).

    kind: "flat" (exact), "ivf" (inverted lists over k-means cells: IVFFlat, 2 sqrt(N) cells),
    "hnsw" (a graph: HNSWFlat, 32 links), or "auto": flat below `approximate_from` chunks, IVF
    from there (chosen when the index is compacted). nprobe: IVF cells searched per query;
    ef_search: the HNSW search breadth. The index is saved as a base file plus append-only
    segments (one per ingest), and compacted into a new base once the segments hold
    `compact_share` of what the base holds, so an ingest writes its own vectors, not the index.
    """

    kind: str = "auto"
    approximate_from: int = 50_000
    nprobe: int = 48
    ef_search: int = 96
    compact_share: float = 0.25

    def __post_init__(self) -> None:
        if self.kind not in ("auto", "flat", "ivf", "hnsw"):
            raise ValueError(f"index kind must be 'auto', 'flat', 'ivf' or 'hnsw', got {self.kind!r}")
        for name in ("approximate_from", "nprobe", "ef_search"):
            check_positive(name, getattr(self, name))
        if not isinstance(self.compact_share, (int, float)) or not 0 < self.compact_share:
            raise ValueError(f"compact_share must be a positive share of the base index, got {self.compact_share!r}")


@dataclass(frozen=True)
class ChunkConfig:
    """Token-based chunking with the primary tokenizer (the paper uses 1000 / 50)."""

    chunk_tokens: int = 256
    overlap_tokens: int = 16

    def __post_init__(self) -> None:
        check_positive("chunk_tokens", self.chunk_tokens)
        if not isinstance(self.overlap_tokens, int) or not 0 <= self.overlap_tokens < self.chunk_tokens:
            raise ValueError(f"overlap_tokens must be in [0, chunk_tokens={self.chunk_tokens}), got {self.overlap_tokens!r}")


@dataclass(frozen=True)
class PromptConfig:
    """How a request is laid out as text.

    The shared prefix is the system prompt as each model's chat template renders it, up to
    where the user content begins; every chunk is prefilled after it. The question segment
    closes the user turn and opens the assistant turn.

    question_first: a template with '{question}' placed before the chunks as well (empty: off).
    It is computed fresh with each request, so the chunk rows a mode recomputes (and a full
    prefill) read the question before the passages; the reused rows were encoded without it.
    """

    system_prompt: str = (
        "You are a helpful assistant. Answer the question using only the provided context. "
        "Be brief."
    )
    separator: str = "\n\n"
    question_template: str = "\n\nQuestion: {question}\nAnswer briefly."
    question_first: str = ""

    def __post_init__(self) -> None:
        for name in ("question_template", *(("question_first",) if self.question_first else ())):
            if "{question}" not in getattr(self, name):
                raise ValueError(f"{name} must contain '{{question}}', got {getattr(self, name)!r}")


@dataclass(frozen=True)
class BaselineConfig:
    """Settings of the baseline modes (the papers' defaults)."""

    ape_temperature: float = 1.0
    ape_scale: float = 1.0
    """APE's T and S, at its reference code's defaults (its demo's --temperature/--scale). Tuned
    per model in the paper; on the default pair S < 1 collapses APE (T = S = 0.9: 21.9 on the 2K
    needle set where T = S = 1 scores 59.4 and reuse 62.5; `docs/benchmarks.md`)."""
    cacheblend_check_layer: int = 1
    """CacheBlend's deviation is zero at layer 0 (K/V depend on token and position only)."""
    cacheblend_on: str = "k"
    prophetkv_fuse: str = "mean"
    """How ProphetKV fuses its per-layer query attention (each normalised over the chunk tokens):
    "mean" or "max" over layers (the paper's abstract leaves it open; `selectors/prophetkv.py`)."""
    prophetkv_heads: str = "max"
    """How ProphetKV reduces each layer's attention over query heads (each head's averaged over
    the query rows first): "max" keeps a token that any one head reads strongly, "mean" dilutes
    it by the heads that do not (measured in `docs/notes/2026-12-03-benchmark-record.md`)."""

    def __post_init__(self) -> None:
        for name in ("ape_temperature", "ape_scale"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0.0 < value <= 10.0:
                raise ValueError(f"{name} must be a number in (0, 10], got {value!r}")
        if not isinstance(self.cacheblend_check_layer, int) or self.cacheblend_check_layer < 1:
            raise ValueError(f"cacheblend_check_layer must be an integer >= 1, got {self.cacheblend_check_layer!r}")
        if self.cacheblend_on not in ("k", "v"):
            raise ValueError(f"cacheblend_on must be 'k' or 'v', got {self.cacheblend_on!r}")
        for name in ("prophetkv_fuse", "prophetkv_heads"):
            if getattr(self, name) not in ("mean", "max"):
                raise ValueError(f"{name} must be 'mean' or 'max', got {getattr(self, name)!r}")


@dataclass(frozen=True)
class PipelineConfig:
    """Time-to-first-token machinery; neither switch changes any result.

    overlap_selection: run the aux selection on a worker thread while the primary caches load
    and assemble (True), or select first and load after (False). "auto" (the default) overlaps
    where the primary runs on another device than the aux (the paper's split: aux on the CPU,
    primary on a GPU) and selects first where both share the CPU: there the two compete for
    the same cores, the overlap hid 0-0.02 s of the selection and made it longer (2-core CPUs,
    docs/notes/2026-12-03-benchmark-record.md, "Selection before loading on a CPU").
    layerwise_loading: load and assemble layer l + 1 while layer l is recomputed.
    """

    overlap_selection: bool | str = "auto"
    layerwise_loading: bool = True

    def __post_init__(self) -> None:
        if not (isinstance(self.overlap_selection, bool) or self.overlap_selection == "auto"):
            raise ValueError(f"overlap_selection must be True, False or 'auto', got {self.overlap_selection!r}")
        if not isinstance(self.layerwise_loading, bool):
            raise ValueError(f"layerwise_loading must be True or False, got {self.layerwise_loading!r}")

    def overlaps(self, primary: torch.device, aux: torch.device) -> bool:
        """Whether the aux selection overlaps loading, for models on these devices."""
        if self.overlap_selection == "auto":
            return primary != aux
        return bool(self.overlap_selection)


@dataclass(frozen=True)
class StoreConfig:
    """The KV store: memory tier size (bytes) in front of the backend, how caches are kept, and
    how much the store may hold.

    kv_dtype: the dtype chunk caches are stored in. "auto" stores float32 models' caches in bf16
    and any other model's in its compute dtype: bf16 storage halves disk, memory tier and load
    time, and `bench fidelity` measured no loss from it (2K, default pair: KL to full attention
    0.0466 against 0.0468 for cacheclip@0.2, 0.2346 against 0.2364 for reuse, same samples);
    caches are upcast as they are assembled. "float32" keeps full precision. A storage dtype
    other than the compute dtype gets its own namespace, so precisions never mix.
    kv_codec: how each layer's K and V are kept (`storage/codecs/`): "bf16" as they are (in
    kv_dtype), "int8" (1.94x fewer bytes), "int4" (KIVI-style, 3.5x fewer), or "auto": the codec
    a model's caches already have in the store (a store written before codecs stays bf16 and is
    not re-encoded), else int8 (bf16 where kv_dtype names a precision: it is kept). A codec
    other than "bf16" gets its own namespace, so a namespace
    never mixes codecs and caches written with another stay readable by an engine that names it.
    Checked by name when the store opens.
    aux_depth: how many of the aux model's layers its chunk caches keep. "auto": up to the
    deepest layer any scoring profile of the pair reads (the engine config's score_layers, the
    store's or the shipped profiles); a request or calibration that reads deeper re-encodes the
    chunks it needs with the deeper layers. "all" keeps every layer.
    max_bytes: a bound on the bytes of chunk caches a folder store holds (None: unbounded). Past
    it the least recently used caches are dropped and rebuilt from their text when next used.
    It is recorded in the store, so every process that opens it keeps to it; a Redis store takes
    its bound in its URL (`?max_bytes=N`).
    """

    memory_bytes: int = 512 * 1024 * 1024
    kv_dtype: str = "auto"
    kv_codec: str = "auto"
    aux_depth: str = "auto"
    max_bytes: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.memory_bytes, int) or self.memory_bytes < 0:
            raise ValueError(f"memory_bytes must be a non-negative integer, got {self.memory_bytes!r}")
        if self.kv_dtype not in ("auto", *DTYPES):
            raise ValueError(f"kv_dtype must be 'auto' or one of {sorted(DTYPES)}, got {self.kv_dtype!r}")
        if not isinstance(self.kv_codec, str) or not self.kv_codec:
            raise ValueError(f"kv_codec must be 'auto' or a codec name such as 'bf16', 'int8' or 'int4', got "
                             f"{self.kv_codec!r}")
        if self.aux_depth not in ("auto", "all"):
            raise ValueError(f"aux_depth must be 'auto' or 'all', got {self.aux_depth!r}")
        if self.max_bytes is not None and (isinstance(self.max_bytes, bool) or not isinstance(self.max_bytes, int)
                                           or self.max_bytes <= 0):
            raise ValueError(f"max_bytes must be a positive number of bytes or None, got {self.max_bytes!r}")

    def storage_dtype(self, compute: torch.dtype) -> torch.dtype:
        """The dtype caches of a model computing in `compute` are stored in."""
        if self.kv_dtype == "auto":
            return torch.bfloat16 if compute == torch.float32 else compute
        return DTYPES[self.kv_dtype]


@dataclass(frozen=True)
class ModelConfig:
    """How models are loaded: compute dtype and the device of each role.

    dtype "auto" (the default) computes in bf16 where the device does it natively (CUDA, CPUs
    with AMX or AVX512-BF16) and in float32 elsewhere, decided once per model at load
    (`hardware.py`); the chosen dtype is part of each model's fingerprint, so caches never mix
    across dtypes. primary_device "auto" is the first CUDA GPU where there is one, else the CPU;
    the aux model stays on the CPU (the paper's hybrid placement: it selects while the GPU
    loads caches and recomputes). Any torch device string overrides either.
    """

    dtype: str = "auto"
    threads: int | None = None
    primary_device: str = "auto"
    aux_device: str = "cpu"
    primary_adapter: str | None = None
    """A LoRA folder from `cacheclip train lora`, or "shipped" (the package's LoRA for an embedded
    primary), merged into the primary at load (the tuned primary: its fingerprint, and so its
    store namespaces, include the adapter's hash)."""

    def __post_init__(self) -> None:
        if self.primary_adapter is not None and (not isinstance(self.primary_adapter, str) or not self.primary_adapter):
            raise ValueError(f"primary_adapter must be a path to a LoRA folder, 'shipped' or None, got {self.primary_adapter!r}")
        if self.dtype not in ("auto", *DTYPES):
            raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.threads is not None:
            check_positive("threads", self.threads)
        for name in ("primary_device", "aux_device"):
            value = getattr(self, name)
            if value != "auto":
                try:
                    torch.device(value)
                except (RuntimeError, TypeError) as err:
                    raise ValueError(f"{name} must be 'auto' or a torch device such as 'cpu' or 'cuda:0', got {value!r}") from err

    def device(self, role: str) -> torch.device:
        """The device of `role` ("primary" or "aux"), "auto" resolved; a CUDA device asked for on
        a machine without one is a ValueError."""
        if role not in ("primary", "aux"):
            raise ValueError(f"role must be 'primary' or 'aux', got {role!r}")
        return resolve_device(self.primary_device if role == "primary" else self.aux_device)

    def torch_dtype(self, flags: frozenset[str] | None = None, device: str | torch.device = "cpu") -> torch.dtype:
        """The compute dtype on `device` ("auto" resolved; flags: CPU flags to use instead of this machine's)."""
        return resolve_dtype(self.dtype, device, flags)


FULL_PREFILLS = ("auto", "model", "loop")


@dataclass(frozen=True)
class EngineConfig:
    """All engine settings; each part validates itself."""

    chunk: ChunkConfig = field(default_factory=ChunkConfig)
    select: SelectConfig = field(default_factory=SelectConfig)
    prompt: PromptConfig = field(default_factory=PromptConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    baselines: BaselineConfig = field(default_factory=BaselineConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    top_k: int = 4
    """Chunks retrieved per question when the caller gives no chunk ids."""
    embedder: str = "all-minilm-l6-v2"
    """Sentence-transformers model for the chunk index: the embedded default or a local folder."""
    index: IndexConfig = field(default_factory=IndexConfig)
    """The chunk index's kind (flat, IVF, HNSW, or by size) and search breadth."""
    attention_backend: str = "auto"
    """Recompute attention: "auto" (the Triton kernel on CUDA; elsewhere the blocked torch path:
    in bf16/fp16 plain blocks on CPUs with AMX, else matmul blocks; split blocks in float32),
    "torch" (the blocked torch path everywhere), "triton"."""
    packets: str | None = "auto"
    """KV Packet adapters for the packet modes: "auto" (the ones shipped for the primary, if
    any), a .safetensors file from `cacheclip train packet`, or None (packet modes off)."""
    full_prefill: str = "auto"
    """How the `full` mode (and any plan that reuses nothing) prefills: "model" (the model's own
    forward), "loop" (the recompute's layer loop over every row, the same arithmetic), "auto"
    (the loop where its attention is faster: half precision on a CPU without AMX, where matmul
    blocks beat the flash kernel transformers calls; else the model's forward)."""

    def __post_init__(self) -> None:
        check_positive("top_k", self.top_k)
        if self.full_prefill not in FULL_PREFILLS:
            raise ValueError(f"full_prefill must be one of {list(FULL_PREFILLS)}, got {self.full_prefill!r}")
        if self.packets is not None and (not isinstance(self.packets, str) or not self.packets):
            raise ValueError(f"packets must be 'auto', a path to an adapter file, or None, got {self.packets!r}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"attention_backend must be 'auto', 'torch' or 'triton', got {self.attention_backend!r}")


AUTO = "auto"
"""The recompute_ratio that lets the selector decide per request how much to recompute."""


def check_ratio(ratio: float | str) -> float | str:
    """Validate a recompute ratio at the public boundary: a number in [0, 1], or "auto"."""
    if ratio == AUTO:
        return AUTO
    if isinstance(ratio, bool):
        raise ValueError(f"recompute_ratio must be a number in [0, 1] or 'auto', got {ratio!r}")
    try:
        value = float(ratio)
    except (TypeError, ValueError):
        raise ValueError(f"recompute_ratio must be a number in [0, 1] or 'auto', got {ratio!r}") from None
    if not 0.0 <= value <= 1.0:  # also rejects NaN
        raise ValueError(f"recompute_ratio must be in [0, 1], got {ratio!r}")
    return value


def check_budget(budget: str) -> str:
    if budget not in BUDGETS:
        raise ValueError(f"budget must be one of {list(BUDGETS)}, got {budget!r}")
    return budget
