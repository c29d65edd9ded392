"""Mixture-of-experts models: the router's load-balancing loss, and where LoRA goes on them.

transformers adds ``router_aux_loss_coef x load_balancing_loss_func(router logits)`` to the
loss it computes itself (``outputs.loss`` with ``output_router_logits``). The chat tasks compute
their own loss (SFT's token loss, DPO, KTO, GRPO, GKD), so they add that term here, one call
each::

    with moe.router_loss(model) as router:
        ...  # the task's forward(s) and loss
    return router.added(SummedLoss(total, count))

:func:`router_loss` records the router logits of the forwards run with autograd inside it
(forward hooks on the routers the model names in ``_can_record_outputs``, the modules
transformers itself records them from), each with the 2-D attention mask of its forward, and
computes the term with the model's own ``load_balancing_loss_func``: the value transformers
gives. Hooks, not ``output_router_logits=True`` in the forward: with that flag transformers
computes the term itself from the forward's attention mask, and fails on the 4-D block mask of
packed rows (both transformers 4.57 and 5.x). On packed rows (no 2-D mask) every token counts,
as in transformers without a mask.

The term is on for a model with a router and ``router_aux_loss_coef > 0`` (its config's:
0.001 for Qwen3-30B-A3B); ``model.config_overrides.router_aux_loss_coef=0`` turns it off. Its
value (unscaled, transformers' ``outputs.aux_loss``) is logged as ``train/router_aux_loss``.
Evaluation scores the task's own loss, without it.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from recipes.log import get_logger
from recipes.tasks.base import LossShape, SummedLoss

log = get_logger(__name__)

STAT = "router_aux_loss"  # logged as train/router_aux_loss


def causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside accelerate's (DDP, compiled) and peft's wrappers."""
    from accelerate.utils import extract_model_from_parallel

    inner = extract_model_from_parallel(model)
    get_base = getattr(inner, "get_base_model", None)
    return get_base() if callable(get_base) else inner


def router_recorder(model: torch.nn.Module) -> tuple[type, int] | None:
    """The module class whose output holds the router logits, and their index in it, as the
    model declares them for transformers (``_can_record_outputs["router_logits"]``); None for
    a model without a router."""
    recorders = getattr(causal_lm(model), "_can_record_outputs", None) or {}
    found = recorders.get("router_logits")
    if found is None:
        return None
    if isinstance(found, type):
        return found, 0
    return found.target_class, found.index


def num_experts(model: torch.nn.Module) -> int:
    """The experts per MoE layer (the attribute transformers' MoE heads keep, or the config's
    ``num_experts`` / ``num_local_experts``); 0 for a dense model."""
    lm = causal_lm(model)
    if isinstance(getattr(lm, "num_experts", None), int):
        return lm.num_experts
    config = getattr(lm, "config", None)
    return int(getattr(config, "num_experts", 0) or getattr(config, "num_local_experts", 0) or 0)


def coefficient(model: torch.nn.Module) -> float:
    """``router_aux_loss_coef`` of the model (0 where it has none)."""
    lm = causal_lm(model)
    value = getattr(lm, "router_aux_loss_coef", None)
    if value is None:
        value = getattr(getattr(lm, "config", None), "router_aux_loss_coef", 0.0)
    return float(value or 0.0)


def routes(model: torch.nn.Module) -> bool:
    """Whether the model routes tokens to experts and its loss gets the balancing term."""
    return router_recorder(model) is not None and num_experts(model) > 0 and coefficient(model) > 0


def router_names(model: torch.nn.Module) -> list[str]:
    """Leaf names of the routers: the modules whose 2-D weight maps the hidden state to one
    logit per expert (``gate`` in Qwen-MoE and Mixtral, a Linear in transformers 4, a router
    module in 5). LoRA leaves them frozen: a low-rank update of the router shifts the load of
    every expert at once (Unsloth freezes it for that reason)."""
    experts, hidden = num_experts(model), getattr(causal_lm(model).config, "hidden_size", None)
    found = set()
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if (
            experts
            and isinstance(weight, torch.Tensor)
            and tuple(weight.shape) == (experts, hidden)
        ):
            found.add(name.rsplit(".", 1)[-1])
    return sorted(found)


