"""What every generation engine shares (:mod:`recipes.generation`'s batched and continuous
ones, :mod:`recipes.vllm_engine`'s): the prompts cut to fit, each row's own sampling stream, the
model's stop tokens and sampling top-k, and every process's answers gathered in the prompts'
order. Both engines' modules import it; neither imports the other for it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from recipes.config import GenerationConfig

if TYPE_CHECKING:
    from accelerate import Accelerator

# transformers' sampling default for top_k when neither the call nor the model's
# generation_config sets it (GenerationConfig's documented default in 4.x and 5.x).
DEFAULT_TOP_K = 50


@dataclass
class Prompt:
    """One prompt ready to generate from: its place in the input, its token ids (cut to fit),
    and how many new tokens it may have."""

    index: int
    ids: list[int]
    max_new_tokens: int


def fit_prompts(
    prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int], max_length: int | None
) -> list[Prompt]:
    """Each prompt as a :class:`Prompt`: under ``max_length`` its end (with room for one new
    token) and an answer limit that fits; ``max_new_tokens``: one limit, or each prompt's."""
    rows = []
    for index, ids in enumerate(prompts):
        limit = max_new_tokens if isinstance(max_new_tokens, int) else max_new_tokens[index]
        ids = list(ids)
        if max_length is not None:
            ids = ids[-(max_length - 1) :]  # room for at least one new token
            limit = min(limit, max_length - len(ids))
        rows.append(Prompt(index, ids, limit))
    return rows


def gather_answers(
    done: list[tuple[int, list[int]]], rows: list[Prompt], accelerator: Accelerator | None
) -> list[list[int]]:
    """Every process's ``(index, answer)`` pairs, on every process, in the prompts' order."""
    if accelerator is not None and accelerator.num_processes > 1:
        from accelerate.utils import gather_object

        done = gather_object(done)
    by_index = dict(done)
    return [by_index[row.index] for row in rows]


def row_stream(seed: int, row: int) -> torch.Generator:
    """Row ``row``'s own sampling stream: a CPU generator seeded with ``seed + row``, the same
    whichever batch and process the row falls in."""
    return torch.Generator().manual_seed(seed + row)


def sampling_top_k(model: torch.nn.Module, generation: GenerationConfig) -> int:
    """Sampling's top-k: ``generation.top_k``, else the model's generation_config's, else
    transformers' default (0: off)."""
    if generation.top_k is not None:
        return generation.top_k
    top_k = getattr(model.generation_config, "top_k", None)
    return DEFAULT_TOP_K if top_k is None else top_k


def stop_ids(model: torch.nn.Module) -> list[int]:
    """The tokens that end a completion: the model's ``generation_config.eos_token_id``."""
    return _ids(getattr(model.generation_config, "eos_token_id", None))


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)
