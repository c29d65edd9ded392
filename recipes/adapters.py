"""LoRA adapters through ``peft`` (``peft=lora``) and gradient checkpointing.

What a LoRA run changes, and where the loop calls this module:

* after ``load_model``: :func:`apply_lora` (``peft.method=lora``) freezes the base model, adds
  adapters to its linear layers and trains the task head (``qa_outputs``, ``classifier``, ``score``)
  in full; the optimizer is then built as always (frozen parameters are skipped);
* :func:`enable_gradient_checkpointing` (``trainer.gradient_checkpointing=true``);
* after ``accelerator.prepare``: :func:`register_checkpoint_hooks`, so that ``save_state`` /
  ``load_state`` write and read only the trainable parameters (accelerate alone writes the whole
  model, frozen base included);
* at the end: :func:`save_final` writes ``final/adapter/`` (for ``peft``) and a merged model in
  ``final/`` (for plain ``transformers``).

``peft`` is imported only when LoRA is used.
"""

from __future__ import annotations

import copy
import json
import re
import sys
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator

from recipes import moe
from recipes.config import ConfigError, PeftSettings, first_line
from recipes.log import get_logger

log = get_logger(__name__)

# Heads that transformers initialises afresh for a task: they must train in full (a LoRA update
# of a random matrix would be a poor head), so they go to peft's ``modules_to_save``.
HEAD_MODULES = ("qa_outputs", "classifier", "score")
# Names that only a peft-wrapped model has; none may survive in a merged model.
_PEFT_KEY = re.compile(r"lora_|base_model\.model\.|modules_to_save|original_module")
ALL_LINEAR = "all-linear"
ADAPTER_DIR = (
    "adapter"  # in final/ and in each checkpoint: what peft.PeftModel.from_pretrained loads
)
BASE_DIR = "base"  # in final/, where model.name_or_path does not load the adapter's base
# What peft (>= 0.18) warns, on every such run, when a layer the model ties to another (its
# output layer, tied to the input embedding) is in peft.modules_to_save: it trains a copy of that
# layer alone, and merging then unties the two (config.tie_word_embeddings=false). That is what
# training the output layer in full asks for (debug=smoke of llama_grpo does), not a slip its
# ensure_weight_tying (which would train the input embedding with it) would fix; final/ is saved
# untied, as safetensors, and reloads (tests/test_grpo.py). apply_lora says so once instead.
_TIED_NOTICES = (
    "Model has `tie_word_embeddings=True` and a tied layer is part of the adapter",
    "Input and output embeddings are no longer tied after merging",
)


def task_type(model: torch.nn.Module) -> Any:
    """peft's task type for the model's head (None for heads peft has no type for: masked LM,
    multiple choice)."""
    from peft import TaskType

    kinds = {
        "ForCausalLM": TaskType.CAUSAL_LM,
        "ForQuestionAnswering": TaskType.QUESTION_ANS,
        "ForSequenceClassification": TaskType.SEQ_CLS,
        "ForTokenClassification": TaskType.TOKEN_CLS,
        "ForConditionalGeneration": TaskType.SEQ_2_SEQ_LM,  # T5, BART, mT5
        "EncoderDecoderModel": TaskType.SEQ_2_SEQ_LM,  # an encoder-decoder built from two BERTs
    }
    name = type(model).__name__
    return next((kind for suffix, kind in kinds.items() if name.endswith(suffix)), None)


def task_heads(model: torch.nn.Module) -> list[str]:
    """The model's freshly initialised task head(s) among :data:`HEAD_MODULES`."""
    return [
        name for name in HEAD_MODULES if isinstance(getattr(model, name, None), torch.nn.Module)
    ]


