"""Offline: train the concatenation-aware LoRA of a primary with the shared teacher, data and fit loop.

The student is the plain block-diagonal form plus a full-attention term; `lora.py` saves, checks
and merges the result.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..config import PromptConfig
from ..corpus.packets import PacketAdapters
from ..models.loading import LoadedModel
from .traindata import ALL_KINDS
from .training import Example, Objective, TrainConfig, examples, fit, kl


@dataclass(frozen=True)
class LoraTrainConfig(TrainConfig):
    """`TrainConfig` for the concatenation-aware LoRA: rank and alpha of the LoRA layers;
    full_weight: the weight of the full-attention KL term (keeps ordinary answers unchanged).
    Trains on every request kind, short notes included."""

    rank: int = 8
    alpha: int = 16
    full_weight: float = 3.0
    lr: float = 3e-4
    kinds: tuple[str, ...] = ALL_KINDS

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.recompute:
            raise ValueError(f"recompute in the loop trains KV Packet adapters; the LoRA takes recompute=0, got "
                             f"{self.recompute!r}")
        for name in ("rank", "alpha"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.full_weight, (int, float)) or self.full_weight < 0:
            raise ValueError(f"full_weight must be a non-negative number, got {self.full_weight!r}")


def train_lora(lm: LoadedModel, cfg: LoraTrainConfig, prompt: PromptConfig | None = None,
               progress: Callable[[str], None] | None = None, teacher_progress: Callable[[str], None] | None = None):
    """Train a concatenation-aware LoRA on `lm`: the student reads the documents
    encoded apart (block-diagonal mask, no adapters) and, weighted by full_weight, the whole
    request under full attention; both match the frozen model's full-attention continuation.
    Held out: the block KL (`held_out_kl`), the full-attention KL (`held_out_full_kl`: how far
    ordinary answers moved) and their weighted sum (`held_out_loss`, the epoch criterion). Returns (the peft model with the best epoch's LoRA loaded, curve); `lora.save` writes it.
    progress and teacher_progress as for `train`."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    from ..models.lora import attach

    prefix_ids, train_set, held = examples(lm, cfg, prompt, teacher_progress)  # the teacher: the frozen base model
    peft_model = attach(lm, cfg.rank, cfg.alpha, seed=cfg.seed)
    params = [p for p in peft_model.parameters() if p.requires_grad]
    plain = PacketAdapters.initial(lm, 0, 0)

    def full_kl(ex: Example) -> torch.Tensor:
        seq = torch.cat([prefix_ids, *ex.docs, ex.tail]).to(lm.device)
        logits = lm.model(input_ids=seq[None], logits_to_keep=ex.teacher.shape[0]).logits[0].float()
        return torch.nn.functional.kl_div(logits.log_softmax(-1), ex.teacher.to(logits.device), log_target=True,
                                          reduction="batchmean")

    def loss(ex: Example) -> torch.Tensor:
        block = kl(lm, plain, prefix_ids, ex)
        return block + cfg.full_weight * full_kl(ex) if cfg.full_weight else block

    def measures(ex: Example) -> dict[str, float]:
        block, full = kl(lm, plain, prefix_ids, ex).item(), full_kl(ex).item()
        return {"held_out_kl": block, "held_out_full_kl": full, "held_out_loss": block + cfg.full_weight * full}

    objective = Objective(
        params=params, loss=loss, held=measures, criterion="held_out_loss",
        snapshot=lambda: {k: v.detach().clone() for k, v in get_peft_model_state_dict(peft_model).items()},
    )
    best, curve = fit(objective, train_set, held, cfg, progress)
    set_peft_model_state_dict(peft_model, best)
    return peft_model, curve
