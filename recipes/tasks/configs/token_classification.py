"""``task=token_classification``: tag every word of a sentence (NER, POS, chunking), as run_ner."""

from __future__ import annotations

from dataclasses import dataclass

from recipes.errors import ConfigError
from recipes.tasks.configs import TaskConfig, at_least, feature

SCHEMES = ("IOB1", "IOB2", "IOE1", "IOE2", "IOBES", "BILOU")
LONG_SENTENCES = ("window", "truncate")
# The tag prefixes each strict scheme allows, and those that must continue an entity of the same
# type (an I- after O is a new entity in IOB1 / IOE1 / IOE2, an error in the others).
SCHEME_PREFIXES = {
    "IOB1": ("BI", ""),
    "IOB2": ("BI", "I"),
    "IOE1": ("IE", ""),
    "IOE2": ("IE", ""),
    "IOBES": ("BIES", "IE"),
    "BILOU": ("BILU", "IL"),
}


def prefix_error(tag: str, scheme: str) -> bool:
    """Whether ``tag`` is neither O nor <prefix>-<type> with a prefix ``scheme`` allows."""
    if tag == "O":
        return False
    prefix, _, kind = tag.partition("-")
    return not kind or len(prefix) != 1 or prefix not in SCHEME_PREFIXES[scheme][0]


@dataclass
class TokenClassificationConfig(TaskConfig):
    """Entity-level precision / recall / F1 with seqeval, token accuracy and per-type F1, scored
    over words (each word's first sub-word)."""

    NAME = "token_classification"
    RANGES = (("max_seq_length", at_least(4), "must be at least 4"),)

    _target_: str = "recipes.tasks.token_classification.TokenClassification"
    max_seq_length: int = feature(128)
    # Word labels on the first sub-word only (run_ner's default); true: on every sub-word, B-X
    # becoming I-X after the first where I-X exists. Scores stay over words either way.
    label_all_tokens: bool = feature(False)
    # A sentence longer than max_seq_length sub-words: window (split into overlapping windows,
    # each word trained and scored once, in the window where it has the most context) or
    # truncate (its last words get no training and are scored as predicted O; run_ner drops
    # them). A warning counts the sentences either way.
    long_sentences: str = feature("window")
    stride: int = feature(32)  # sub-words shared by consecutive windows (long_sentences=window)
    # null: seqeval's default (lenient, conlleval-like, as run_ner); IOB1 | IOB2 | IOE1 | IOE2 |
    # IOBES | BILOU: seqeval's strict mode with that scheme, and tags that break it are refused.
    scheme: str | None = None
    # null: the label names from the data set's features (ClassLabel), else the sorted set of the
    # training tags (run_ner); a list fixes names and order (tags given as ids index into it).
    label_list: list[str] | None = None

    @property
    def strict_scheme(self) -> str | None:
        """task.scheme in capitals (None: seqeval's lenient reading)."""
        return None if self.scheme is None else str(self.scheme).upper()

    def check(self) -> None:
        self.choose("long_sentences", LONG_SENTENCES, "window or truncate")
        if not 0 <= self.stride <= self.max_seq_length // 2:
            raise ConfigError(
                f"task.stride={self.stride}: the sub-words shared by consecutive windows must be "
                f"between 0 and half of task.max_seq_length ({self.max_seq_length // 2})."
            )
        scheme = self.strict_scheme
        if scheme is not None and scheme not in SCHEMES:
            raise ConfigError(
                f"task.scheme={self.scheme!r}: choose null (seqeval's lenient default, as "
                f"run_ner) or one of {', '.join(SCHEMES)}."
            )
        if self.label_list is None:
            return
        names = [str(n) for n in self.label_list]
        if not names or len(set(names)) != len(names):
            raise ConfigError(
                f"task.label_list={names}: give each tag once (or null: the tags of the "
                "training data)."
            )
        bad = [n for n in names if scheme is not None and prefix_error(n, scheme)]
        if bad:
            raise ConfigError(
                f"task.label_list: {', '.join(bad)} do not fit task.scheme={self.scheme} "
                f"(it allows O and {', '.join(SCHEME_PREFIXES[scheme][0])}-<type>)."
            )
