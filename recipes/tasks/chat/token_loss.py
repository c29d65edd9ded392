"""Next-token cross-entropy of the labelled tokens without fp32 logits for every position.

Upcasting the whole ``(batch, length, vocab)`` logits tensor to fp32 before ``cross_entropy``
(what transformers' ``ForCausalLMLoss`` does) costs 4 bytes per position and vocabulary entry,
and autograd keeps the fp32 log-probabilities until backward: 4 GB per 8k-token sequence with
Llama-3's 128k vocabulary. Here only the labelled positions are picked, and each fp32 upcast
and softmax covers a bounded chunk of them, in forward and again in backward.
"""

from __future__ import annotations

import torch
from torch.autograd.function import FunctionCtx, once_differentiable

from recipes.losses import linear_ce
from recipes.losses.linear_ce import HeadInput
from recipes.tasks.chat.template import IGNORE_INDEX

# fp32 logits per chunk (64 MiB: 341 positions of a 49k vocabulary, 128 of a 128k one): the
# chunk's temporaries (its upcast, log-softmax or softmax, the cast back) stay small next to the
# logits, and on CPU they are large enough for glibc to map and unmap each one; 16 MiB chunks,
# kept on its heap once freed, raised the peak of a 4096-token step by 600 MB
# (scripts/throughput.py token-loss --block-size 4096 --chunk-elements 4194304).
CHUNK_ELEMENTS = 2**24


def token_losses(
    logits: torch.Tensor | HeadInput,
    labels: torch.Tensor,
    *,
    positions: torch.Tensor | None = None,
    groups: tuple[torch.Tensor, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: summed next-token cross-entropy of its labelled tokens, and their count (both
    fp32); the logits at position t predict the label at t + 1, labels -100 carry no loss.

    ``positions``: the sequence positions the logits were computed for (the model called with
    ``logits_to_keep=labelled_positions(labels)``), when they are not all of them.
    ``groups``: each token's group (the shape of ``labels``) and how many there are, to sum per
    group rather than per row (the sequences of a padding-free row); a label's group is its
    token's.

    ``logits`` may be a :class:`~recipes.losses.linear_ce.HeadInput` (the output layer's
    input): the labelled positions' logits are then computed a chunk at a time in forward and
    again in backward, and never all at once.
    """
    targets = labels[:, 1:] if positions is None else labels[:, positions + 1]
    labelled = targets != IGNORE_INDEX
    rows, columns = labelled.nonzero(as_tuple=True)
    index = rows * logits.shape[1] + columns
    if isinstance(logits, HeadInput):
        (nll,) = linear_ce.per_chunk(_chunk_nll, logits, logits.rows(index), targets[labelled])
    else:
        flat = logits.reshape(-1, logits.shape[-1])  # a view: a model's logits are contiguous
        nll = _LabelledCrossEntropy.apply(flat, index, targets[labelled])
    if groups is None:
        owner, size, counts = rows, len(labels), labelled.sum(dim=1).float()
    else:
        ids, size = groups
        owner = (ids[:, 1:] if positions is None else ids[:, positions + 1])[rows, columns]
        counts = torch.zeros(size, dtype=torch.float32, device=logits.device)
        counts = counts.index_add(0, owner, torch.ones_like(nll))
    sums = torch.zeros(size, dtype=torch.float32, device=logits.device)
    return sums.index_add(0, owner, nll), counts


def _chunk_nll(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor]:
    """One chunk's cross-entropy through the unfused path's own function (the same fp32 ops
    and the same gradient formula, so the fused loss equals it row for row)."""
    index = torch.arange(len(logits), device=logits.device)
    return (_LabelledCrossEntropy.apply(logits, index, targets),)


def labelled_positions(labels: torch.Tensor) -> torch.Tensor:
    """The sequence positions whose logits some row's loss needs (those followed by a label), to
    pass as ``logits_to_keep`` (a 1-D tensor: transformers >= 4.49, Llama-family models) and
    then as :func:`token_losses`' ``positions``: the logits of the other positions are never
    computed."""
    return (labels[:, 1:] != IGNORE_INDEX).any(dim=0).nonzero().squeeze(1)


class _LabelledCrossEntropy(torch.autograd.Function):
    """Cross-entropy of the rows ``index`` of 2-D logits against ``targets``, one fp32 value per
    row, computed in chunks of rows.

    Saved for backward: a copy of the selected rows in the logits' own dtype (bf16 logits stay
    bf16), the index and the targets. Not the fp32 upcast nor the log-probabilities, which
    autograd would keep for every position at once; and a copy rather than the logits
    themselves, so that the model's logits are freed once the loss is computed. With a share f
    of the positions labelled, the step holds at most (1 + f) logits tensors in their own dtype
    and one chunk's fp32 temporaries, where the full upcast holds about three in fp32. Backward
    recomputes each chunk's softmax in fp32 and writes ``(softmax - onehot) * grad`` into the
    rows of a zero gradient of the logits' shape and dtype.
    """

    @staticmethod
    def forward(
        ctx: FunctionCtx, logits: torch.Tensor, index: torch.Tensor, targets: torch.Tensor
    ) -> torch.Tensor:
        selected = logits.index_select(0, index)
        size = _chunk_rows(logits)
        nll = [
            torch.nn.functional.cross_entropy(part.float(), part_targets, reduction="none")
            for part, part_targets in zip(selected.split(size), targets.split(size), strict=True)
        ]
        ctx.save_for_backward(selected, index, targets)
        ctx.shape = logits.shape
        return torch.cat(nll)

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad_nll: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        selected, index, targets = ctx.saved_tensors
        grad = selected.new_zeros(ctx.shape)
        size = _chunk_rows(selected)
        for part, part_index, part_targets, part_grad in zip(
            selected.split(size),
            index.split(size),
            targets.split(size),
            grad_nll.split(size),
            strict=True,
        ):
            probs = torch.softmax(part.float(), dim=-1)
            probs[torch.arange(len(part), device=probs.device), part_targets] -= 1
            probs *= part_grad[:, None]
            grad.index_copy_(0, part_index, probs.to(grad.dtype))
        return grad, None, None


def _chunk_rows(logits: torch.Tensor) -> int:
    """Rows of ``logits`` per chunk: ``CHUNK_ELEMENTS`` logits, at least one row."""
    return max(1, CHUNK_ELEMENTS // logits.shape[-1])
