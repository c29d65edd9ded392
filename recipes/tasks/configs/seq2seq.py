"""``task=seq2seq``: summarization, translation and generative QA with an encoder-decoder model
(T5, BART, EncoderDecoderModel), evaluated by generating, as run_summarization /
run_translation / run_seq2seq_qa do. The source and target columns and the source prefix are
``data.source_column`` / ``data.target_column`` / ``data.source_prefix``; the decoding is the
run's ``generation.*`` (num_beams, length_penalty, max_new_tokens, do_sample, ...), saved as
final/generation_config.json: not a task setting of its own."""

from __future__ import annotations

from dataclasses import dataclass

from recipes.tasks.configs import TaskConfig, at_least, feature, null_or_at_least

# Each metric and the score of it that ranks checkpoints.
METRICS = {"rouge": "rougeL", "bleu": "bleu", "squad": "f1"}
_TOKENS = "must be a whole number of tokens, at least 2 (a token and the end of sequence)"


@dataclass
class Seq2SeqConfig(TaskConfig):
    """Encoder-decoder fine-tuning scored by generation: ROUGE, sacreBLEU or SQuAD EM / F1, plus
    the evaluation loss and the mean generated length."""

    NAME = "seq2seq"
    RANGES = (
        ("max_source_length", at_least(2), _TOKENS),
        ("max_target_length", at_least(2), _TOKENS),
        ("eval_max_target_length", null_or_at_least(2), _TOKENS),
    )

    _target_: str = "recipes.tasks.seq2seq.SequenceToSequence"
    # rouge (ROUGE-1/2/L/Lsum, ranks by rougeL), bleu (sacreBLEU + chrF), squad (EM / F1 against
    # every answer; with no data.source_column it reads SQuAD data: question, context, answers).
    # It picks the data layout, which the features' cache key holds beside the columns.
    metric: str = "rouge"
    max_source_length: int = feature(1024)  # source tokens, prefix included; longer are cut
    max_target_length: int = feature(128)  # target tokens trained on; longer targets are cut
    # Evaluation targets and generated length (unless generation.max_new_tokens); null:
    # max_target_length (run_summarization's val_max_target_length).
    eval_max_target_length: int | None = feature(None)

    def check(self) -> None:
        self.choose(
            "metric",
            METRICS,
            "rouge (summarization), bleu (translation) or squad (generative QA, EM / F1)",
        )
