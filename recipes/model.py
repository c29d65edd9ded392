"""The pretrained model and tokenizer a recipe names (``model.*``), loaded for training.

A missing or unreachable model fails with the key to fix; a GGUF file is dequantised into an
ordinary Hugging Face model; models without a padding token pad with their end-of-text token.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from recipes import device
from recipes.config import ConfigError, ModelConfig, first_line
from recipes.log import get_logger

log = get_logger(__name__)


def load_tokenizer(cfg: ModelConfig) -> PreTrainedTokenizerBase:
    """The model's tokenizer; a missing or unreachable model fails with the key to fix.

    A tokenizer without a padding token (GPT-2, Llama) pads with its end-of-text token, as is
    usual for these models; the attention mask keeps padding out of the loss.
    """
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            cfg.name_or_path,
            revision=cfg.revision,
            trust_remote_code=cfg.trust_remote_code,
            **({"gguf_file": cfg.gguf_file} if cfg.gguf_file else {}),
        )
    except (OSError, ValueError, ImportError) as err:
        raise ConfigError(
            f"model.name_or_path={cfg.name_or_path}: cannot load a tokenizer ({first_line(err)}). "
            "Give a local save_pretrained folder, or a hub name while online."
        ) from None
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(cfg: ModelConfig, auto_class: Any, **task_kwargs: Any) -> torch.nn.Module:
    """The pretrained model with the task's head (new heads are initialised by transformers).

    ``task_kwargs`` are what the task learnt from its data (``num_labels``, say). A GGUF file
    (``model.gguf_file``) is dequantised on load and rebuilt as a plain model, so training and
    the saved folder are those of an ordinary Hugging Face model.
    """
    attn = cfg.attn_implementation
    if attn == "auto":
        attn = device.default_attn_implementation()
    kwargs = {"revision": cfg.revision, "trust_remote_code": cfg.trust_remote_code, **task_kwargs}
    if cfg.ignore_mismatched_sizes:
        kwargs["ignore_mismatched_sizes"] = True
    if cfg.gguf_file:
        kwargs["gguf_file"] = cfg.gguf_file
    try:
        try:
            model = auto_class.from_pretrained(cfg.name_or_path, attn_implementation=attn, **kwargs)
        except ValueError as err:
            if cfg.attn_implementation != "auto" or "attention" not in str(err).lower():
                raise
            log.warning("%s does not support %s attention; using eager", cfg.name_or_path, attn)
            model = auto_class.from_pretrained(
                cfg.name_or_path, attn_implementation="eager", **kwargs
            )
    except (OSError, ValueError, ImportError) as err:
        raise ConfigError(
            f"model.name_or_path={cfg.name_or_path}: cannot load the model ({first_line(err)})."
        ) from None
    if cfg.gguf_file:
        model = _plain_copy(model, auto_class)
    if model.config.pad_token_id is None and model.config.eos_token_id is not None:
        eos = model.config.eos_token_id
        model.config.pad_token_id = eos[0] if isinstance(eos, list) else eos
    return model


def _plain_copy(model: torch.nn.Module, auto_class: Any) -> torch.nn.Module:
    """The same weights in a model built from its config without the GGUF quantisation record
    (transformers refuses to ``save_pretrained`` a model loaded from GGUF)."""
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = auto_class.from_config(config, attn_implementation=config._attn_implementation)
    plain.load_state_dict(model.state_dict())
    return plain.to(next(model.parameters()).dtype)