def apply_lora(
    model: torch.nn.Module,
    cfg: PeftSettings,
    task_head_modules: Sequence[str],
    new_tokens: Sequence[int] = (),
) -> torch.nn.Module:
    """Wrap ``model`` with LoRA adapters (a ``peft.PeftModel``); the task heads train in full,
    and so do the embedding rows of ``new_tokens`` (peft's ``trainable_token_indices``: those
    rows only, in the input embedding and in an untied output layer).

    ``peft.target_modules: null`` means every linear layer except the output layer and the heads
    (peft's ``all-linear``): QLoRA found adapters on all linear layers are needed to come close to
    full fine-tuning, and it names the right layers of any architecture (Llama's seven
    projections, GPT-2's ``c_attn``/``c_proj``/``c_fc``, BERT's ``query``/``key``/``value``/
    ``dense``) without a table. peft's own per-architecture table
    (``TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING``) holds the query and value
    projections only, the LoRA paper's minimal choice.
    """
    from peft import LoraConfig, get_peft_model

    if cfg.method != "lora":
        raise ValueError(f"apply_lora called with peft.method={cfg.method}")
    heads = list(dict.fromkeys([*task_head_modules, *cfg.modules_to_save]))
    targets = ALL_LINEAR if cfg.target_modules is None else cfg.target_modules
    _check_targets(model, targets, heads)
    dropout, expert_parameters = cfg.dropout, []
    if cfg.target_modules is None and moe.num_experts(model):
        targets, expert_parameters, dropout = _expert_targets(model, heads, cfg.dropout)
    config = LoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,
        lora_dropout=dropout,
        target_modules=targets if isinstance(targets, str) else list(targets),
        target_parameters=expert_parameters or None,
        # A head is trained in full; an adapter on top of it would be trained twice over.
        # Copies: peft appends its task type's head names to the list it is given.
        exclude_modules=list(heads) or None,
        modules_to_save=list(heads) or None,
        task_type=task_type(model),
        bias="none",
        # GPT-2's Conv1D stores its weight transposed; said here, peft does not warn per layer.
        fan_in_fan_out=any(isinstance(m, _conv1d()) for m in model.modules()),
        trainable_token_indices=_token_rows(model, new_tokens),
    )
    tied = _tied_in(model, heads)
    try:
        with _tied_notices_quiet(tied):
            wrapped = get_peft_model(model, config)
    except ValueError as err:  # a matched module peft cannot adapt (a LayerNorm, say)
        fix = (
            "Set peft.dropout=0 (peft's LoRA on fused experts takes no dropout), or name "
            "other layers"
            if "lora_dropout" in str(err)
            else "Name linear layers, or set peft.target_modules=null for all of them"
        )
        raise ConfigError(
            f"peft.target_modules={targets}: peft refused it ({first_line(err)}). {fix}."
        ) from None
    adapted = sorted(
        {name.rsplit(".", 1)[-1] for name in adapted_modules(wrapped)} - {"base_layer", "experts"}
    )
    log.info(
        "LoRA r=%d alpha=%g dropout=%g on %s; trained in full: %s",
        cfg.r,
        cfg.alpha,
        dropout,
        ", ".join([*adapted, *expert_parameters]),
        ", ".join([*heads, *([f"{len(new_tokens)} new token rows"] if new_tokens else [])])
        or "nothing else",
    )
    log.info(trainable_summary(wrapped))
    if tied:
        log.info(
            "%s trains in full apart from the input embedding it is tied to: final/ holds them "
            "untied (tie_word_embeddings=false)",
            ", ".join(tied),
        )
    return wrapped


def _expert_targets(
    model: torch.nn.Module, heads: list[str], dropout: float
) -> tuple[list[str], list[str], float]:
    """``peft.target_modules=null`` on a mixture-of-experts model: every linear layer but the
    router (:func:`recipes.moe.router_names`) and the heads, and the experts' fused weights
    (transformers 5 stacks them in 3-D parameters, :func:`recipes.moe.fused_expert_parameters`)
    through peft's ``target_parameters``. peft's LoRA on a parameter (``lora.ParamWrapper``)
    cannot apply dropout (it would have to factor the input out of the expert's product), so
    the adapter's dropout is 0 there; the log says which. Returns the target modules, the
    expert parameters and the dropout."""
    routers = moe.router_names(model)
    linear = [name for name in _linear_leaf_names(model, heads) if name not in routers]
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    names = {id(m): n.rsplit(".", 1)[-1] for n, m in model.named_modules()}
    if output is not None:  # peft's all-linear leaves the output layer out too
        linear = [name for name in linear if name != names.get(id(output))]
    fused = moe.fused_expert_parameters(model)
    kind = type(model).__name__
    frozen = f"; the router ({', '.join(routers)}) stays frozen" if routers else ""
    if fused:
        log.info(
            "%s: LoRA on %s and on the fused experts (%s, peft's target_parameters)%s. "
            "peft's LoRA on fused experts takes no dropout: peft.dropout=%g -> 0",
            kind,
            ", ".join(linear),
            ", ".join(fused),
            frozen,
            dropout,
        )
        return linear, fused, 0.0
    log.info("%s: LoRA on %s (the experts are linear layers)%s", kind, ", ".join(linear), frozen)
    return linear, [], dropout


