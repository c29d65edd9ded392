"""``task=gkd``: generalized knowledge distillation (on-policy distillation) of a chat model from
a teacher, as TRL 1.16's ``GKDTrainer`` (trl/experimental/gkd/gkd_trainer.py, gkd_config.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from recipes.errors import ConfigError
from recipes.tasks.configs import at_least, feature, within
from recipes.tasks.configs.sft import (
    CHAT_RANGES,
    FORMATS,
    TRUNCATION,
    ChatConfig,
    check_text_rows,
)

TEACHER_DTYPES = ("auto", "float32", "bfloat16", "float16")
GKD_TRUNCATION = ("keep_end", *TRUNCATION)


@dataclass
class GkdConfig(ChatConfig):
    """GKD on conversations: the student learns the teacher's next-token distribution on the
    assistant's tokens (the generalized Jensen-Shannon divergence, ``beta``), on the dataset's
    completions, the student's own samples (``lmbda``) or the teacher's (``seq_kd``).
    TRL's defaults, from GKDConfig."""

    NAME = "gkd"
    FORMATS = FORMATS
    RANGES = (
        *CHAT_RANGES,
        ("lmbda", within(0.0, 1.0), "must be in [0, 1] (the share of on-policy rows)"),
        ("beta", within(0.0, 1.0), "must be in [0, 1] (0: forward KL, 1: reverse KL)"),
        ("temperature", lambda v: v is not None and v > 0, "must be > 0 (TRL's default is 0.9)"),
        ("max_new_tokens", at_least(1), "must be at least 1"),
    )

    _target_: str = "recipes.tasks.gkd.KnowledgeDistillation"
    # Row layout: auto (detected per row), messages, sharegpt, alpaca, dolly, prompt_completion.
    format: str = feature("auto")
    # Tokens per conversation; a sampled completion stops there too (at most the model's
    # positions).
    max_seq_length: int = feature(1024)
    # A longer conversation: keep_end keeps its last max_seq_length tokens, as TRL's GKD
    # collator (the reply trains, the oldest context goes; dropped where no prompt token is
    # left); truncate cuts its end (as task=sft: a row whose prompt fills the length is
    # dropped); drop leaves it out.
    truncation: str = feature("keep_end")
    # The teacher: a causal LM's folder or hub name (an SFT run's final/, a larger model of the
    # same vocabulary); null: the student's starting weights (TRL's default: the model itself,
    # with LoRA its adapter disabled), which only teaches where the student has moved from it.
    teacher_model: str | None = None
    # The teacher's weights' dtype, as model.dtype: float32, bfloat16 / float16 (half a large
    # teacher's memory), auto (its checkpoint's).
    teacher_dtype: str = "float32"
    teacher_gguf_file: str | None = None  # a .gguf file in teacher_model, as model.gguf_file
    # Share of training rows whose completion is replaced by the student's own sample
    # (on-policy); TRL's default 0.5 (per batch there, per row here: docs/configuration.md).
    lmbda: float = 0.5
    # Generalized JSD's interpolation: 0 the forward KL(teacher||student), 1 the reverse
    # KL(student||teacher), between them the JSD of the beta-mixture; TRL's default 0.5.
    beta: float = 0.5
    # Sampling temperature of on-policy and seq_kd completions (top_k off, top_p 1, as TRL); the
    # loss is at temperature 1, as TRL's GKD compute_loss. TRL's default 0.9.
    temperature: float = 0.9
    max_new_tokens: int = 128  # tokens per sampled completion (TRL's default)
    # true: rows not drawn on-policy take the teacher's sampled completion (sequence-level KD)
    # instead of the dataset's; TRL's default false.
    seq_kd: bool = False
    # true: the teacher's log-probs on the dataset's completions computed once before training
    # and cached (full vocabulary, fp32: labelled tokens x vocab x 4 bytes); needs lmbda=0 and
    # seq_kd=false, and at most precompute_max_gb on disk.
    precompute_teacher: bool = False
    precompute_max_gb: float = 2.0  # refuse a precomputed teacher larger than this
    disable_dropout: bool = True  # as TRL: the student's distributions are not a noisy draw

    def check(self) -> None:
        self.check_format()
        check_text_rows(self.text_rows)
        self.choose(
            "truncation",
            GKD_TRUNCATION,
            "keep_end (keep the last max_seq_length tokens, as TRL's GKD), truncate (cut the end) "
            "or drop",
        )
        self.choose("teacher_dtype", TEACHER_DTYPES)
        teacher = self.teacher_model
        if teacher is not None and _local(teacher) and not Path(teacher).expanduser().is_dir():
            raise ConfigError(
                f"task.teacher_model={teacher}: no such folder. Point it at a folder written by "
                "save_pretrained (with config.json), such as an SFT run's final/, or at a hub "
                "model name."
            )
        if self.teacher_gguf_file and self.teacher_model is None:
            raise ConfigError(
                f"task.teacher_gguf_file={self.teacher_gguf_file} names a file of "
                "task.teacher_model, which is unset; set task.teacher_model to its folder."
            )
        if self.precompute_teacher and (self.lmbda > 0 or self.seq_kd):
            raise ConfigError(
                f"task.precompute_teacher=true with task.lmbda={self.lmbda}, "
                f"task.seq_kd={str(self.seq_kd).lower()}: sampled completions are not known "
                "before training, so the teacher must run on the device; set task.lmbda=0 and "
                "task.seq_kd=false, or task.precompute_teacher=false."
            )


def _local(name: str) -> bool:
    """Whether ``name`` is a path rather than a hub id (``org/model``): it starts as a path
    does, has more than one ``/``, or exists (as model.name_or_path is told apart)."""
    return (
        name.startswith((".", "/", "~")) or name.count("/") > 1 or Path(name).expanduser().exists()
    )
