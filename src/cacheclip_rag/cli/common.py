"""What every command shares: the model and store flags, building the engine from them, reading
document files, and printing timings."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path

from ..config import FULL_PREFILLS, ChunkConfig, EngineConfig, ModelConfig, PromptConfig, SelectConfig, StoreConfig
from ..engine import CacheClipEngine
from ..models.loading import DEFAULT_AUX, DEFAULT_PRIMARY
from ..paths import read_user_text
from ..request.options import RequestOptions
from ..storage.codecs import names as codec_names

log = logging.getLogger("cacheclip_rag")


def engine_from_args(args, chunk: ChunkConfig | None = None, prompt: PromptConfig | None = None):
    cfg = engine_config(args, chunk, prompt)
    log.info("loading %s (primary) and %s (aux)", args.primary, args.aux)
    return CacheClipEngine.from_pretrained(primary=args.primary, aux=args.aux, store_dir=args.store, config=cfg)


def engine_config(args, chunk: ChunkConfig | None = None, prompt: PromptConfig | None = None) -> EngineConfig:
    """The engine settings the common flags give (with a prompt other than the default's, as a
    QA bench sets its dataset's)."""
    layers = getattr(args, "score_layers", None)
    return EngineConfig(
        model=ModelConfig(dtype=getattr(args, "dtype", "auto"), primary_adapter=getattr(args, "primary_adapter", None)),
        store=StoreConfig(kv_dtype=getattr(args, "kv_dtype", "auto"), kv_codec=getattr(args, "kv_codec", None)
                          or StoreConfig().kv_codec, max_bytes=max_bytes_arg(args), **memory_arg(args)),
        chunk=chunk or ChunkConfig(),
        top_k=getattr(args, "k", None) or EngineConfig().top_k,
        select=SelectConfig(score_layers=tuple(layers) if layers else None),
        packets=packets_arg(getattr(args, "adapters", "auto")),
        prompt=prompt or PromptConfig(),
        full_prefill=getattr(args, "full_prefill", "auto"),
    )


def memory_arg(args) -> dict:
    """StoreConfig's memory tier size from --memory-mb, where a command has it."""
    mb = getattr(args, "memory_mb", None)
    return {} if mb is None else {"memory_bytes": int(mb * 1024 * 1024)}


def max_bytes_arg(args) -> int | None:
    """StoreConfig.max_bytes from --max-gb, where a command has it."""
    gb = getattr(args, "max_gb", None)
    return None if gb is None else int(gb * 2**30)


def packets_arg(value: str) -> str | None:
    return None if value == "none" else value


def read_documents(paths: list[str]) -> list:
    docs: list = []
    for name in paths:
        path = Path(name)
        text = read_user_text(path, "document file")
        if path.suffix == ".jsonl":
            for n, line in enumerate(text.splitlines(), 1):
                if line.strip():
                    try:
                        docs.append(json.loads(line))
                    except json.JSONDecodeError as err:
                        raise ValueError(f"{name}:{n} is not a JSON object ({err.msg})") from None
        else:
            docs.append({"text": text, "source": path.name})
    return docs


def fmt_timings(t: dict[str, float]) -> str:
    keys = ("selection", "load", "assemble", "recompute", "ttft", "total")
    return "  ".join(f"{k} {t.get(k, 0.0):.3f}s" for k in keys)


def add_common(p: argparse.ArgumentParser, store_default: str | None = "cacheclip-store") -> None:
    p.add_argument("--store", default=store_default, help="store directory (caches, texts, index)")
    p.add_argument("--primary", default=DEFAULT_PRIMARY, help="primary model: embedded name, folder or hub id")
    p.add_argument("--aux", default=DEFAULT_AUX, help="auxiliary (selector) model")
    add_dtype(p)
    p.add_argument("--kv-dtype", default="auto", choices=["auto", "bfloat16", "float32", "float16"],
                   help="storage dtype of the chunk caches (auto: bf16 for float32 models, else the compute dtype); "
                   "each has its own namespace")
    p.add_argument("--kv-codec", default=None, choices=["auto", *codec_names()],
                   help="how chunk caches are kept: auto (default: the codec the store already holds for the model, "
                   "else int8), bf16 as they are, int8 (1.94x fewer bytes), int4 (KIVI-style, 3.5x fewer); each has "
                   "its own namespace")
    p.add_argument("--max-gb", type=float, default=None,
                   help="bound the folder store's caches to this many GiB (recorded in the store): the least "
                   "recently used are dropped and rebuilt from their text when next used")
    p.add_argument("--primary-adapter", default=None, metavar="DIR",
                   help="a LoRA folder from `cacheclip train lora`, or 'shipped' (the package's), merged into the "
                   "primary (the tuned primary)")
    p.add_argument("--adapters", default="auto", metavar="FILE",
                   help="KV Packet adapters for the packet modes: auto (shipped for the primary), a .safetensors "
                   "file from `cacheclip train packet`, or none")
    p.add_argument("--full-prefill", default="auto", choices=list(FULL_PREFILLS),
                   help="how the full mode prefills: model (its own forward), loop (the recompute's layer loop over "
                   "every row), auto (the loop where its attention is faster: half precision on a CPU without AMX)")
    p.add_argument("-v", "--verbose", action="store_true")


def add_dtype(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32", "float16"],
                   help="compute dtype of both models; auto: bf16 where the hardware has it natively, else float32")


def add_request_options(p: argparse.ArgumentParser, modes: tuple[str, ...]) -> None:
    """A flag per `RequestOptions` field, with its default and help (the one declaration)."""
    for f in dataclasses.fields(RequestOptions):
        cli = dict(f.metadata["cli"])
        flags = cli.pop("flags", ("--" + f.name.replace("_", "-"),))
        if f.name == "mode":
            cli["choices"] = modes
        p.add_argument(*flags, dest=f.name, default=f.default, help=f.metadata["help"], **cli)


def request_options(args: argparse.Namespace) -> dict:
    """The `RequestOptions` given on the command line, by name."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(RequestOptions)}


def progress_bar(total: int, desc: str, unit: str):
    """A progress bar on stderr for a long job; the returned step(message) is called after each
    of its `total` units (the bar closes itself after the last; `step.close()` closes it when the
    job ends sooner, at a time bound)."""
    from tqdm import tqdm

    bar = tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True)

    def step(message: str) -> None:
        bar.set_postfix_str(message)
        bar.update(1)
        if bar.n >= total:
            bar.close()

    step.close = bar.close
    return step