def _tied_in(model: torch.nn.Module, names: Sequence[str]) -> list[str]:
    """The modules among ``names`` (trained in full) that are the model's output layer or input
    embedding while the two share one weight; ``model`` plain or peft-wrapped."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    try:
        ends = [base.get_input_embeddings(), base.get_output_embeddings()]
    except (AttributeError, NotImplementedError):
        return []
    ends = [getattr(m, "original_module", m) for m in ends]  # under peft's ModulesToSaveWrapper
    weights = [getattr(m, "weight", None) for m in ends]
    if weights[0] is None or weights[0] is not weights[1]:
        return []
    found = {
        name.rsplit(".", 1)[-1]
        for name, module in base.named_modules()
        if name.rsplit(".", 1)[-1] in names
        and any(getattr(module, "original_module", module) is end for end in ends)
    }
    return sorted(found)


@contextmanager
def _tied_notices_quiet(tied: Sequence[str]) -> Iterator[None]:
    """Without peft's two warnings on a tied layer trained in full (:data:`_TIED_NOTICES`)
    where ``tied`` names one; anything else peft warns still shows."""
    with warnings.catch_warnings():
        if tied:
            for message in _TIED_NOTICES:
                warnings.filterwarnings("ignore", message=re.escape(message), category=UserWarning)
        yield


def _token_rows(model: torch.nn.Module, tokens: Sequence[int]) -> dict[str, list[int]] | None:
    """``trainable_token_indices`` for ``tokens``: the input embedding's module name, and the
    output layer's where it is not tied to it (peft follows a tied one by itself)."""
    if not tokens:
        return None
    names = {id(m): n.rsplit(".", 1)[-1] for n, m in model.named_modules()}
    rows = {names[id(model.get_input_embeddings())]: list(tokens)}
    output = model.get_output_embeddings()
    if output is not None and output.weight is not model.get_input_embeddings().weight:
        rows[names[id(output)]] = list(tokens)
    return rows


@contextmanager
def tie_seen_by_fsdp2(model: torch.nn.Module) -> Iterator[None]:
    """peft's trainable token rows on a tied embedding answer ``.weight`` with a freshly merged
    tensor, on the input embedding's wrapper and on its tied twin on the output layer alike.
    accelerate's FSDP2 preparation (``fsdp2_prepare_model``, 1.16) tells a tied model by
    ``input_embed.weight is output_embed.weight``, so it misses the tie: it shards the embedding
    in a group of its own, then the output layer, whose twin holds the same, already sharded
    rows, and torch stops ("Invariant encountered: value was None"). While this is open, both
    wrappers answer ``.weight`` with the embedding's own parameter, and accelerate puts the
    two into one group, as for any tied model; outside peft's wrappers nothing changes."""
    ends = [model.get_input_embeddings(), model.get_output_embeddings()]
    shared = [getattr(getattr(m, "original_module", None), "weight", None) for m in ends]
    wrappers = [m for m in ends if m is not None and hasattr(m, "token_adapter")]
    tied = len(wrappers) == 2 and shared[0] is not None and shared[0] is shared[1]
    if tied:
        for wrapper in wrappers:  # an instance entry shadows peft's __getattr__ for "weight"
            wrapper.__dict__["weight"] = shared[0]
    try:
        yield
    finally:
        for wrapper in wrappers if tied else ():
            wrapper.__dict__.pop("weight", None)


def base_reference(cfg: Any, resized: bool) -> tuple[str | None, str | None]:
    """What the adapter's ``base_model_name_or_path`` names: the model as ``model.*`` loads it
    (a hub name, or a local folder as an absolute path, so it loads from anywhere), or None where
    ``from_pretrained`` of that would not give the trained base: a GGUF file (dequantised on
    load) or embeddings resized for added tokens. :func:`save_final` then writes the base.
    Returned with the revision to load (``model.revision``)."""
    if cfg.gguf_file or resized:
        return None, None
    local = Path(cfg.name_or_path).expanduser()
    return (str(local.resolve()), None) if local.exists() else (cfg.name_or_path, cfg.revision)


