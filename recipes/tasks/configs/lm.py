"""``task=clm`` and ``task=mlm``: language-model fine-tuning on packed blocks of text."""

from __future__ import annotations

from dataclasses import dataclass

from recipes.tasks.configs import TaskConfig, at_least, feature

_BLOCK = ("block_size", at_least(2), "must be at least 2 tokens")


@dataclass
class ClmConfig(TaskConfig):
    """Causal language modelling: texts packed into blocks, next-token loss, perplexity."""

    NAME = "clm"
    RANGES = (_BLOCK, ("sample_max_new_tokens", at_least(1), "must be at least 1"))

    _target_: str = "recipes.tasks.lm.CausalLanguageModeling"
    block_size: int = feature(1024)  # tokens per sequence (at most the model's positions)
    # End each text with EOS before packing (for separate documents; off for line-by-line text
    # such as a play).
    add_eos_token: bool = feature(False)
    sample_prompt: str | None = "The"  # greedily continued after training and logged; null: none
    sample_max_new_tokens: int = 40


@dataclass
class MlmConfig(TaskConfig):
    """Masked language modelling (BERT): a share of the tokens predicted (80 % [MASK], 10 % a
    random token, 10 % kept)."""

    NAME = "mlm"
    RANGES = (
        _BLOCK,
        ("mlm_probability", lambda v: 0 < v < 1, "must be in (0, 1)"),
    )

    _target_: str = "recipes.tasks.lm.MaskedLanguageModeling"
    block_size: int = feature(512)
    mlm_probability: float = feature(0.15)
    # Mask whole words, not single pieces (transformers then uses [MASK] only).
    whole_word_mask: bool = feature(False)
    # The evaluation split is masked once, with this seed, the same way in every evaluation (and
    # on every process count).
    eval_mask_seed: int = feature(0)
