"""Offline: train KV Packet adapters for a primary model by self-distillation.

Teacher: the frozen model's own greedy continuation G of [prefix, D_1..D_M, Q] under full
attention, and its log-probabilities over G. Student: the same request with every document a
packet (`packets.student_logits`, the parallel form). Loss: KL(teacher || student) on G's rows;
only the adapters get gradients. Training requests are generated (`traindata`: needle haystacks,
two-hop facts, plain prose, in turn) with seeds disjoint from every evaluation and calibration
seed (TRAIN_SEED_BASE and up). Updates average `batch` requests (gradient accumulation) with
Adam and a linear learning-rate decay; the epoch with the lowest held-out KL is kept (the paper
selects its epoch on a disjoint set too). PacketAdapters are saved as safetensors with the model
fingerprint, their shape and sha256; loading (`packets.load_adapters`) checks all three.

`train_lora` trains the concatenation-aware LoRA with the same teacher, data and fit
loop: the student is the plain block-diagonal form plus a full-attention term (`lora.py` saves,
checks and merges it).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..config import PromptConfig
from ..corpus.packets import ADAPTER_KIND, PacketAdapters
from ..models.loading import LoadedModel
from .training import Objective, TrainConfig, examples, fit, kl

log = logging.getLogger(__name__)


def train(lm: LoadedModel, cfg: TrainConfig, prompt: PromptConfig | None = None,
          progress: Callable[[str], None] | None = None,
          teacher_progress: Callable[[str], None] | None = None, *, engine=None,
          init: PacketAdapters | None = None) -> tuple[PacketAdapters, list[dict]]:
    """Train KV Packet adapters for `lm`; returns them and the per-epoch curve (train loss, held-out
    KL). progress: called per training step; teacher_progress: per example the teacher makes.
    engine: makes the requests as it serves them (needed for cfg.recompute > 0: its aux model
    selects; its primary must be `lm`). init: start from these adapters (e.g. the shipped ones),
    their shape overriding cfg.n_header / n_trailer."""
    if cfg.recompute and engine is None:
        raise ValueError("recompute in the loop needs an engine to select the rows (its aux model and profile)")
    if engine is not None and engine.primary.lm is not lm:
        raise ValueError("the engine's primary model must be the model trained for")
    prefix_ids, train_set, held = examples(lm, cfg, prompt, teacher_progress, engine=engine)
    for p in lm.model.parameters():
        p.requires_grad_(False)
    if init is not None:
        adapters = PacketAdapters(init.header.detach().clone().float(), init.trailer.detach().clone().float())
    else:
        adapters = PacketAdapters.initial(lm, cfg.n_header, cfg.n_trailer, seed=cfg.seed)
    adapters.header.requires_grad_(True)
    adapters.trailer.requires_grad_(True)
    objective = Objective(
        params=[adapters.header, adapters.trailer],
        loss=lambda ex: kl(lm, adapters, prefix_ids, ex),
        held=lambda ex: {"held_out_kl": kl(lm, adapters, prefix_ids, ex).item()},
        snapshot=lambda: PacketAdapters(adapters.header.detach().clone(), adapters.trailer.detach().clone()),
    )
    return fit(objective, train_set, held, cfg, progress)


def save_adapters(path: str | Path, adapters: PacketAdapters, lm: LoadedModel, cfg: TrainConfig, curve: list[dict]) -> str:
    """Write the adapters as safetensors with what loading checks; returns their sha256 (the pin)."""
    tensors = {"header": adapters.header.to(torch.float32).contiguous(), "trailer": adapters.trailer.to(torch.float32).contiguous()}
    meta = {"kind": ADAPTER_KIND, "model": lm.name, "fingerprint": lm.fingerprint,
            "hidden_size": str(lm.config.hidden_size), "sha256": adapters.digest(),
            "train_config": json.dumps(asdict(cfg)), "curve": json.dumps(curve)}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    save_file(tensors, str(tmp), metadata=meta)
    tmp.replace(path)
    return meta["sha256"]