def adapted_modules(model: torch.nn.Module) -> list[str]:
    """Names of the modules that carry a LoRA adapter."""
    from peft.tuners.lora import LoraLayer

    return [name for name, module in model.named_modules() if isinstance(module, LoraLayer)]


def _conv1d() -> type:
    from transformers.pytorch_utils import Conv1D  # GPT-2's linear layers

    return Conv1D


def _check_targets(model: torch.nn.Module, targets: str | Sequence[str], heads: list[str]) -> None:
    """Refuse target names that match no module of ``model`` (a misspelling would otherwise
    train the heads alone, or stop peft with a long message)."""
    names = [name for name, _ in model.named_modules() if name]
    unknown = [h for h in heads if not any(n == h or n.endswith(f".{h}") for n in names)]
    if unknown:
        raise ConfigError(
            f"peft.modules_to_save: {', '.join(unknown)} match no module of "
            f"{type(model).__name__}. Name modules of the model (its top-level ones: "
            f"{', '.join(n for n in names if '.' not in n)}), or leave the list empty."
        )
    linear = _linear_leaf_names(model, heads)
    hint = f"its linear layers are named {', '.join(linear) or '(none)'}"
    if targets == ALL_LINEAR:
        if not linear:
            raise ConfigError(
                f"peft.target_modules=null: {type(model).__name__} has no linear layer outside "
                "the task head. Name its modules with peft.target_modules=[...]."
            )
        return
    if isinstance(targets, str):
        missing = [] if any(re.fullmatch(targets, n) for n in names) else [targets]
    else:
        missing = [t for t in targets if not any(n == t or n.endswith(f".{t}") for n in names)]
    if missing:
        raise ConfigError(
            f"peft.target_modules: {', '.join(missing)} match no module of "
            f"{type(model).__name__} ({hint}). Name some of those, or set "
            "peft.target_modules=null for all linear layers."
        )


def _linear_leaf_names(model: torch.nn.Module, heads: list[str]) -> list[str]:
    found = {
        name.rsplit(".", 1)[-1]
        for name, module in model.named_modules()
        if isinstance(module, (torch.nn.Linear, _conv1d())) and name.split(".")[0] not in heads
    }
    return sorted(found)


def is_peft_model(model: torch.nn.Module) -> bool:
    """Whether ``model`` (unwrapped) is a peft model; free when peft was never imported."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def trainable_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts; tied weights count once."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


def trainable_summary(model: torch.nn.Module) -> str:
    """``trainable parameters: N of M (x.xx%)``, the line the log states."""
    trainable, total = trainable_parameters(model)
    return f"trainable parameters: {trainable} of {total} ({100 * trainable / max(total, 1):.2f}%)"


def enable_gradient_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each layer's activations in the backward pass (non-reentrant checkpointing).

    Works on transformers 4.x (``gradient_checkpointing_enable``) and 5.x
    (``activation_checkpointing_enable``); ``model`` may be a peft model.
    """
    base = model.get_base_model() if is_peft_model(model) else model
    if not getattr(base, "supports_gradient_checkpointing", False):
        raise ConfigError(
            f"trainer.gradient_checkpointing=true: {type(base).__name__} does not support it. "
            "Set trainer.gradient_checkpointing=false."
        )
    kwargs = {"use_reentrant": False}  # reentrant checkpointing drops grads of frozen-input layers
    if hasattr(base, "activation_checkpointing_enable"):
        base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if is_peft_model(model):
        # Frozen embeddings give layer inputs that do not require grad. Non-reentrant
        # checkpointing copes; a model whose own code calls the reentrant variant would then
        # silently train nothing in its checkpointed layers.
        base.enable_input_require_grads()
    base.config.use_cache = False  # a KV cache is of no use in training, and clashes with recompute