def fused_expert_parameters(model: torch.nn.Module) -> list[str]:
    """Leaf names of the experts' stacked weights (3-D: experts x out x in, transformers 5's
    ``gate_up_proj`` / ``down_proj``), which peft adapts through ``target_parameters``; empty
    where the experts are Linear layers (transformers 4) or the model has none."""
    if not num_experts(model):
        return []
    return sorted({name.rsplit(".", 1)[-1] for name, p in model.named_parameters() if p.dim() == 3})


@dataclass
class RouterLoss:
    """The balancing term of the forwards run inside :func:`router_loss`."""

    coef: float = 0.0
    aux: torch.Tensor | None = None  # transformers' outputs.aux_loss (mean over the forwards)

    def added(self, loss: SummedLoss) -> SummedLoss:
        """``loss`` with ``coef x aux`` per term (so the step's mean gets ``coef x aux``, as
        transformers adds it to a mean loss) and ``aux`` per term as the logged stat; ``loss``
        itself where the model has no router or no forward ran with autograd."""
        if self.aux is None:
            return loss
        aux = self.aux.to(loss.total.device)
        count = loss.count.float()
        stats = {**loss.stats, STAT: aux.detach().float() * count}
        return dataclasses.replace(loss, total=loss.total + self.coef * aux * count, stats=stats)


@dataclass
class _Recording:
    """Router logits and the 2-D attention mask of each forward, in order."""

    forwards: list[tuple[torch.Tensor | None, list[torch.Tensor]]] = field(default_factory=list)


@contextmanager
def router_loss(model: torch.nn.Module) -> Iterator[RouterLoss]:
    """Record the router logits of the forwards with autograd run inside, and give their
    balancing term (:class:`RouterLoss`) once the block ends; nothing is recorded (and nothing
    added) for a model without a router. Forwards without autograd (a reference or teacher
    pass, generation) are left out."""
    result = RouterLoss()
    if not routes(model):
        yield result
        return
    lm = causal_lm(model)
    target, index = router_recorder(model)  # type: ignore[misc]
    recording = _Recording()

    def opened(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if torch.is_grad_enabled():
            mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
            two_d = isinstance(mask, torch.Tensor) and mask.dim() == 2
            recording.forwards.append((mask if two_d else None, []))

    def routed(module: torch.nn.Module, args: tuple, output: Any) -> None:
        if torch.is_grad_enabled() and recording.forwards:
            logits = output[index] if isinstance(output, (tuple, list)) else output
            recording.forwards[-1][1].append(logits)

    # On the model the task calls: peft calls the transformers model's forward directly.
    handles = [model.register_forward_pre_hook(opened, with_kwargs=True)]
    handles += [m.register_forward_hook(routed) for m in lm.modules() if isinstance(m, target)]
    try:
        yield result
    finally:
        for handle in handles:
            handle.remove()
    balancing = _balancing_loss(lm)
    terms = [balancing(tuple(logits), mask) for mask, logits in recording.forwards if logits]
    if terms:
        result.coef = coefficient(model)
        result.aux = torch.stack([torch.as_tensor(t).float() for t in terms]).mean()


def _balancing_loss(lm: torch.nn.Module) -> Callable[..., torch.Tensor]:
    """The model's own ``load_balancing_loss_func`` (its modeling module's), bound to its
    experts and top-k as its forward calls it."""
    func = sys.modules[type(lm).__module__].load_balancing_loss_func
    top_k = getattr(lm, "num_experts_per_tok", None) or lm.config.num_experts_per_tok
    experts = num_experts(lm)
    return lambda logits, mask: func(logits, experts, top_k, mask)


def with_router_stat(shape: LossShape, model: torch.nn.Module) -> LossShape:
    """``shape`` with :data:`STAT` among its logged stats where ``model`` routes and the task
    sums its loss (the chat tasks); the loop calls it once the model is loaded, and says so."""
    from recipes.tasks.base import Averaging

    if not routes(model) or STAT in shape.stats:
        return shape
    if shape.averaging != Averaging.sum:
        # The model's own loss (task=clm): transformers adds the term itself when the config
        # has output_router_logits=true.
        return shape
    log.info(
        "%s routes tokens to %d experts: the loss adds router_aux_loss_coef=%g x the router's "
        "load-balancing loss, as transformers does (logged as train/%s; "
        "model.config_overrides.router_aux_loss_coef=0 leaves it out)",
        type(causal_lm(model)).__name__,
        num_experts(model),
        coefficient(model),
        STAT,
    )
    return dataclasses.replace(shape, stats=(*shape.stats, STAT))
