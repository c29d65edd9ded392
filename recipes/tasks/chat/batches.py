"""Batches of chat rows: the length policy, packing, collators, padding-free rows and the
attention masks of packed rows, and the model's forward on them."""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from datasets import Dataset

from recipes.config import ConfigError
from recipes.losses import linear_ce
from recipes.tasks.chat.template import IGNORE_INDEX
from recipes.tasks.chat.token_loss import token_losses

# ------------------------------------------------------------------------- length policy


def fit_length(
    features: dict[str, list[int]], max_length: int, policy: str
) -> dict[str, list[int]] | None:
    """``features`` within ``max_length`` tokens: cut at the end (``truncate``) or None
    (``drop``). A cut conversation left without a labelled token is None as well."""
    if len(features["input_ids"]) <= max_length:
        return features
    if policy == "drop":
        return None
    cut = {k: v[:max_length] for k, v in features.items()}
    return cut if any(label != IGNORE_INDEX for label in cut["labels"]) else None


# ------------------------------------------------------------------------------- packing


def pack(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Indices grouped into rows of at most ``capacity`` tokens, best-fit decreasing (longest
    first, each into the fullest row it still fits); deterministic, ties in index order."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (tokens left, row), sorted
    for i in order:
        at = bisect_left(free, (lengths[i], -1))
        if at == len(free):
            rows.append([i])
            left, row = capacity - lengths[i], len(rows) - 1
        else:
            left, row = free.pop(at)
            rows[row].append(i)
            left -= lengths[i]
        if left > 0:
            insort(free, (left, row))
    return [sorted(row) for row in rows]


def packed_rows(features: Dataset, capacity: int) -> dict[str, list[list[int]]]:
    """Conversations concatenated into rows; ``position_ids`` restart at 0 at each one, which
    is how the attention mask finds where a conversation begins."""
    ids, labels = features["input_ids"], features["labels"]
    out: dict[str, list[list[int]]] = {"input_ids": [], "labels": [], "position_ids": []}
    for row in pack([len(x) for x in ids], capacity):
        out["input_ids"].append([t for i in row for t in ids[i]])
        out["labels"].append([t for i in row for t in labels[i]])
        out["position_ids"].append([p for i in row for p in range(len(ids[i]))])
    return out


class ChatCollator:
    """Pads a batch: ``input_ids`` with the pad token, ``labels`` with -100, ``position_ids``
    with 0 (packed rows) or an ``attention_mask`` of ones (unpacked)."""

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int | None = None) -> None:
        self.pad_token_id = pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of  # the loop sets trainer.pad_to_multiple_of

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        longest = padded_length(rows, self.pad_to_multiple_of)
        batch = {
            "input_ids": pad_rows(rows, "input_ids", self.pad_token_id, longest),
            "labels": pad_rows(rows, "labels", IGNORE_INDEX, longest),
        }
        if "position_ids" in rows[0]:
            batch["position_ids"] = pad_rows(rows, "position_ids", 0, longest)
        else:
            batch["attention_mask"] = attention_mask(rows, longest)
        return batch


