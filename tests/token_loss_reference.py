"""The SFT loss as recipes/tasks/sft.py computed it before recipes/tasks/chat/token_loss.py: the whole
logits tensor upcast to fp32 (as transformers' ``ForCausalLMLoss`` does), for the tests and the
benchmark to compare against."""

from __future__ import annotations

import torch


def reference_losses(
    logits: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: summed next-token cross-entropy of its labelled tokens, and their count."""
    shifted = labels[:, 1:]
    losses = torch.nn.functional.cross_entropy(
        logits[:, :-1].float().flatten(0, 1),
        shifted.flatten(),
        ignore_index=-100,
        reduction="none",
    ).view(shifted.shape)
    return losses.sum(dim=1), (shifted != -100).sum(dim=1).float()
