"""Optimizer parameter groups and the learning-rate schedule."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from transformers import get_scheduler

from recipes import device
from recipes.config import ConfigError


def parameter_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Split parameters so that biases and normalisation weights are not decayed.

    Decaying LayerNorm gains and biases only shrinks them towards zero without regularising the
    model, which is why BERT's original recipe (and every Hugging Face example) excludes them.
    """
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if param.ndim < 2 or "norm" in name.lower() or name.endswith(".bias"):
            no_decay.append(param)
        else:
            decay.append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(
    make_optimizer: Callable[..., torch.optim.Optimizer],
    model: torch.nn.Module,
    target: torch.device | None = None,
) -> torch.optim.Optimizer:
    """Call the ``optimizer`` config's partial with decay / no-decay parameter groups.

    Adam / AdamW with ``fused: null`` (the default) use the fused kernel where the ``target``
    device has one, as ``transformers.Trainer`` does; ``fused: false`` keeps the foreach one.
    """
    keywords = dict(getattr(make_optimizer, "keywords", {}))
    weight_decay = keywords.get("weight_decay", 0.0)
    extra = {}
    if (
        getattr(make_optimizer, "func", None) in (torch.optim.AdamW, torch.optim.Adam)
        and keywords.get("fused") is None
        and target is not None
        and device.supports_fused_adamw(target)
    ):
        extra["fused"] = True
    return make_optimizer(params=parameter_groups(model, weight_decay), **extra)


def build_scheduler(
    optimizer: torch.optim.Optimizer,
    num_training_steps: int,
    name: str = "linear",
    warmup_ratio: float = 0.0,
    warmup_steps: int = 0,
    num_processes: int = 1,
) -> torch.optim.lr_scheduler.LRScheduler:
    """A transformers schedule by name, sized in optimizer steps.

    accelerate steps a prepared scheduler once per process on every optimizer step (so that a
    schedule written for one process stays right when batches are not split), hence the lengths
    are multiplied by ``num_processes`` here, once, instead of at every call site.
    """
    if not 0.0 <= warmup_ratio < 1.0:
        raise ConfigError(f"scheduler.warmup_ratio={warmup_ratio}: must be in [0, 1).")
    if warmup_steps < 0:
        raise ConfigError(f"scheduler.warmup_steps={warmup_steps}: must be >= 0.")
    warmup = warmup_steps or math.ceil(warmup_ratio * num_training_steps)
    try:
        return get_scheduler(
            name,
            optimizer=optimizer,
            num_warmup_steps=warmup * num_processes,
            num_training_steps=num_training_steps * num_processes,
        )
    except ValueError as err:
        raise ConfigError(f"scheduler.name={name!r}: {err}") from None
