"""Losses of a causal LM's output layer computed a chunk of tokens at a time from the hidden
states, so that the (tokens x vocabulary) logits never exist at once (the fused linear
cross-entropy of Liger, Apple's Cut Cross-Entropy and TRL's fused LM head).

Written in torch because no library runs on every device the project supports: Liger's and Cut
Cross-Entropy's kernels are Triton (no CPU, none on the MUSA images' torch 2.2-2.7), and TRL's
``ChunkedLogProbFunction`` (a torch fallback off CUDA) needs Python >= 3.11 and torch >= 2.4
where the project accepts 3.10 and 2.2, and folds each vocabulary tile into an online
log-sum-exp, which changes the loss in its last bits. Here each chunk of rows goes through the
model's own output layer (whatever it is: tied, LoRA-wrapped, biased) and the same fp32 ops as
the unfused path, under :func:`torch.utils.checkpoint.checkpoint`: forward keeps no logits,
backward recomputes one chunk's logits at a time. The price is a second projection of the
labelled rows in backward (about a third more of the output layer's time).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

# fp32 logits per chunk, as recipes.tasks.chat.token_loss: 2**24 (64 MiB) is 110 rows of
# Qwen3's 151,936-entry vocabulary; the chunk's bf16 logits, fp32 upcast and log-softmax are
# then ~200 MiB whatever the sequence length.
CHUNK_ELEMENTS = 2**24

# Config fields that scale the logits after the output layer (Cohere, Granite, Falcon-H1, ...):
# a model that has one is left on the unfused path, whose forward applies them.
SCALING_FIELDS = ("logit_scale", "logits_scaling", "output_multiplier", "lm_head_multiplier")


@dataclass
class HeadInput:
    """The output layer's input in place of the logits: ``hidden`` (rows, length, width) and
    ``project`` (hidden rows to their logits), with the ``vocab`` size the chunks are cut by."""

    hidden: torch.Tensor
    project: Callable[[torch.Tensor], torch.Tensor]
    vocab: int

    @property
    def shape(self) -> torch.Size:
        """The shape the logits would have."""
        return torch.Size((*self.hidden.shape[:-1], self.vocab))

    @property
    def device(self) -> torch.device:
        return self.hidden.device

    def view(self, *shape: int) -> HeadInput:
        """The rows viewed as ``shape`` (its last entry, the vocabulary's, is ignored)."""
        hidden = self.hidden.view(*shape[:-1], self.hidden.shape[-1])
        return HeadInput(hidden, self.project, self.vocab)

    def __getitem__(self, index: Any) -> HeadInput:
        """The hidden states of the rows and positions ``index`` picks (not the vocabulary)."""
        return HeadInput(self.hidden[index], self.project, self.vocab)

    def rows(self, index: torch.Tensor | None = None) -> torch.Tensor:
        """The hidden states flattened to (tokens, width), the rows ``index`` (of the flat
        positions) only when given."""
        flat = self.hidden.reshape(-1, self.hidden.shape[-1])
        return flat if index is None else flat.index_select(0, index)


def chunk_rows(vocab: int) -> int:
    """Rows per chunk: ``CHUNK_ELEMENTS`` logits, at least one row."""
    return max(1, CHUNK_ELEMENTS // vocab)


def per_chunk(
    fn: Callable[..., tuple[torch.Tensor, ...]],
    head: HeadInput,
    hidden: torch.Tensor,
    *per_row: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """``fn(logits, *rows)`` for each chunk of rows of ``hidden`` (tokens, width), with the
    chunk's logits ``head.project(chunk)`` and the same rows of each of ``per_row`` (first
    dimension: tokens); its outputs (one value per row each) concatenated. Under autograd each
    chunk is checkpointed: only its inputs are kept, and backward recomputes its logits, one
    chunk at a time (the chunks' backward runs in reverse order of their forward)."""
    size = chunk_rows(head.vocab)
    track = torch.is_grad_enabled() and hidden.requires_grad

    def chunk(part: torch.Tensor, *rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(fn(head.project(part), *rows))

    outs = []
    for part, *rows in zip(hidden.split(size), *(r.split(size) for r in per_row), strict=True):
        if track:
            # preserve_rng_state: an output layer draws no random numbers.
            outs.append(
                checkpoint(chunk, part, *rows, use_reentrant=False, preserve_rng_state=False)
            )
        else:
            outs.append(chunk(part, *rows))
    if not outs:  # no row: empty outputs of the right count, still attached to the graph
        empty = fn(head.project(hidden[:0]), *(r[:0] for r in per_row))
        return tuple(empty)
    return tuple(torch.cat(parts) for parts in zip(*outs, strict=True))


def output_head(
    model: torch.nn.Module,
) -> tuple[Callable[[torch.Tensor], torch.Tensor], int] | None:
    """The function from the final hidden states to the logits of a causal LM (its output
    layer and, where the config has it, Gemma's logit soft-capping), and the vocabulary size;
    None where the model scales its logits in a way not repeated here (:data:`SCALING_FIELDS`)
    or has no output layer."""
    inner = getattr(model, "module", model)  # DDP's wrapper
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    config = getattr(inner, "config", None)
    if head is None or config is None:
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if any(getattr(text, name, None) not in (None, 1, 1.0) for name in SCALING_FIELDS):
        return None
    weight = getattr(head, "weight", None)
    if weight is None or weight.dim() != 2:
        return None
    softcap = getattr(text, "final_logit_softcapping", None)
    if not softcap:
        return head, weight.shape[0]

    def capped(hidden: torch.Tensor) -> torch.Tensor:
        # As Gemma's forward: logits / cap, tanh, * cap.
        return torch.tanh(head(hidden) / softcap) * softcap

    return capped, weight.shape[0]


class CaptureHeadInput:
    """A context in which the model's output layer runs on no positions and keeps its input
    (``hidden``, from the last call): the model's forward then costs its hidden states only,
    and its logits come out with length 0 (its own post-processing, a soft-cap, passes them
    through). The layer still runs, so the hooks of FSDP and peft around it stay balanced."""

    def __init__(self, model: torch.nn.Module) -> None:
        inner = getattr(model, "module", model)  # DDP's wrapper
        self.layer = inner.get_output_embeddings()
        self.hidden: torch.Tensor | None = None
        self.handle: Any = None

    def _pre_hook(self, module: torch.nn.Module, args: tuple) -> tuple:
        self.hidden = args[0]
        self.autocast = autocast_state(args[0].device.type)
        return (args[0][..., :0, :], *args[1:])

    def project(
        self, project: Callable[[torch.Tensor], torch.Tensor]
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        """``project`` under the autocast the model's forward ran in (accelerate wraps the
        forward, not the loss): the chunks' logits in the dtype the full logits would have."""
        kind = self.hidden.device.type
        enabled, dtype = self.autocast

        def cast(hidden: torch.Tensor) -> torch.Tensor:
            with torch.autocast(kind, dtype=dtype, enabled=enabled):
                return project(hidden)

        return cast

    def __enter__(self) -> CaptureHeadInput:
        self.handle = self.layer.register_forward_pre_hook(self._pre_hook)
        return self

    def __exit__(self, *exc: object) -> None:
        self.handle.remove()


def autocast_state(kind: str) -> tuple[bool, torch.dtype]:
    """Whether autocast is on for device type ``kind`` here, and its dtype."""
    try:
        return torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)
    except (TypeError, AttributeError):  # torch < 2.4: per-device-type functions
        if kind == "cpu":
            return torch.is_autocast_cpu_enabled(), torch.get_autocast_cpu_dtype()
        return torch.is_autocast_enabled(), torch.get_autocast_gpu_dtype()


# Where the run's decision (trainer.fused_linear_loss) is kept: an attribute of the model (the
# transformers model; peft's and DDP's wrappers read through to it).
_FUSED = "_recipes_fused_linear_loss"


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why ``model``'s logits cannot be computed a chunk at a time here, or None."""
    inner = getattr(model, "module", model)
    if not hasattr(inner, "get_output_embeddings") or inner.get_output_embeddings() is None:
        return "the model has no output layer (get_output_embeddings() is None)"
    if output_head(model) is None:
        return (
            "the model scales its logits after the output layer ("
            + ", ".join(SCALING_FIELDS)
            + "), which only its own forward applies"
        )
    return None


def mark(model: torch.nn.Module, enabled: bool) -> None:
    """Record whether the chat tasks compute ``model``'s losses from its hidden states."""
    setattr(getattr(model, "module", model), _FUSED, enabled)


def enabled(model: torch.nn.Module) -> bool:
    """Whether ``model`` was marked for the chunked losses (:func:`mark`)."""
    return bool(getattr(getattr(model, "module", model), _FUSED, False))
