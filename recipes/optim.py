"""Optimizer parameter groups and the learning-rate schedule."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from transformers import get_scheduler

from recipes import device
from recipes.config import ConfigError, first_line
from recipes.log import get_logger

log = get_logger(__name__)


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

    AdamW with ``fused: null`` (the default) gets a fused kernel where ``target`` has one, as
    ``transformers.Trainer`` does: torch's on CUDA (and the CPU from torch 2.4); on MUSA
    torch_musa's ``FusedAdamW`` where its constructor takes the parameters where they are, else
    the foreach AdamW (torch's ``AdamW(fused=True)`` only when ``fused: true`` asks for it).
    ``fused: false`` keeps the foreach implementation. Whichever is built, checkpoints load into
    the others.
    """
    keywords = dict(getattr(make_optimizer, "keywords", {}))
    groups = parameter_groups(model, keywords.get("weight_decay", 0.0))
    func = getattr(make_optimizer, "func", None)
    fused = keywords.get("fused")
    if fused is False or target is None or func not in (torch.optim.AdamW, torch.optim.Adam):
        return _portable(make_optimizer(params=groups))
    if func is torch.optim.AdamW and target.type == device.MUSA:
        musa_fused = _musa_fused_adamw(groups, keywords)
        if musa_fused is not None:  # also for fused: true, which torch's AdamW may fail on MUSA
            return _portable(musa_fused)
    if fused:  # asked for explicitly: torch's own error if this torch cannot
        return _portable(make_optimizer(params=groups))
    params_on = next(model.parameters()).device
    extra = {"fused": True} if device.torch_fused_adamw_default(target, params_on) else {}
    return _portable(make_optimizer(params=groups, **extra))


def _musa_fused_adamw(groups: list[dict], keywords: dict) -> torch.optim.Optimizer | None:
    """torch_musa's ``FusedAdamW`` over ``groups``, or None where this release has none or its
    constructor refuses where the parameters are (CPU parameters up to v2.7.0: under FSDP the
    model is placed by the launcher, after the optimizer is built)."""
    fused_adamw = device.musa_fused_adamw()
    if fused_adamw is None:
        return None
    hyper = {k: v for k, v in keywords.items() if k not in ("fused", "foreach")}
    try:  # copies: Optimizer.__init__ writes its defaults (fused=True) into the groups it gets
        return fused_adamw([dict(group) for group in groups], **hyper)
    except RuntimeError as err:  # its device check: the foreach AdamW instead
        log.info("torch_musa's FusedAdamW not used: %s", first_line(err))
        return None


def _portable(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Let a checkpoint from another implementation (fused on one machine, foreach on another)
    load: the saved groups' ``fused`` / ``foreach`` flags would otherwise replace this
    optimizer's choice, and a fused flag fails on a device or torch without that kernel."""

    def keep_own_flags(optim: torch.optim.Optimizer, state: dict) -> dict:
        groups = []
        for saved, own in zip(state["param_groups"], optim.param_groups, strict=False):
            group = {k: v for k, v in saved.items() if k not in ("fused", "foreach")}
            group.update({k: own[k] for k in ("fused", "foreach") if k in own})
            groups.append(group)
        return {**state, "param_groups": groups}

    register = getattr(optimizer, "register_load_state_dict_pre_hook", None)  # torch >= 2.1
    if register is not None:
        register(keep_own_flags)
    return optimizer


def build_scheduler(
    optimizer: torch.optim.Optimizer,
    num_training_steps: int,
    *,
    name: str,
    warmup_ratio: float,
    warmup_steps: int,
    num_processes: int,
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
