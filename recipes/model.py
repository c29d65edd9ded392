"""The pretrained model and tokenizer a recipe names (``model.*``), loaded for training.

A missing or unreachable model fails with the key to fix; a GGUF file is dequantised into an
ordinary Hugging Face model; models without a padding token pad with their end-of-text token.
Weights load in fp32 unless ``model.dtype`` says otherwise: transformers 5 loads a checkpoint in
the dtype it was saved in (bf16 for most LLMs), which would make bf16 the master weights.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import transformers
from packaging.version import Version
from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerBase

from recipes import device
from recipes.config import ConfigError, ModelConfig, first_line
from recipes.log import get_logger

log = get_logger(__name__)

# What configs call the dropout on attention probabilities: BERT, RoBERTa, ELECTRA, MiniLM;
# DistilBERT, Llama, Qwen2, Mistral, GPT-Neo; GPT-2; a few others.
ATTENTION_DROPOUT_FIELDS = ("attention_probs_dropout_prob", "attention_dropout", "attn_pdrop")


def _source(cfg: ModelConfig) -> dict[str, Any]:
    """Which files of ``model.name_or_path`` to read: the revision, remote code, a GGUF file."""
    source: dict[str, Any] = {"revision": cfg.revision, "trust_remote_code": cfg.trust_remote_code}
    if cfg.gguf_file:
        source["gguf_file"] = cfg.gguf_file
    return source


def backend_kwargs() -> dict[str, Any]:
    """``from_pretrained`` arguments this backend needs: no hub kernels where the ``kernels``
    library cannot run (MUSA), in the transformers releases that take ``use_kernels``."""
    if device.hub_kernels_run_here() or not hasattr(transformers.PreTrainedModel, "use_kernels"):
        return {}
    return {"use_kernels": False}


def load_tokenizer(cfg: ModelConfig) -> PreTrainedTokenizerBase:
    """The model's tokenizer; a missing or unreachable model fails with the key to fix.

    A tokenizer without a padding token (GPT-2, Llama) pads with its end-of-text token, as is
    usual for these models; the attention mask keeps padding out of the loss.
    """
    try:
        tokenizer = AutoTokenizer.from_pretrained(cfg.name_or_path, **_source(cfg))
    except (OSError, ValueError, ImportError) as err:
        raise ConfigError(
            f"model.name_or_path={cfg.name_or_path}: cannot load a tokenizer ({first_line(err)}). "
            "Give a local save_pretrained folder, or a hub name while online."
        ) from None
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def config_overrides(cfg: ModelConfig) -> dict[str, Any]:
    """The config fields ``model.attention_dropout`` and ``model.config_overrides`` set, checked
    against the model's own config, so that a field it does not have fails with the key to fix
    before any data is read (transformers would hand an unknown field to the model's
    ``__init__``, or keep it on the config unused)."""
    if cfg.attention_dropout is None and not cfg.config_overrides:
        return {}
    try:
        config = AutoConfig.from_pretrained(cfg.name_or_path, **_source(cfg))
    except (OSError, ValueError, ImportError) as err:
        raise ConfigError(
            f"model.name_or_path={cfg.name_or_path}: cannot load its config ({first_line(err)})."
        ) from None
    changes: dict[str, Any] = {}
    if cfg.attention_dropout is not None:
        fields = [f for f in ATTENTION_DROPOUT_FIELDS if _is_rate(getattr(config, f, None))]
        if not fields:
            raise ConfigError(
                f"model.attention_dropout={cfg.attention_dropout}: {type(config).__name__} has "
                f"no attention-dropout field ({', '.join(ATTENTION_DROPOUT_FIELDS)}). Set "
                "model.attention_dropout=null, or name the field in model.config_overrides "
                f"(its dropout fields: {_dropout_fields(config)})."
            )
        changes.update(dict.fromkeys(fields, cfg.attention_dropout))
    for name, value in cfg.config_overrides.items():
        if not hasattr(config, name):
            raise ConfigError(
                f"model.config_overrides.{name}: {type(config).__name__} has no such field. "
                f"Name one of its fields (dropout: {_dropout_fields(config)}), or remove it."
            )
        changes[name] = value
    log.info("model config changes: %s", ", ".join(f"{k}={v}" for k, v in changes.items()))
    return changes


def _is_rate(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _dropout_fields(config: Any) -> str:
    names = [k for k, v in config.to_dict().items() if "drop" in k and _is_rate(v)]
    return ", ".join(names) or "none"


def load_model(
    cfg: ModelConfig,
    auto_class: Any,
    overrides: dict[str, Any] | None = None,
    trained_for: str | None = None,
    precision: str | None = None,
    **task_kwargs: Any,
) -> torch.nn.Module:
    """The pretrained model with the task's head (new heads are initialised by transformers).

    ``overrides`` are config fields to set (:func:`config_overrides`); ``task_kwargs`` are what
    the task learnt from its data (``num_labels``, say). ``trained_for``: the mode (``eval``,
    ``predict``) that uses the weights as they are, and refuses a checkpoint without the task's
    head (another task's model), whose random head would give scores that look valid. A GGUF file
    (``model.gguf_file``) is dequantised on load and rebuilt as a plain model, so training and
    the saved folder are those of an ordinary Hugging Face model. ``precision``: the run's
    mixed precision, which the device's default attention depends on
    (:func:`recipes.device.default_attn_implementation`).
    """
    attn = cfg.attn_implementation
    if attn == "auto":
        attn = device.default_attn_implementation(precision)
        if attn == "flash_attention_2":  # chosen for the device: say which kernel runs
            log.info("attention: flash_attention_2, %s", device.musa_flash_attention().detail)
    kwargs = {
        **_source(cfg),
        **_dtype(cfg.dtype),
        **backend_kwargs(),
        **(overrides or {}),
        **task_kwargs,
    }
    if cfg.ignore_mismatched_sizes:
        kwargs["ignore_mismatched_sizes"] = True
    kwargs["output_loading_info"] = True  # reported in one line (weights_report), not a table

    def load(attention: str) -> tuple[torch.nn.Module, dict]:
        with _library_report_left_out():
            return auto_class.from_pretrained(
                cfg.name_or_path, attn_implementation=attention, **kwargs
            )

    try:
        try:
            model, info = load(attn)
        except ValueError as err:
            if cfg.attn_implementation != "auto" or "attention" not in str(err).lower():
                raise
            # A model without flash support keeps the device's dense default before eager.
            fallback = "sdpa" if attn == "flash_attention_2" else "eager"
            log.warning(
                "%s does not support %s attention; using %s", cfg.name_or_path, attn, fallback
            )
            model, info = load(fallback)
    except (OSError, ValueError, ImportError) as err:
        raise ConfigError(
            f"model.name_or_path={cfg.name_or_path}: cannot load the model ({first_line(err)})."
        ) from None
    if trained_for and (info.get("missing_keys") or info.get("mismatched_keys")):
        _refuse_missing_weights(cfg, model, info, trained_for)
    if line := weights_report(info):
        log.info("%s: %s", cfg.name_or_path, line)
    if cfg.gguf_file:
        model = _plain_copy(model, auto_class)
    if model.config.pad_token_id is None and model.config.eos_token_id is not None:
        eos = model.config.eos_token_id
        model.config.pad_token_id = eos[0] if isinstance(eos, list) else eos
    return model


def _refuse_missing_weights(
    cfg: ModelConfig, model: torch.nn.Module, info: dict, trained_for: str
) -> None:
    """mode=eval / predict of a folder that lacks weights the task's head needs: one line
    saying why (a checkpoint to resume, or another task's model) and what to give instead."""
    if (Path(cfg.name_or_path).expanduser() / "trainer_state.json").is_file():
        why = (
            "it is a checkpoint, which holds what trains (a LoRA run's adapter) in "
            "accelerate's files: give it as resume=<that folder> instead"
        )
    else:
        # What its config.json says it is (``BertForQuestionAnswering``, say).
        saved_as = ", ".join(model.config.architectures or [type(model.config).__name__])
        why = (
            f"it was trained for another task ({saved_as}), and a random head gives "
            "meaningless results. Give a final/ of this recipe, or train one first"
        )
    raise ConfigError(
        f"mode={trained_for}: model.name_or_path={cfg.name_or_path} lacks weights this task "
        f"needs ({weights_report(info)}): {why}."
    )


# The transformers auto classes of the tasks' heads, and where transformers lists, per model
# type, the class each one builds (transformers.models.auto.modeling_auto, 4.x and 5.x alike).
HEAD_MAPPINGS = {
    "AutoModelForCausalLM": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "AutoModelForSeq2SeqLM": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "AutoModelForMaskedLM": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "AutoModelForSequenceClassification": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
    "AutoModelForTokenClassification": "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES",
    "AutoModelForQuestionAnswering": "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES",
    "AutoModelForMultipleChoice": "MODEL_FOR_MULTIPLE_CHOICE_MAPPING_NAMES",
}


def _head_classes(auto_name: str) -> dict[str, str]:
    """Model type -> the class ``auto_name`` builds for it (``llama`` -> ``LlamaForCausalLM``)."""
    from transformers.models.auto import modeling_auto

    names = getattr(modeling_auto, HEAD_MAPPINGS[auto_name], {})
    return {k: v if isinstance(v, str) else v[0] for k, v in names.items()}


def saved_config(cfg: ModelConfig) -> Any | None:
    """The config.json of ``model.name_or_path`` (None where it cannot be read: the load that
    follows says why)."""
    try:
        return AutoConfig.from_pretrained(cfg.name_or_path, **_source(cfg))
    except (OSError, ValueError, ImportError, KeyError):
        return None


def head_mismatch(
    config: Any, auto_class: Any, num_labels: int | None = None
) -> tuple[str, str] | None:
    """What a model saved as ``config`` is (its ``architectures``, its ``num_labels``) and what
    ``auto_class`` with ``num_labels`` scores, where the two differ (another task's head, a head
    of another size); None where they do not. An architecture that no task's head builds (a
    pre-training head, remote code) is left to the weights' check of :func:`load_model`."""
    expected = auto_class.__name__
    saved = list(getattr(config, "architectures", None) or [])
    if expected in HEAD_MAPPINGS and saved:
        other = [
            name
            for name in HEAD_MAPPINGS
            if name != expected and saved[0] in _head_classes(name).values()
        ]
        if saved[0] not in _head_classes(expected).values() and other:
            builds = _head_classes(expected).get(getattr(config, "model_type", ""), "a model")
            return f"a {saved[0]} ({other[0]})", f"{builds} ({expected})"
    has = getattr(config, "num_labels", None)
    if num_labels is not None and has is not None and has != num_labels:
        head = saved[0] if saved else type(config).__name__
        return f"a {head} with num_labels={has}", f"one with num_labels={num_labels}"
    return None


# transformers' own report of the weights a load left new, unused or resized: the 5.x LOAD
# REPORT table, 4.x's "Some weights of ..." sentences.
_LIBRARY_REPORT = re.compile(r"LOAD REPORT|^Some weights of ")


class _LeaveOutReport(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return _LIBRARY_REPORT.search(record.getMessage()) is None


@contextmanager
def _library_report_left_out() -> Iterator[None]:
    """transformers' load report dropped while ``from_pretrained`` runs: :func:`load_model`
    says what it says in one line."""
    logger = logging.getLogger("transformers.modeling_utils")
    leave_out = _LeaveOutReport()
    logger.addFilter(leave_out)
    try:
        yield
    finally:
        logger.removeFilter(leave_out)


def weights_report(info: Mapping[str, Any]) -> str:
    """One line from ``from_pretrained``'s loading info: the weights the checkpoint did not have
    (a new head, initialised at random and trained by the run) and those it had in another
    shape (re-initialised); empty when there are none. Checkpoint weights the model does not
    use (another task's head, a pre-training head) are expected and left out."""
    parts = []
    if info.get("missing_keys"):
        parts.append(f"new weights, initialised at random: {_weight_names(info['missing_keys'])}")
    if info.get("mismatched_keys"):
        resized = [k[0] if isinstance(k, (tuple, list)) else k for k in info["mismatched_keys"]]
        parts.append(f"re-initialised in a new shape: {_weight_names(resized)}")
    return "; ".join(parts)


def _weight_names(keys: Any, most: int = 6) -> str:
    """Weight names grouped by module (``qa_outputs.{bias,weight}``), the first ``most``."""
    modules: dict[str, list[str]] = {}
    for key in sorted(keys):
        module, _, leaf = key.rpartition(".")
        modules.setdefault(module, []).append(leaf)
    names = [
        f"{module}.{leaves[0]}" if len(leaves) == 1 else f"{module}.{{{','.join(leaves)}}}"
        for module, leaves in modules.items()
    ]
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return ", ".join(names[:most]) + more


def fit_to_tokenizer(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    new_tokens: list[int],
    stop_tokens: list[int],
) -> None:
    """Embedding rows for the tokens a task added to the tokenizer (initialised by transformers
    from the mean and covariance of the old ones; rounded up to a multiple of 64 rows, as TRL's
    ``clone_chat_template`` does), and ``stop_tokens`` besides EOS in the generation config."""
    rows = model.get_input_embeddings().num_embeddings
    if new_tokens and max(new_tokens) >= rows:
        model.resize_token_embeddings(len(tokenizer), pad_to_multiple_of=64)
        log.info(
            "token embeddings: %d -> %d rows for the tokenizer's %d tokens",
            rows,
            model.get_input_embeddings().num_embeddings,
            len(tokenizer),
        )
    if stop_tokens:
        eos = [*stop_tokens, *_ids(model.generation_config.eos_token_id)]
        eos += _ids(model.config.eos_token_id)
        model.generation_config.eos_token_id = list(dict.fromkeys(eos))


def share_tied_embeddings(model: torch.nn.Module) -> int:
    """Make every embedding module that holds the input embeddings' weight that very module;
    returns how many references were replaced. transformers 5 builds T5's encoder and decoder
    ``embed_tokens`` as modules of their own whose weight is tied to ``shared`` (4.x passed
    ``shared`` itself, as ``set_input_embeddings`` still does). FSDP2 shards a module's
    parameters in one group only: accelerate puts ``shared`` in a group of its own, the root then
    meets the same weight through the other two modules and refuses it ("shared with a parameter
    already managed by another FSDP group"). One module per weight is the same model, numbers
    and saved keys included."""
    embedding = model.get_input_embeddings()
    weight = getattr(embedding, "weight", None)
    if weight is None:
        return 0
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            tied = isinstance(child, torch.nn.Embedding) and child.weight is weight
            if tied and child is not embedding:
                setattr(parent, name, embedding)
                replaced += 1
    return replaced


def retie_gathered(model: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """``state_dict``, gathered whole from the sharded (FSDP) ``model``, with each tied weight's
    other names holding its first name's tensor again. The gather gives every name a tensor of
    its own, and ``save_pretrained`` drops a tied name only where the tensors are shared: T5's
    final/ would otherwise hold its embedding four times (shared, both stacks, lm_head) where
    one process saves it once."""
    names: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        clean = name.replace("_fsdp_wrapped_module.", "").replace("_checkpoint_wrapped_module.", "")
        names.setdefault(id(parameter), []).append(clean)
    for first, *others in (group for group in names.values() if len(group) > 1):
        if first in state_dict:
            for name in others:
                state_dict[name] = state_dict[first]


def _ids(value: int | list[int] | None) -> list[int]:
    return [] if value is None else list(value) if isinstance(value, list) else [value]


def _dtype(choice: str) -> dict[str, Any]:
    """``from_pretrained``'s dtype argument for ``model.dtype`` (``torch_dtype`` before
    transformers 4.56, ``dtype`` since)."""
    value = "auto" if choice == "auto" else getattr(torch, choice)
    name = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"
    return {name: value}


def weights_summary(model: torch.nn.Module, cfg: ModelConfig, mixed_precision: str) -> str:
    """Which dtypes the trainable and frozen weights are in and what autocast adds, for the log;
    refuses fp16 trainable weights under fp16 autocast (the gradient scaler cannot unscale
    fp16 gradients)."""
    trainable = {p.dtype for p in model.parameters() if p.requires_grad}
    frozen = {p.dtype for p in model.parameters() if not p.requires_grad}
    if torch.float16 in trainable and mixed_precision == "fp16":
        raise ConfigError(
            f"model.dtype={cfg.dtype} with trainer.mixed_precision=fp16: fp16 trainable weights "
            "cannot be trained with the fp16 gradient scaler. Use model.dtype=float32 (or "
            "bfloat16 with trainer.mixed_precision=bf16)."
        )
    line = f"weights: trainable in {_names(trainable) or 'none'}"
    if frozen:
        line += f", frozen in {_names(frozen)}"
    line += f" (model.dtype={cfg.dtype}); autocast: {mixed_precision}"
    if trainable - {torch.float32}:
        line += (
            ". Pure low-precision training: master weights, gradients and optimizer state are not "
            "fp32, so small updates round away (model.dtype=float32 keeps fp32 master weights)"
        )
    return line


def _names(dtypes: set[torch.dtype]) -> str:
    return "/".join(sorted(str(d).removeprefix("torch.") for d in dtypes))


def _plain_copy(model: torch.nn.Module, auto_class: Any) -> torch.nn.Module:
    """The same weights in a model built from its config without the GGUF quantisation record
    (transformers refuses to ``save_pretrained`` a model loaded from GGUF)."""
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = auto_class.from_config(config, attn_implementation=config._attn_implementation)
    plain.load_state_dict(model.state_dict())
    return plain.to(next(model.parameters()).dtype)