def trainable_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trainable parameters (adapters and fully trained heads) by their state-dict names.

    Buffers are left out: LoRA layers and linear heads have none, and frozen buffers come back
    from the base model on resume.
    """
    return {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}


def load_trainable_state_dict(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Load what :func:`trainable_state_dict` saved; the keys must be exactly the trainable ones."""
    expected = set(trainable_state_dict(model))
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ConfigError(
            f"resume: the checkpoint's trainable parameters differ from this model's (missing "
            f"{missing[:3]}, unexpected {unexpected[:3]}, of {len(missing)} / {len(unexpected)}). "
            "Resume with the peft.* settings the run was started with, or start a new run."
        )
    try:
        model.load_state_dict(dict(state), strict=False)
    except RuntimeError as err:  # same names, other shapes: peft.r changed
        raise ConfigError(
            f"resume: the checkpoint's adapters have other shapes ({first_line(err)}). Resume "
            "with the peft.* settings the run was started with, or start a new run."
        ) from None


def register_checkpoint_hooks(accelerator: Accelerator) -> list[Any]:
    """Make ``save_state`` / ``load_state`` hold only the trainable parameters of peft models.

    accelerate's ``save_state`` writes ``model.state_dict()`` whole (frozen base included) and
    ``load_state`` loads it strictly. Its hooks swap in :func:`trainable_state_dict` on save (and
    write the peft adapter folder ``adapter/`` beside it) and load that subset on load (the base
    weights are those the run was started from). The
    optimizer state is already that of the trainable parameters: the optimizer holds no other.
    FSDP and DeepSpeed save the model their own way; there the hooks leave it alone.
    Call once, after ``accelerator.prepare``; returns the hook handles.
    """

    def save_hook(models: list[torch.nn.Module], weights: list[dict], output_dir: str) -> None:
        if len(weights) != len(models):  # FSDP / DeepSpeed: accelerate gathers no weights
            return
        for i, model in enumerate(models):
            inner = accelerator.unwrap_model(model)
            if is_peft_model(inner):
                weights[i] = trainable_state_dict(inner)
                # Also as peft's adapter folder: any checkpoint (the best one, say) can become
                # a final model, or be loaded with peft.PeftModel.from_pretrained.
                inner.save_pretrained(
                    Path(output_dir) / ADAPTER_DIR, is_main_process=accelerator.is_main_process
                )

    def load_hook(models: list[torch.nn.Module], input_dir: str) -> None:
        for model in list(models):
            inner = accelerator.unwrap_model(model)
            if not is_peft_model(inner):
                continue
            index = next(i for i, m in enumerate(accelerator._models) if m is model)
            if model is not models[-1]:  # accelerate numbers model files by list position
                raise NotImplementedError("a peft model must be the last prepared model")
            load_trainable_state_dict(inner, _read_model_file(Path(input_dir), index))
            models.remove(model)  # loaded: keep accelerate's strict full-model load off it

    return [
        accelerator.register_save_state_pre_hook(save_hook),
        accelerator.register_load_state_pre_hook(load_hook),
    ]


def _read_model_file(folder: Path, index: int) -> dict[str, torch.Tensor]:
    from accelerate.utils import MODEL_NAME, SAFE_MODEL_NAME
    from safetensors.torch import load_file

    suffix = "" if index == 0 else f"_{index}"
    safe = folder / f"{SAFE_MODEL_NAME}{suffix}.safetensors"
    if safe.is_file():
        return load_file(safe, device="cpu")
    return torch.load(folder / f"{MODEL_NAME}{suffix}.bin", map_location="cpu", weights_only=True)


