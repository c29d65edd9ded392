"""Batched generation: the one path that turns prompts into completions.

It serves ``mode=predict`` of the language-model tasks, SFT's and DPO's answers after training,
``python -m recipes.chat`` and the sequence-to-sequence evaluation (through :func:`generate`).

- **Batches.** Prompts are sorted by length (longest first, so a batch that does not fit shows at
  once) and cut into batches of ``generation.batch_size``; decoder-only models get them padded on
  the left, with the attention mask, so every row's next token sits in the last column. One
  ``model.generate`` call per batch, with its KV cache; each row stops at its own stop token (the
  model's ``generation_config.eos_token_id``, which holds the chat template's end of turn) and at
  its own length limit. Completions come back in the prompts' order.
- **Processes.** The batches are dealt out in turn, so each process generates its share, and the
  texts are gathered on every process. A sharded (FSDP) model steps every process together
  (``synced_gpus``): each process runs as many batches as the busiest one.
- **Sampling** (``generation.do_sample=true``) draws row ``i``'s tokens from its own random stream,
  seeded with ``seed + i``, on the CPU. transformers' ``generate`` draws from the one global
  stream, so the tokens a row gets would depend on which rows share its batch, on the batch size
  and on the number of processes; here they depend on none of them, and a row sampled in a batch
  equals the row sampled alone. The sampling itself is transformers' own warpers (temperature,
  then the model's ``top_k`` (50 when unset), then ``top_p``), in transformers' order.

Greedy answers equal one-prompt-at-a-time generation token for token in fp32
(``tests/test_generation.py``); in bf16 the padded batch may round differently, as with any batched
decoding.

**Engines** (``generation.engine``). ``batched`` is the above. ``continuous`` hands the rows to
transformers' continuous batching (``init_continuous_batching``: a paged KV cache, sized here to
the call; requests scheduled token by token, a finished row's room refilled at once, no padding),
one request per row with its own length limit and the model's stop tokens; sampling goes through
:class:`RowSlots`, which gives each request's row its own stream as above, so the tokens depend
on the seed and the row only. Where it cannot serve (an encoder-decoder model, beam search, a
sharded model, an attention that cannot read a paged cache, transformers without it) the batched
engine answers, with one log line. ``vllm`` is :mod:`recipes.vllm_engine`'s.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
from collections.abc import Sequence
from dataclasses import fields, replace
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from transformers import PreTrainedTokenizerBase
from transformers.generation.logits_process import (
    LogitsProcessor,
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from recipes.config import ConfigError, GenerationConfig
from recipes.generation_rows import (
    Prompt,
    fit_prompts,
    gather_answers,
    row_stream,
    sampling_top_k,
    stop_ids,
)
from recipes.log import get_logger

try:  # transformers' continuous batching with per-request logits processors (5.x)
    from transformers.generation.continuous_batching.cb_logits_processors import (
        ContinuousBatchingLogitsProcessor,
    )
except ImportError:  # older transformers: generation.engine=continuous falls back to batched
    ContinuousBatchingLogitsProcessor = None

if TYPE_CHECKING:
    from accelerate import Accelerator

log = get_logger(__name__)
_FALLBACKS_LOGGED: set[str] = set()  # one line per reason and run


# The most tokens one continuous-batching forward pass takes (transformers' own default).
DEFAULT_MAX_BATCH_TOKENS = 8192


def complete(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    tokenizer: PreTrainedTokenizerBase,
    generation: GenerationConfig,
    max_new_tokens: int,
    **options: Any,
) -> list[str]:
    """The completion of each prompt (token ids), decoded without special tokens: the texts of
    :func:`complete_ids` (which takes the same arguments)."""
    return [
        tokenizer.decode(new, skip_special_tokens=True)
        for new in complete_ids(model, prompts, tokenizer, generation, max_new_tokens, **options)
    ]


def on_engine(settings: GenerationConfig, run: GenerationConfig) -> GenerationConfig:
    """``settings`` (a task's own sampling, or greedy answers) served by the run's engine:
    ``generation.engine`` and its server's settings (``generation.vllm_*``) carried over."""
    served = {
        f.name: getattr(run, f.name)
        for f in fields(run)
        if f.name == "engine" or f.name.startswith("vllm_")
    }
    return replace(settings, **served)


def complete_ids(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    tokenizer: PreTrainedTokenizerBase,
    generation: GenerationConfig,
    max_new_tokens: int | Sequence[int],
    *,
    max_length: int | None = None,
    accelerator: Accelerator | None = None,
    seed: int | None = None,
    streams: Sequence[torch.Generator] | None = None,
) -> list[list[int]]:
    """The new token ids of each prompt (token ids), greedy or sampled as ``generation`` says,
    in the prompts' order, up to and with the first stop token; ``max_new_tokens``: one limit
    for all, or each prompt's own.

    ``model`` is the model as prepared (for FSDP) or plain; ``accelerator``: share the prompts
    between its processes (None: this process generates them all). ``max_length`` caps prompt +
    answer of a decoder-only model (the length it trained on): a longer prompt keeps its end.
    ``seed``: the sampled rows' base seed (None: the run's, ``torch.initial_seed()``);
    ``streams``: each prompt's own CPU generator instead (a conversation that goes on drawing
    from one: a row draws once per token it keeps, never past its stop token or its limit)."""
    unwrapped = accelerator.unwrap_model(model) if accelerator else model
    _check_decoding(unwrapped, tokenizer, generation)
    if generation.engine == "vllm":
        from recipes import vllm_engine

        # The policy as it is now, before it generates (TRL's GRPO pushes before each
        # generation too): its adapter (nothing when the server has it) or its weights.
        if accelerator is None or accelerator.is_main_process:
            vllm_engine.push_weights(model, generation, accelerator)
        if accelerator is not None:
            accelerator.wait_for_everyone()
        return vllm_engine.complete_ids(
            model, prompts, tokenizer, generation, max_new_tokens, max_length=max_length,
            accelerator=accelerator, seed=seed, streams=streams,
        )  # fmt: skip
    if getattr(unwrapped.config, "is_encoder_decoder", False):
        max_length = None  # the source is the encoder's: no shared length with the answer
    rows = fit_prompts(prompts, max_new_tokens, max_length)
    if not rows:
        return []
    base_seed = torch.initial_seed() if seed is None else seed
    if generation.engine == "continuous":
        reason = _not_continuous(unwrapped, generation, accelerator)
        if reason is None:
            return _continuous_ids(unwrapped, rows, generation, accelerator, base_seed, streams)
        if reason not in _FALLBACKS_LOGGED:
            _FALLBACKS_LOGGED.add(reason)
            log.info("generation.engine=continuous: %s, so the batched engine generates", reason)
    return _batched_ids(
        model, unwrapped, rows, tokenizer, generation, accelerator, max_length, base_seed, streams
    )


def _batched_ids(
    model: torch.nn.Module,
    unwrapped: torch.nn.Module,
    rows: list[Prompt],
    tokenizer: PreTrainedTokenizerBase,
    generation: GenerationConfig,
    accelerator: Accelerator | None,
    max_length: int | None,
    base_seed: int,
    streams: Sequence[torch.Generator] | None,
) -> list[list[int]]:
    """The batched engine: length-sorted, left-padded batches through ``model.generate``."""
    order = sorted(rows, key=lambda row: (-len(row.ids), row.index))
    batches = _batches(order, max(1, generation.batch_size), max_length)
    rank, world = (accelerator.process_index, accelerator.num_processes) if accelerator else (0, 1)
    sharded = accelerator is not None and _sharded(accelerator)
    mine = batches[rank::world]
    steps = len(batches[0::world]) if sharded else len(mine)  # the busiest process's count
    device = accelerator.device if accelerator else _device(unwrapped)
    was_training = unwrapped.training
    unwrapped.eval()
    done: list[tuple[int, list[int]]] = []
    with whole_root(model, unwrapped) if sharded else contextlib.nullcontext():
        for step in range(steps):
            # A sharded model's processes run the same number of generate calls: one with
            # fewer batches repeats its last, and drops what it gives.
            batch = mine[min(step, len(mine) - 1)] if mine else batches[0]
            new = _generate_batch(
                unwrapped,
                batch,
                tokenizer,
                generation,
                device,
                synced=sharded,
                streams=[
                    streams[row.index] if streams else row_stream(base_seed, row.index)
                    for row in batch
                ],
            )
            if step < len(mine):
                done.extend(zip((row.index for row in batch), new, strict=True))
    unwrapped.train(was_training)
    return gather_answers(done, rows, accelerator)


def _not_continuous(
    model: torch.nn.Module, generation: GenerationConfig, accelerator: Accelerator | None
) -> str | None:
    """Why transformers' continuous batching cannot serve this call (None: it can)."""
    import transformers

    beams = generation.num_beams or getattr(model.generation_config, "num_beams", 1) or 1
    if getattr(model.config, "is_encoder_decoder", False):
        return "an encoder-decoder model pages no KV cache"
    if beams > 1:
        return f"beam search ({beams} beams) is not continuous batching's"
    if ContinuousBatchingLogitsProcessor is None or not hasattr(model, "init_continuous_batching"):
        return (
            f"transformers {transformers.__version__} has no continuous batching with "
            "per-request logits processors (5.x has)"
        )
    sharded = any("FSDP" in type(m).__name__ or "FullyShardedDataParallel" in type(m).__name__
                  for m in model.modules())  # fmt: skip
    if sharded or (accelerator is not None and _sharded(accelerator)):
        return "a sharded (FSDP) model cannot be paged by one process"
    attention = str(getattr(model.config, "_attn_implementation", None))
    if attention not in ("sdpa", "eager", "paged|eager", "paged|sdpa") and "flash" not in attention:
        return f"attention {attention} cannot read a paged cache (sdpa, eager and flash can)"
    return None


@torch.no_grad()
def _continuous_ids(
    model: torch.nn.Module,
    rows: list[Prompt],
    generation: GenerationConfig,
    accelerator: Accelerator | None,
    base_seed: int,
    streams: Sequence[torch.Generator] | None,
) -> list[list[int]]:
    """``rows`` through transformers' continuous batching (``init_continuous_batching``: one
    manager per call, its paged KV cache sized to the call's prompts): each process serves
    its share of the rows, one request each, with its own length limit and the model's stop
    tokens. Greedy takes the argmax; sampling draws each row from its own stream, as the
    batched engine does (:class:`RowSlots`)."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    rank, world = (accelerator.process_index, accelerator.num_processes) if accelerator else (0, 1)
    mine = rows[rank::world]
    stops = stop_ids(model)
    done: list[tuple[int, list[int]]] = []
    if not mine:
        return gather_answers(done, rows, accelerator)
    config = copy.deepcopy(model.generation_config)
    config.do_sample, config.num_beams = False, 1  # sampling is RowSlots'
    config.max_new_tokens = max(row.max_new_tokens for row in mine)
    config.eos_token_id = stops or -1
    hints = WorkloadHints(
        max_prompt_length=max(len(row.ids) for row in mine),
        max_generated_length=config.max_new_tokens,
        num_requests=len(mine),
    )
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.WARNING)  # per-call chatter
    was_training = model.training
    # Its batch processor reseeds torch's global generators (transformers' distributed.py,
    # set_tp_seed): the run's own streams (dropout, shuffling) go on as if it had not run.
    with torch.random.fork_rng(
        devices=[] if model.device.type == "cpu" else [model.device],
        device_type=model.device.type,
    ):
        settings = ContinuousBatchingConfig(**paging(mine))
        manager = model.init_continuous_batching(config, settings, hints)
        if generation.do_sample:
            generators = [
                streams[r.index] if streams else row_stream(base_seed, r.index) for r in mine
            ]
            sampler = RowSampler(generators, _warpers(model, generation))
            slots = {f"row{row.index}": slot for slot, row in enumerate(mine)}
            processors = manager.logit_processor  # before start(), which hands it to the loop
            processors.logits_processor.append(RowSlots(sampler, slots))
            processors.tensors_required += 1
            processors.do_processing = True
        manager.start()
        try:
            for row in mine:
                manager.add_request(
                    row.ids, request_id=f"row{row.index}", max_new_tokens=row.max_new_tokens,
                    eos_token_id=config.eos_token_id,
                )  # fmt: skip
            done = _collect(manager, mine, set(stops))
        finally:
            manager.stop(block=True)
            manager.destroy()
            model.train(was_training)
    return gather_answers(done, rows, accelerator)


def paging(rows: list[Prompt]) -> dict[str, Any]:
    """``ContinuousBatchingConfig``'s settings for ``rows``: the paged cache sized to hold every
    request at once (transformers' default takes most of the free memory: the whole RAM on a
    CPU, the training's room on a device), one forward pass at most all their prompts."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    page = ContinuousBatchingConfig.page_size  # tokens per block
    tokens = sum(len(row.ids) + row.max_new_tokens + page for row in rows)  # a block's rounding
    return {
        "num_blocks": math.ceil(tokens / page) + 1,
        "max_batch_tokens": min(DEFAULT_MAX_BATCH_TOKENS, sum(len(row.ids) for row in rows)),
        # No device graphs: a manager lives one call, too short to replay a capture enough to
        # pay for it, and a sampled row draws from a Python generator per token.
        "use_cuda_graph": False,
        "seed": 0,  # its own sampling is not used; a set seed is not drawn from torch's generator
    }


def _collect(manager: Any, mine: list[Prompt], stops: set[int]) -> list[tuple[int, list[int]]]:
    """Each request's answer as the manager finishes it, cut like the batched engine's: at its
    length limit and after its first stop token."""
    limits = {f"row{row.index}": row for row in mine}
    answers: dict[str, list[int]] = {}
    while len(answers) < len(mine):
        out = manager.get_result(timeout=1)
        if out is None:
            if not manager.is_running():
                raise RuntimeError(
                    "generation.engine=continuous: transformers' continuous batching stopped "
                    f"with {len(mine) - len(answers)} requests unanswered (see its log above)"
                )
            continue
        if not out.is_finished():
            continue
        if out.error is not None:
            raise RuntimeError(
                f"generation.engine=continuous: request {out.request_id}: {out.error}"
            )
        new = list(out.generated_tokens)[: limits[out.request_id].max_new_tokens]
        end = next((k + 1 for k, token in enumerate(new) if token in stops), len(new))
        answers[out.request_id] = new[:end]
    return [(limits[key].index, new) for key, new in answers.items()]


def _check_decoding(
    model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, generation: GenerationConfig
) -> None:
    beams = generation.num_beams or getattr(model.generation_config, "num_beams", 1) or 1
    if generation.do_sample and beams > 1:
        raise ConfigError(
            f"generation.do_sample=true with beam search ({beams} beams, from "
            f"{'generation.num_beams' if generation.num_beams else 'the model generation_config'}"
            "): sampling draws each prompt's answer from its own stream, one answer per prompt; "
            "set generation.num_beams=1, or leave generation.do_sample=false for beam search."
        )
    if tokenizer.pad_token_id is None and tokenizer.eos_token_id is None:
        raise ConfigError(
            f"model.name_or_path: the tokenizer of {tokenizer.name_or_path} has neither a pad "
            "nor an EOS token, so prompts of different lengths cannot share a batch; give it "
            "a pad token (tokenizer.pad_token) or set generation.batch_size=1."
        )


def _batches(order: list[Prompt], size: int, max_length: int | None) -> list[list[Prompt]]:
    """``order`` (longest first) cut into batches of at most ``size``; with ``max_length``, a
    batch also ends where its longest prompt plus its largest answer limit would not fit (the
    batch generates the largest limit for every row, and a cut prompt has room for few)."""
    batches: list[list[Prompt]] = []
    for row in order:
        current = batches[-1] if batches else []
        fits = max_length is None or (
            current
            and len(current[0].ids) + max(row.max_new_tokens, *(r.max_new_tokens for r in current))
            <= max_length
        )
        if current and len(current) < size and fits:
            current.append(row)
        else:
            batches.append([row])
    return batches


@torch.no_grad()
def _generate_batch(
    model: torch.nn.Module,
    batch: list[Prompt],
    tokenizer: PreTrainedTokenizerBase,
    generation: GenerationConfig,
    device: torch.device,
    synced: bool,
    streams: list[torch.Generator],
) -> list[list[int]]:
    encoder_decoder = bool(getattr(model.config, "is_encoder_decoder", False))
    pad = tokenizer.pad_token_id
    if pad is None:
        pad = tokenizer.eos_token_id
    ids, mask = _padded([row.ids for row in batch], pad, left=not encoder_decoder)
    stops = set(stop_ids(model))
    limits = [row.max_new_tokens for row in batch]
    sampled = sample_rows(model, streams, generation, limits, stops) if generation.do_sample else {}
    generated = generate(
        model,
        ids.to(device),
        mask.to(device),
        max_new_tokens=max(row.max_new_tokens for row in batch),
        pad_token_id=pad,
        synced_gpus=synced,
        **beam_search(generation),
        **({"do_sample": False} | sampled),
    )
    start = 1 if encoder_decoder else ids.shape[1]  # the decoder start token / the prompt
    answers = []
    for r, row in enumerate(batch):
        new = generated[r, start : start + row.max_new_tokens].tolist()
        end = next((k + 1 for k, token in enumerate(new) if token in stops), len(new))
        answers.append(new[:end])
    return answers


def generate(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    **kwargs: Any,
) -> torch.Tensor:
    """``model.generate`` on a padded batch, with the KV cache: the one call every generating
    path makes (``kwargs``: transformers' generation arguments, which win over the model's
    generation_config)."""
    with torch.no_grad():
        return model.generate(
            input_ids=input_ids, attention_mask=attention_mask, use_cache=True, **kwargs
        )


def sample_rows(
    model: torch.nn.Module,
    streams: Sequence[torch.Generator],
    generation: GenerationConfig,
    limits: Sequence[int] | None = None,
    stops: set[int] | frozenset[int] = frozenset(),
) -> dict[str, Any]:
    """``generate()``'s arguments that sample row ``b`` of the batch from ``streams[b]``:
    :class:`RowSampler` draws, and greedy search takes the one token it leaves; a row stops
    drawing after one of ``stops`` or ``limits[b]`` tokens."""
    sampler = RowSampler(list(streams), _warpers(model, generation), limits, stops)
    return {"do_sample": False, "logits_processor": LogitsProcessorList([sampler])}


class RowSampler(LogitsProcessor):
    """Samples each row's next token from its own ``torch.Generator`` (on the CPU, so a seed
    gives the same draw on every device) after transformers' warpers, and leaves that token as
    the row's only choice, which greedy search then takes. A row that has ended (one of
    ``stops``, or ``limits[r]`` tokens) draws no more, so what is left of its stream depends on
    its own tokens only, not on how long its batch runs: a conversation continues from it."""

    def __init__(
        self,
        generators: list[torch.Generator],
        warpers: list[LogitsProcessor],
        limits: Sequence[int] | None = None,
        stops: set[int] | frozenset[int] = frozenset(),
    ) -> None:
        self.generators = generators
        self.warpers = warpers
        self.limits = limits
        self.stops = frozenset(stops)
        self.start: int | None = None
        self.ended = [False] * len(generators)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.start is None:
            self.start = input_ids.shape[1]
        step = input_ids.shape[1] - self.start
        live = [
            not self.ended[r] and (self.limits is None or step < self.limits[r])
            for r in range(len(self.generators))
        ]
        return self.draw(input_ids, scores, self.generators, live)

    def draw(
        self,
        input_ids: torch.LongTensor,
        scores: torch.FloatTensor,
        generators: Sequence[torch.Generator],
        live: Sequence[bool] | None = None,
    ) -> torch.FloatTensor:
        """Row ``r`` of ``scores`` sampled from ``generators[r]``: -inf but at the drawn token.
        ``live``: the rows of this batch that have not ended (None: every row, as in continuous
        batching, where a request that ended has left the batch)."""
        for warper in self.warpers:
            scores = warper(input_ids, scores)
        probs = torch.softmax(scores.float(), dim=-1).cpu()
        picks = []
        for r, generator in enumerate(generators):
            if live is not None and not live[r]:
                picks.append(probs[r].argmax().view(1))  # discarded: the row has ended
                continue
            pick = torch.multinomial(probs[r], 1, generator=generator)
            if live is not None:  # the token it keeps is the one drawn here
                self.ended[r] = int(pick) in self.stops
            picks.append(pick)
        picks = torch.cat(picks).to(scores.device)
        chosen = torch.full_like(scores, -float("inf"))
        chosen.scatter_(1, picks.unsqueeze(1), 0.0)
        return chosen


class RowSlots(ContinuousBatchingLogitsProcessor or object):  # type: ignore[misc]
    """:class:`RowSampler` for transformers' continuous batching, whose batches mix requests
    that come and go: each request's place in the input reaches the sampler as the request's
    tensor argument, so its token comes from its own row's stream whichever requests share
    the step."""

    supported_kwargs: ClassVar[dict[str, type]] = {}
    ignored_kwargs: tuple[str, ...] = ()

    def __init__(self, sampler: RowSampler, slots: dict[str, int]) -> None:
        self.sampler = sampler
        self.slots = slots

    def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
        int32_tensor.fill_(0)

    def prepare_tensor_args(self, requests_with_new_token: list[Any]) -> torch.Tensor:
        rows = [self.slots[request.state.request_id] for request in requests_with_new_token]
        return torch.tensor(rows, dtype=torch.int32)

    def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
        rows = tensor_arg[: scores.size(0)].tolist()
        generators = [self.sampler.generators[r] for r in rows]
        return self.sampler.draw(torch.zeros(len(rows), 1, dtype=torch.long), scores, generators)


def beam_search(generation: GenerationConfig) -> dict[str, Any]:
    """``generate()``'s beam arguments that ``generation`` sets (unset: the model's own)."""
    beams = {"num_beams": generation.num_beams, "length_penalty": generation.length_penalty}
    return {key: value for key, value in beams.items() if value is not None}


def _warpers(model: torch.nn.Module, generation: GenerationConfig) -> list[LogitsProcessor]:
    """transformers' sampling warpers for ``generation`` (temperature, top_k, top_p, in the
    order ``generate`` applies them); top_k, unless ``generation.top_k`` sets it, is the model's
    generation_config's, as in transformers."""
    warpers: list[LogitsProcessor] = []
    if generation.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(generation.temperature))
    top_k = sampling_top_k(model, generation)
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if generation.top_p < 1.0:
        warpers.append(TopPLogitsWarper(generation.top_p))
    return warpers


def _padded(rows: list[list[int]], pad: int, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for r, row in enumerate(rows):
        span = slice(width - len(row), width) if left else slice(0, len(row))
        ids[r, span] = torch.tensor(row, dtype=torch.long)
        mask[r, span] = 1
    return ids, mask


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def _sharded(accelerator: Accelerator) -> bool:
    from accelerate.utils import DistributedType

    return accelerator.distributed_type == DistributedType.FSDP


def whole_root(
    model: torch.nn.Module, unwrapped: torch.nn.Module
) -> contextlib.AbstractContextManager:
    """Under FSDP: the root's own parameters (the shared embeddings, the final norms) whole
    while ``generate`` runs, which calls the model's parts rather than the root's forward
    (whose hooks gather them); the layers each FSDP unit wraps gather their shards as usual."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    if isinstance(model, FullyShardedDataParallel):  # FSDP1: a wrapper around the model
        return FullyShardedDataParallel.summon_full_params(model, writeback=False, recurse=False)
    try:  # FSDP2: the model itself; generate runs the root's gathering hooks
        from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method
    except ImportError:
        return contextlib.nullcontext()
    if isinstance(unwrapped, FSDPModule) and not getattr(unwrapped, "_generate_gathers", False):
        register_fsdp_forward_method(unwrapped, "generate")
        unwrapped._generate_gathers = True
    return contextlib.nullcontext()
