"""The reference policy of a preference or RL task (DPO, KTO; GRPO with ``beta`` > 0): the model
as it was before training, which the loss compares the policy with.

One :class:`Reference`, built in the task's ``before_training`` from the run's starting weights,
before a resumed run loads its checkpoint, so a resumed run compares with the same weights as an
uninterrupted one; it holds nothing a checkpoint must restore. It is one of:

* under LoRA, the policy itself with its adapter disabled (no second copy of the model);
* with full fine-tuning, a frozen copy of the starting weights (not under FSDP, where the copy
  could not be sharded here);
* its log-probabilities computed once before training (:func:`precompute`), cached with the
  features and handed to the loss in each batch (``reference_logps``), which needs neither.

A task asks it for anything computed under the reference's weights: :meth:`Reference.run` calls
``forward(model)`` on the weights the reference stands for, without autograd (a batch's summed
log-probs for DPO and KTO, per-token log-probs of sampled completions for GRPO).

Its starting weights are those loaded, so ``mode=eval`` of a trained model (a ``final/``) would
compare the model with itself: :func:`check_evaluated_model` refuses that where the evaluation's
numbers come from the reference (DPO, KTO); a checkpoint (``resume=<run>``) is scored against the
model its run started from.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from datasets import Dataset

from recipes import adapters, moe
from recipes import data as data_lib
from recipes.config import ConfigError, DataConfig
from recipes.evaluation import eval_mode
from recipes.log import get_logger
from recipes.tasks.base import Layout, SummedLoss
from recipes.tasks.chat.features import ChatData, ChatFeatures

log = get_logger(__name__)


@dataclass
class PreferenceData(ChatData):
    """The features of a task with a reference (DPO's pairs, KTO's rows); ``prompts`` are
    held-out prompts with their preferred answer; ``feature_keys`` and ``cache`` say where
    precomputed reference log-probs are cached (:func:`prepare`)."""

    feature_keys: dict[str, str] = field(default_factory=dict)
    cache: Path | None = None


T = TypeVar("T")
BATCH_LOGPS = "reference_logps"  # a batch's precomputed reference log-probs (its collator's)


class Reference:
    """The reference weights (see the module's docstring). ``frozen``: the frozen copy, or None
    where the reference runs on the policy (its adapter disabled, or before training);
    ``autocast``: the context a frozen copy runs in (the run's mixed precision)."""

    def __init__(
        self,
        adapter_disabled: bool,
        frozen: torch.nn.Module | None = None,
        autocast: Callable[[], Any] = nullcontext,
        precomputed: bool = False,
    ) -> None:
        self.adapter_disabled = adapter_disabled
        self.frozen = frozen
        self.autocast = autocast
        self.precomputed = precomputed  # every batch carries its values (BATCH_LOGPS)

    @classmethod
    def build(
        cls,
        model: torch.nn.Module,
        accelerator: Accelerator,
        fsdp_refusal: str,
        autocast: bool = True,
    ) -> Reference:
        """The live reference of the prepared ``model``: its adapter disabled under LoRA, else a
        frozen copy of its weights now (refused under FSDP with ``fsdp_refusal``). ``autocast``:
        the copy runs under the run's mixed precision."""
        unwrapped = accelerator.unwrap_model(model)
        if adapters.is_peft_model(unwrapped):
            log.info("reference model: the model with its LoRA adapter disabled (no copy)")
            return cls(adapter_disabled=True)
        if accelerator.distributed_type == DistributedType.FSDP:
            raise ConfigError(fsdp_refusal)
        frozen = copy.deepcopy(unwrapped).eval().requires_grad_(False)
        log.info("reference model: a frozen copy of the starting weights")
        return cls(False, frozen, accelerator.autocast if autocast else nullcontext)

    @classmethod
    def from_batches(cls) -> Reference:
        """The reference whose values every batch carries (:data:`BATCH_LOGPS`, precomputed)."""
        return cls(adapter_disabled=False, precomputed=True)

    @classmethod
    def starting_weights(cls, model: torch.nn.Module, accelerator: Accelerator) -> Reference:
        """The policy as it is now (before training), its adapter disabled under LoRA: what
        :func:`precompute` computes the reference from, without a copy."""
        return cls(adapters.is_peft_model(accelerator.unwrap_model(model)))

    def run(self, model: torch.nn.Module, forward: Callable[[torch.nn.Module], T]) -> T:
        """``forward`` on the reference's weights (``model`` is the policy), without autograd."""
        with torch.no_grad():
            if self.frozen is not None:
                with self.autocast():
                    return forward(self.frozen)
            if self.adapter_disabled:
                with peft_model(model).disable_adapter():
                    return forward(model)
            return forward(model)

    def logps(
        self,
        model: torch.nn.Module,
        batch: Mapping[str, torch.Tensor],
        forward: Callable[[torch.nn.Module, Mapping[str, torch.Tensor]], torch.Tensor],
    ) -> torch.Tensor:
        """The reference's ``forward(model, batch)``: the batch's precomputed values where it
        carries them, else computed on the reference's weights."""
        if BATCH_LOGPS in batch:
            return batch[BATCH_LOGPS]
        if self.precomputed:
            raise RuntimeError("the reference was precomputed, and this batch carries none")
        return self.run(model, lambda weights: forward(weights, batch))


@dataclass(frozen=True)
class AgainstReference:
    """The policy-against-reference part DPO and KTO share (``kind``): their data (features
    with the keys and cache folder a precomputed reference is stored under, the collators of
    both splits sharing one layout) and their reference, built from the starting weights
    before training (:func:`prepare`). ``args``: the task's settings (``disable_dropout``,
    ``precompute_reference``, ``loss_type``, ``max_seq_length``); ``rows``: what a row is, in
    the log; ``fsdp_fix``: the way out of the FSDP refusal."""

    args: Any
    kind: str
    version: int
    rows: str
    fsdp_fix: str

    def features(self, row_words: tuple[str, str]) -> ChatFeatures:
        """The task's chat features (:meth:`ChatFeatures.of`), under the same kind and version
        as the reference's cached table."""
        return ChatFeatures.of(self.args, self.kind, self.version, row_words)

    def data(
        self,
        cfg: DataConfig,
        features: Mapping[str, Dataset],
        keys: dict[str, str],
        collator: Callable[[Layout], Callable[[list[dict]], dict]],
        template_fields: Mapping[str, Any],
    ) -> PreferenceData:
        """The task's data: ``features`` with each row's ``index`` (its position in the split,
        where a precomputed reference keeps its values); ``collator(layout)`` builds a split's
        collator, ``template_fields`` are the template's
        (:meth:`recipes.tasks.chat.ChatTemplate.data_fields`)."""
        layout = Layout()  # padded or padding-free: the loop decides (Task.flat_batches)
        indexed = {
            role: rows.add_column("index", list(range(len(rows))))
            for role, rows in features.items()
        }
        return PreferenceData(
            feature_keys=keys,
            cache=data_lib.cache_root(cfg),
            train=indexed["train"],
            eval=indexed["eval"],
            train_collator=collator(layout),
            eval_collator=collator(layout),
            max_length=self.args.max_seq_length,
            layout=layout,
            **template_fields,
        )

    def reference(
        self,
        model: torch.nn.Module,
        data: PreferenceData,
        accelerator: Accelerator,
        batch_size: int,
        forward: Callable[[torch.nn.Module, Mapping[str, torch.Tensor]], torch.Tensor],
        live: bool = True,
    ) -> Reference | None:
        """The reference for training on ``data`` (``forward``: a batch's log-probs, the layout
        a precomputed table keeps); None where the loss has none (not ``live``). Dropout is
        turned off first where ``disable_dropout`` says so, reference or not."""
        if self.args.disable_dropout:
            disable_dropout(accelerator.unwrap_model(model))
        if not live:
            return None
        return prepare(
            model,
            accelerator,
            data,
            forward,
            self.args,
            kind=self.kind,
            version=self.version,
            batch_size=batch_size,
            rows=self.rows,
            fsdp_fix=self.fsdp_fix,
        )


def prepare(
    model: torch.nn.Module,
    accelerator: Accelerator,
    data: PreferenceData,
    forward: Callable[[torch.nn.Module, Mapping[str, torch.Tensor]], torch.Tensor],
    args: Any,
    *,
    kind: str,
    version: int,
    batch_size: int,
    rows: str,
    fsdp_fix: str,
) -> Reference:
    """The reference of task ``kind`` (settings ``args``: its ``precompute_reference`` and
    ``loss_type``) for training on ``data`` (its collators add a precomputed table to their
    batches, as ``reference``): live (:meth:`Reference.build`; under FSDP without LoRA refused,
    with ``fsdp_fix`` as the way out), or with ``precompute_reference`` its ``forward`` on every
    row of both splits (:func:`precompute`, cached in ``data.cache`` as
    ``<kind>-reference-<key>.pt``, keyed by the loss type, the builder's ``version`` and
    ``data.feature_keys``)."""
    precomputed = args.precompute_reference
    fsdp_refusal = (
        f"task={kind} with full fine-tuning under FSDP: the frozen reference copy cannot be "
        f"sharded here; {fsdp_fix}"
    )
    key = {"loss_type": args.loss_type, "version": version}
    if not precomputed:
        return Reference.build(model, accelerator, fsdp_refusal)
    splits = {"train": (data.train, data.train_collator), "eval": (data.eval, data.eval_collator)}
    tables = precompute(
        model,
        accelerator,
        splits,
        forward,
        key={"features": data.feature_keys, **key},
        path=lambda digest: (data.cache or Path(".")) / f"{kind}-reference-{digest}.pt",
        batch_size=batch_size,
        rows=rows,
    )
    data.train_collator.reference, data.eval_collator.reference = tables["train"], tables["eval"]
    return Reference.from_batches()


def precompute(
    model: torch.nn.Module,
    accelerator: Accelerator,
    splits: Mapping[str, tuple[Dataset, Callable[[list[dict]], dict]]],
    forward: Callable[[torch.nn.Module, Mapping[str, torch.Tensor]], torch.Tensor],
    *,
    key: Mapping[str, Any],
    path: Callable[[str], Path],
    batch_size: int,
    rows: str,
) -> dict[str, torch.Tensor]:
    """The reference's ``forward`` on every row of each split (``role: (rows, collator)``, each
    row with its ``index``), as one table per split, the same on every process: read from the
    cache file ``path(cache key)``, keyed by ``key`` (the features and the loss), the starting
    weights (:func:`weights_fingerprint`) and the precision, or computed once and cached
    there. ``rows``: what a row is, in the log."""
    digest = data_lib.cache_key(
        **key,
        weights=weights_fingerprint(model, accelerator),
        precision=accelerator.mixed_precision,
    )
    file = path(digest)
    if file.exists():
        tables = torch.load(file)
        log.info("reference model: precomputed log-probs read from the cache, %s", file)
        return tables
    reference = Reference.starting_weights(model, accelerator)
    tables = {
        role: _table(model, reference, forward, split, collator, accelerator, batch_size, rows)
        for role, (split, collator) in splits.items()
    }
    if accelerator.is_main_process:
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp = file.with_suffix(f".tmp{accelerator.process_index}")
        torch.save(tables, tmp)
        tmp.replace(file)
        log.info("reference model: precomputed log-probs cached in %s", file)
    accelerator.wait_for_everyone()
    return tables


def _table(
    model: torch.nn.Module,
    reference: Reference,
    forward: Callable[[torch.nn.Module, Mapping[str, torch.Tensor]], torch.Tensor],
    split: Dataset,
    collator: Callable[[list[dict]], dict],
    accelerator: Accelerator,
    batch_size: int,
    rows: str,
) -> torch.Tensor:
    """The reference's values of every row of ``split``, the same on every process: each
    computes a strided share (all the same number of batches, as FSDP needs), then they are
    gathered."""
    rank, world = accelerator.process_index, accelerator.num_processes
    share = math.ceil(len(split) / world)
    mine = [min(rank + world * i, len(split) - 1) for i in range(share)]
    values, indices = [], []
    with eval_mode(model):
        for start in range(0, share, batch_size):
            chunk = mine[start : start + batch_size]
            batch = collator([split[i] for i in chunk])
            batch = {k: v.to(accelerator.device) for k, v in batch.items()}
            values.append(reference.logps(model, batch, forward).float())
            indices.append(batch["index"])
    values = accelerator.gather(torch.cat(values))
    indices = accelerator.gather(torch.cat(indices))
    table = torch.zeros(len(split), *values.shape[1:], dtype=torch.float32)
    table[indices.cpu()] = values.cpu()
    log.info("reference model: log-probs of %d %s computed before training", len(split), rows)
    return table


def weights_fingerprint(model: torch.nn.Module, accelerator: Accelerator) -> list[float]:
    """Sums of the starting weights the reference is computed from (LoRA's own weights left
    out: the reference disables them), the same on every process: under FSDP each holds a
    shard, so the shards' sums are added up."""
    sums = []
    for name, param in accelerator.unwrap_model(model).named_parameters():
        if "lora_" not in name:
            local = param.to_local() if hasattr(param, "to_local") else param
            sums.append(local.detach().double().sum())
    total = torch.stack(sums) if sums else torch.zeros(1, dtype=torch.float64)
    if accelerator.distributed_type == DistributedType.FSDP:
        total = accelerator.reduce(total.to(accelerator.device), reduction="sum")
    return [float(f"{value:.9g}") for value in total.tolist()]


def peft_model(model: torch.nn.Module) -> Any:
    """The peft model inside a DDP wrapper (FSDP keeps it as its own module)."""
    inner = getattr(model, "module", model)
    return inner if hasattr(inner, "disable_adapter") else model


def shard_frozen(model: torch.nn.Module, accelerator: Accelerator, refusal: str) -> torch.nn.Module:
    """A frozen model (a teacher) sharded as the policy is under FSDP2: accelerate's own
    preparation (its ``fsdp2_prepare_model``: the plugin's layer policy, device mesh, mixed
    precision and offload; TRL's ``prepare_fsdp`` shards only the root, which gathers the whole
    model at every forward), but not registered with the accelerator: no optimizer, no
    checkpoint. Under FSDP1 refused with ``refusal``."""
    plugin = accelerator.state.fsdp_plugin
    if getattr(plugin, "fsdp_version", 1) != 2:
        raise ConfigError(refusal)
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model

    policy = plugin.auto_wrap_policy  # the policy's own, set from its layers: kept as it was
    try:
        model = fsdp2_prepare_model(accelerator, model.eval().requires_grad_(False))
    finally:
        plugin.auto_wrap_policy = policy
    log.info("teacher: sharded like the policy (FSDP2, no optimizer, not checkpointed)")
    return model.eval()


def disable_dropout(model: torch.nn.Module) -> None:
    """Every dropout to 0 (TRL's ``disable_dropout``): the policy's log-probabilities are then
    those the reference sees, not a noisy draw of them."""
    count = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout) and module.p:
            module.p = 0.0
            count += 1
    for config in {id(c): c for c in (getattr(model, "config", None),) if c is not None}.values():
        for key in ("attention_dropout", "hidden_dropout", "dropout"):
            if getattr(config, key, 0):
                setattr(config, key, 0.0)
                count += 1
    if count:
        log.info("task.disable_dropout: %d dropout module(s) and setting(s) set to 0", count)


def summed_loss(
    model: torch.nn.Module,
    stats: Sequence[str],
    terms: Callable[[], tuple[torch.Tensor, torch.Tensor]],
) -> SummedLoss:
    """What the loss of a task against its reference hands the loop: ``terms()`` gives each
    row's loss, (rows,), and its ``stats``, (rows, len(stats)); their sums and the row count
    (filled on the device: no copy), a MoE model's router loss added
    (:func:`recipes.moe.router_loss`)."""
    with moe.router_loss(model) as router:
        losses, values = terms()
    count = losses.new_full((), float(len(losses)))
    summed = dict(zip(stats, values.sum(0), strict=True))
    return router.added(SummedLoss(losses.sum(), count, summed))