def save_final(
    model: torch.nn.Module,
    folder: Path,
    tokenizer: Any,
    base: str | None,
    revision: str | None = None,
    published: Path | None = None,
) -> None:
    """``folder/adapter/`` (``peft.PeftModel.from_pretrained`` loads it onto the base model, and
    ``AutoPeftModelFor*`` onto the base its config names) and a merged model in ``folder`` that
    ``AutoModelFor*.from_pretrained`` loads without peft; both with the tokenizer.

    ``base`` is what the adapter's config names as its base (:func:`base_reference`); None
    writes the base itself to ``folder/base`` and names that. ``model`` is the unwrapped peft
    model; call on the main process only. The merge happens on a copy (the trained model is
    left as it was), which costs one model's memory for a moment. ``published``: the folder's
    name once complete (it is written under a temporary one), which the adapter's config names.
    """
    folder = Path(folder)
    # The base written below has the resized embeddings; the adapter keeps only the new rows.
    model.save_pretrained(folder / ADAPTER_DIR, save_embedding_layers=False)
    tokenizer.save_pretrained(folder / ADAPTER_DIR)
    if base is None:
        copy.deepcopy(model).unload().save_pretrained(folder / BASE_DIR)
        tokenizer.save_pretrained(folder / BASE_DIR)
        base = str((Path(published or folder) / BASE_DIR).resolve())  # where it will be
        log.info("the adapter's base model (not loadable from model.name_or_path): %s", base)
    config_file = folder / ADAPTER_DIR / "adapter_config.json"
    adapter_config = json.loads(config_file.read_text())
    adapter_config["base_model_name_or_path"] = base
    adapter_config["revision"] = revision
    config_file.write_text(json.dumps(adapter_config, indent=2) + "\n")
    trained_in_full = model.peft_config[model.active_adapter].modules_to_save or []
    with _tied_notices_quiet(_tied_in(model, trained_in_full)):  # said by apply_lora
        merged = copy.deepcopy(model).merge_and_unload()
    state = merged.state_dict()
    leftovers = [k for k in state if _PEFT_KEY.search(k)]
    if leftovers:
        raise RuntimeError(f"the merged model still has peft weights: {leftovers[:3]}")
    _check_heads_merged(model, state)
    merged.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    log.info("saved the LoRA adapter (%s/) and the merged model", ADAPTER_DIR)


def gathered_copy(model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor]) -> Any:
    """An unsharded peft model holding ``state_dict``, the full state of the sharded (FSDP)
    peft ``model`` gathered to this process: built on the meta device from the model's config
    and peft config (nothing initialised, nothing gathered twice), then given those tensors,
    its tied parameters tied again and its non-persistent buffers (rotary frequencies) copied
    from ``model``, where FSDP leaves buffers whole."""
    from peft import get_peft_model

    base = model.get_base_model()
    adapter = model.active_adapter
    with torch.device("meta"):
        empty = type(base)(copy.deepcopy(base.config))
        skeleton = get_peft_model(empty, copy.deepcopy(model.peft_config[adapter]), adapter)
    # Built from the config, its generation config would lose the model's (stop tokens).
    skeleton.get_base_model().generation_config = copy.deepcopy(base.generation_config)
    tied: dict[int, list[str]] = {}  # shared parameters (tied embeddings), by name
    for name, parameter in skeleton.named_parameters(remove_duplicate=False):
        tied.setdefault(id(parameter), []).append(name)
    gathered = {name: tensor.detach() for name, tensor in state_dict.items()}
    skeleton.load_state_dict(gathered, strict=True, assign=True)
    # Loading by assignment gives each name its own tensor: share them again.
    for first, *others in (names for names in tied.values() if len(names) > 1):
        for name in others:
            owner, _, attr = name.rpartition(".")
            setattr(skeleton.get_submodule(owner), attr, skeleton.get_parameter(first))
    buffers = {_unwrapped_name(n): b for n, b in model.named_buffers()}
    for name, buffer in list(skeleton.named_buffers()):
        if buffer.is_meta:
            owner, _, attr = name.rpartition(".")
            setattr(skeleton.get_submodule(owner), attr, buffers[name].detach().cpu().clone())
    return skeleton


def _unwrapped_name(name: str) -> str:
    """A parameter or buffer name without the wrappers FSDP1 and activation checkpointing add."""
    return name.replace("_fsdp_wrapped_module.", "").replace("_checkpoint_wrapped_module.", "")


def _check_heads_merged(model: torch.nn.Module, merged: Mapping[str, torch.Tensor]) -> None:
    """The trained copies of the fully trained heads, not the original ones, must be saved."""
    from peft.utils import ModulesToSaveWrapper

    prefix = "base_model.model."
    for name, module in model.named_modules():
        if not isinstance(module, ModulesToSaveWrapper):
            continue
        trained = module.modules_to_save[module.active_adapters[0]]
        for key, value in trained.state_dict().items():
            merged_key = f"{name.removeprefix(prefix)}.{key}"
            if not torch.equal(merged[merged_key], value):
                raise RuntimeError(f"the merged model lost the trained head weight {merged_key}")