def padded_length(rows: Sequence[Mapping[str, Any]], multiple: int | None) -> int:
    """The longest row's ``input_ids``, rounded up to a multiple of ``multiple`` (if set)."""
    longest = max(len(r["input_ids"]) for r in rows)
    return -(-longest // multiple) * multiple if multiple else longest


def pad_rows(rows: Sequence[Mapping[str, Any]], key: str, value: int, length: int) -> torch.Tensor:
    """Column ``key`` of ``rows`` padded with ``value`` to ``length``, as one tensor."""
    return torch.tensor([list(r[key]) + [value] * (length - len(r[key])) for r in rows])


def attention_mask(rows: Sequence[Mapping[str, Any]], length: int) -> torch.Tensor:
    """Ones over each row's ``input_ids``, zeros over the padding to ``length``."""
    return torch.tensor(
        [[1] * len(r["input_ids"]) + [0] * (length - len(r["input_ids"])) for r in rows]
    )


def flat_rows(
    sequences: Sequence[Mapping[str, Sequence[int]]],
    labels: Sequence[str],
    pad_token_id: int,
    multiple: int | None = None,
    prefix: str = "",
) -> dict[str, torch.Tensor]:
    """Sequences as one row without padding between them: the padding-free layout of TRL's
    ``padding_free`` and transformers' ``DataCollatorWithFlattening``, which a variable-length
    kernel reads as separate sequences from ``position_ids`` restarting at 0 (see
    :data:`POSITION_ID_ATTENTION`).

    Each of ``sequences`` holds ``input_ids``, its ``labels`` columns and its ``group`` (the
    term it belongs to: a pair, a row); the row is ``input_ids``, ``position_ids``, each label
    column and ``sequence`` (each token's group), all (1, tokens), keys ``prefix``-ed. A
    sequence's first token carries no label: the padded layout never scores a row's first token,
    and here the logits before it are the previous sequence's. With ``multiple`` the row ends
    in one padding sequence up to a multiple of it (fewer distinct shapes), unlabelled."""
    ids, positions, groups = [], [], []
    columns: dict[str, list[int]] = {key: [] for key in labels}
    for seq in sequences:
        length = len(seq["input_ids"])
        ids += seq["input_ids"]
        positions += range(length)
        groups += [seq["group"]] * length
        for key in labels:
            columns[key] += [IGNORE_INDEX, *seq[key][1:]][:length]
    total = len(ids)
    padding = (-(-total // multiple) * multiple - total) if multiple else 0
    ids += [pad_token_id] * padding
    positions += range(padding)
    groups += [0] * padding
    row = {"input_ids": ids, "position_ids": positions, "sequence": groups}
    row |= {key: column + [IGNORE_INDEX] * padding for key, column in columns.items()}
    return {f"{prefix}{key}": torch.tensor([values]) for key, values in row.items()}


# ------------------------------------------------------------------- block-diagonal masks

# Attention implementations that take the 4D mask built here (eager adds it to the scores, SDPA
# takes a boolean one), and those that find sequence starts in position_ids themselves
# (flash-attention's variable-length kernels).
MASKED_ATTENTION = ("eager", "sdpa")
POSITION_ID_ATTENTION = ("flash_attention_2", "flash_attention_3", "flash_attention_4")


# Attention functions registered with transformers' AttentionInterface that find sequence starts
# in position_ids as flash's do (a device's own variable-length kernel): add the name here.
VARLEN_ATTENTION: set[str] = set()


def reads_packed_positions(attn_implementation: str) -> bool:
    """Whether ``attn_implementation`` runs a row of sequences (``position_ids`` restarting at
    0, no mask) through a variable-length kernel: transformers' flash implementations, and the
    hub's flash kernels (``kernels-community/flash-attn2`` and the like), whose mask
    transformers also leaves to ``position_ids``, and those named in :data:`VARLEN_ATTENTION`.
    Exact and without padding there; anywhere else a row of sequences needs the dense
    block-diagonal mask (:func:`block_causal_mask`)."""
    name = attn_implementation or ""
    if name in POSITION_ID_ATTENTION or name in VARLEN_ATTENTION:
        return True
    return "/" in name and "flash" in name


def packing_unsupported_reason(attn_implementation: str) -> str | None:
    if attn_implementation in MASKED_ATTENTION or reads_packed_positions(attn_implementation):
        return None
    return (
        f"attention implementation {attn_implementation!r} takes neither a custom 4D mask nor "
        "sequence starts from position_ids"
    )


def block_causal_mask(
    position_ids: torch.Tensor, attn_implementation: str, dtype: torch.dtype
) -> torch.Tensor | None:
    """The (batch, 1, L, L) mask of packed rows: a token sees earlier tokens of its own
    conversation only. Boolean (True: attend) for SDPA, additive (0 / dtype min) for eager;
    None where the kernel reads position_ids itself. A padding position (position 0, alone in
    its "conversation") sees itself, so no row of the mask is empty."""
    if reads_packed_positions(attn_implementation):
        return None
    segment = (position_ids == 0).cumsum(dim=-1)
    length = position_ids.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=position_ids.device).tril()
    allowed = (segment[:, :, None] == segment[:, None, :]) & causal
    allowed = allowed[:, None]
    if attn_implementation == "sdpa":
        return allowed
    blocked = torch.zeros(allowed.shape, dtype=dtype, device=position_ids.device)
    return blocked.masked_fill(~allowed, torch.finfo(dtype).min)


# ------------------------------------------------------------------------------- forward


def attention_of(model: torch.nn.Module) -> str:
    """The attention implementation ``model`` was loaded with (under DDP's or FSDP's wrapper)."""
    inner = getattr(model, "module", model)
    config = getattr(inner, "config", None)
    return getattr(config, "_attn_implementation", None) or "eager"


def padding_free_setting(value: object) -> str:
    """``task.padding_free`` as auto, true or false (a YAML or command-line boolean
    reaches a string field as ``True`` / ``False``)."""
    return str(value).lower()


def flat_batches(setting: str, model: torch.nn.Module) -> bool:
    """Whether batches run padding-free (one row of sequences, no padding tokens) under
    ``task.padding_free=setting``: ``auto`` where the model's attention runs that row through a
    variable-length kernel (:func:`reads_packed_positions`), exact and without
    padding; ``true`` always (elsewhere under a dense block-diagonal mask: exact, not faster);
    ``false`` never."""
    setting = padding_free_setting(setting)
    if setting == "auto":
        return reads_packed_positions(attention_of(model))
    return setting == "true"


def choose_fused_loss(model: torch.nn.Module, setting: bool | None) -> str:
    """Decide ``trainer.fused_linear_loss`` for ``model`` (marked for :func:`forward`'s
    ``lazy_head``) and say what was decided, as a log line. null: on where the output layer
    does not train (LoRA), where the chunked loss and every gradient equal the unfused path's;
    true: also where it trains (its gradient then summed chunk by chunk: last-bit changes);
    false: off. True on a model the chunks cannot reproduce is refused (ConfigError)."""
    reason = linear_ce.unsupported_reason(model)
    if setting and reason:
        raise ConfigError(
            f"trainer.fused_linear_loss=true: {reason}; set trainer.fused_linear_loss=false"
        )
    head = getattr(model, "module", model).get_output_embeddings()
    trains = head is not None and any(p.requires_grad for p in head.parameters())
    on = reason is None and (setting or (setting is None and not trains))
    linear_ce.mark(model, on)
    if on:
        why = "its output layer trains, as asked" if trains else "its output layer is frozen"
        rows = linear_ce.chunk_rows(head.weight.shape[0])
        return (
            f"trainer.fused_linear_loss: on ({why}): the chat losses compute the logits a chunk "
            f"of {rows} tokens at a time"
        )
    if setting is False:
        return "trainer.fused_linear_loss=false: the losses read the model's full logits"
    why = reason or "its output layer trains; true computes it in chunks, with last-bit changes"
    return f"trainer.fused_linear_loss: off ({why})"


def forward(
    model: torch.nn.Module,
    batch: Mapping[str, torch.Tensor],
    attention: str | None = None,
    *,
    lazy_head: bool = False,
) -> Any:
    """The model on a batch without its labels or a KV cache. Packed rows (``position_ids``)
    get their block-diagonal mask, or under a variable-length kernel run as one row
    (:func:`padding_free`); ``attention``: the model's attention implementation (read from
    its config by default).

    ``lazy_head``: the caller passes the logits only to the chunked losses (:func:`token_losses`,
    :func:`sequence_losses`, :mod:`recipes.losses.linear_ce`); where the run computes them so
    (``trainer.fused_linear_loss``), ``logits`` is then a :class:`~recipes.losses.linear_ce.
    HeadInput` (the output layer's input) and the full logits are never built. The other
    outputs (``router_logits`` of a MoE model) are the model's own either way."""
    call = lambda: _forward(model, batch, attention)  # noqa: E731
    return lazy_forward(model, call, batch["input_ids"].shape) if lazy_head else call()


def lazy_forward(model: torch.nn.Module, call: Callable[[], Any], shape: torch.Size) -> Any:
    """``call()``, a forward of ``model`` on inputs of ``shape`` (rows, length), with its
    ``logits`` a :class:`~recipes.losses.linear_ce.HeadInput` of that shape where the run
    computes the losses a chunk at a time (``trainer.fused_linear_loss``): the output layer
    then runs on no position. Elsewhere the plain ``call()``."""
    if not linear_ce.enabled(model):
        return call()
    with linear_ce.CaptureHeadInput(model) as capture:
        out = call()
    project, vocab = linear_ce.output_head(model)
    hidden = capture.hidden.view(*shape, -1)  # a padding-free row: back to the batch's rows
    out.logits = linear_ce.HeadInput(hidden, capture.project(project), vocab)
    return out


def _forward(
    model: torch.nn.Module, batch: Mapping[str, torch.Tensor], attention: str | None
) -> Any:
    inputs = {k: v for k, v in batch.items() if k not in ("labels", "sequence")}
    if "position_ids" not in inputs:
        return model(**inputs, use_cache=False)
    attention = attention or attention_of(model)
    if reads_packed_positions(attention):
        rows, length = inputs["input_ids"].shape
        out = model(**padding_free(inputs), use_cache=False)
        if out.logits.shape[1]:  # not under linear_ce.CaptureHeadInput
            out.logits = out.logits.view(rows, length, -1)  # back to the batch's rows
        return out
    dtype = next(model.parameters()).dtype
    inputs["attention_mask"] = block_causal_mask(inputs["position_ids"], attention, dtype)
    return model(**inputs, use_cache=False)


def padding_free(inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Packed rows as the one row flash attention reads as packed, TRL's padding-free layout.

    Flash kernels get no mask: transformers finds where conversations start from
    ``position_ids`` restarting at 0, but only in a batch of one row (``_is_packed_sequence``);
    a (2, L) batch would read as two plain sequences, and attention would cross the
    dialogues packed in each. Row padding (position 0) becomes one-token sequences with no
    label; the logits are viewed back as rows, so the loss never pairs tokens of two rows."""
    return {k: v.reshape(1, -1) for k, v in inputs.items()}


def sequence_losses(
    logits: torch.Tensor, labels: torch.Tensor, sequence: torch.Tensor, groups: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`token_losses` of a padding-free row, (1, tokens), summed per group
    (``sequence``: each token's, of ``groups``) rather than per row: each group's summed
    next-token cross-entropy of its labelled tokens, and their count, (groups,) each."""
    return token_losses(logits, labels, groups=(sequence, groups))
