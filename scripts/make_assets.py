#!/usr/bin/env python
"""Regenerate the bundled offline assets under ``recipes/assets/``.

The project's default / smoke runs must work offline on a fresh machine, so it ships:

* ``squad/v1/{train,dev}.json`` and ``squad/v2/{train,dev}.json``: small slices of real SQuAD
  data (CC BY-SA 4.0, Rajpurkar et al.) in the official nested SQuAD JSON format. Whole
  articles are kept and no text is changed; every ``answer_start`` is checked against its text.
* ``tiny-bert/``: a tiny randomly initialised ``BertForQuestionAnswering`` (2 layers, hidden
  128) with an uncased WordPiece tokenizer trained on the SQuAD contexts and questions.

Everything is deterministic: article selection uses a fixed seed, the tokenizer is trained on a
fixed, ordered corpus, and the model weights are drawn from a ``torch.Generator`` seeded with 0
in sorted parameter-name order (so the weights do not depend on the transformers version's own
initialisation code). ``config.json`` and ``tokenizer_config.json`` are written by hand so that
they load on transformers 4.40+ as well as 5.x.

Usage (from the repository root)::

    python scripts/make_assets.py [--shared-data ../shared/data] [--out recipes/assets]

The sources are the files in ``../shared/data/squad/`` (see ``recipes/assets/README.md``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
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
    return vocab_size


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


def make_model(folder: Path, vocab_size: int) -> int:
    """Build, initialise and save the tiny ``BertForQuestionAnswering``; return #parameters."""
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
    folder.mkdir(parents=True, exist_ok=True)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    write_json(folder / "config.json", config_dict)
    return sum(v.numel() for v in state.values())


# --------------------------------------------------------------------------------------------
# Helpers / CLI
# --------------------------------------------------------------------------------------------


def write_json(path: Path, obj: JsonDict) -> None:
    """Write a small config file as indented UTF-8 JSON, keys in insertion order."""
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def sha256(path: Path) -> str:
    """Hex SHA-256 of a file."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line arguments."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--shared-data",
        type=Path,
        default=REPO_ROOT.parent / "shared" / "data",
        help="folder holding squad/{train-v1.1-subset,dev-v1.1-part1,dev-v2.0-sample}.json",
    )
    parser.add_argument(
        "--out", type=Path, default=REPO_ROOT / "recipes" / "assets", help="assets folder"
    )
    parser.add_argument("--skip-model", action="store_true", help="only write the SQuAD slices")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Regenerate all assets and print a summary with file hashes."""
    args = parse_args(argv)
    src = args.shared_data / "squad"
    if not src.is_dir():
        print(f"error: {src} not found (pass --shared-data)", file=sys.stderr)
        return 2
    make_squad(src, args.out)
    if not args.skip_model:
        folder = args.out / "tiny-bert"
        vocab_size = make_tokenizer(src, folder)
        n_params = make_model(folder, vocab_size)
        print(f"tiny-bert: vocab {vocab_size:,}, {n_params:,} parameters")
    for path in sorted(p for p in args.out.rglob("*") if p.is_file() and p.name != "README.md"):
        rel = path.relative_to(args.out)
        print(f"  {sha256(path)[:16]}  {path.stat().st_size:>9,}  {rel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
