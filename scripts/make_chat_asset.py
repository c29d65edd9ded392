#!/usr/bin/env python
"""Build the bundled conversations (``recipes/assets/conversations/squad/{train,dev}.jsonl``)
from the bundled SQuAD v1 slices, for ``recipe=llama_sft debug=smoke``, and the preference
pairs made from them (``recipes/assets/preferences/squad/``), for ``recipe=llama_dpo
debug=smoke``.

Each paragraph becomes one conversation in the ``messages`` layout: a fixed system message,
then for each of its first ``TURNS`` questions (those whose first answer lies within one
sentence) a user turn with that sentence and the question, and an assistant turn with the
answer; a second question is added only while the conversation's text stays within
``CHAR_BUDGET`` characters. The sentence, not the whole paragraph, and the budget keep most
conversations within the tiny Llama's 256 positions (the few longer ones exercise
``task.truncation``). Paragraphs with no such question are skipped. A pair is a conversation up to its last
question (the prompt), its answer (chosen) and a wrong span of the same sentence, as many words
long, right after the answer or else right before it (rejected): a near miss, not noise.
Nothing is random: the order is the
slices' own, so the files are byte-identical on every run.

Usage (from the repository root)::

    python scripts/make_chat_asset.py [--assets recipes/assets] [--out recipes/assets]
    # any official SQuAD v1.1 files (the SQuAD-as-chat runs in docs/results.md):
    python scripts/make_chat_asset.py --train-file train-v1.1.json --dev-file dev-v1.1.json \
        --out ./squad_chat        # writes ./squad_chat/{train,dev}.jsonl and pairs/
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_assets import REPO_ROOT, load_squad, sentence_spans

SYSTEM = "Answer the question with a short span of the passage."
TURNS = 2
CHAR_BUDGET = 400
SPLITS = {"train": "squad/v1/train.json", "dev": "squad/v1/dev.json"}
OUT = "conversations/squad"
PAIRS_OUT = "preferences/squad"


def answer_turns(paragraph: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(user text, answer) for the paragraph's questions whose first answer is inside one
    sentence, in the file's order."""
    context = paragraph["context"]
    spans = sentence_spans(context)
    for qa in paragraph["qas"]:
        answer = qa["answers"][0]
        start, end = answer["answer_start"], answer["answer_start"] + len(answer["text"])
        holding = [(s, e) for s, e in spans if s <= start and end <= e]
        if holding:
            sentence = context[slice(*holding[0])]
            yield f"{sentence}\nQuestion: {qa['question'].strip()}", answer["text"]


def conversations(squad: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for article in squad["data"]:
        for paragraph in article["paragraphs"]:
            turns = list(answer_turns(paragraph))[:TURNS]
            if not turns:
                continue
            messages = [{"role": "system", "content": SYSTEM}]
            used = 0
            for user, answer in turns:
                used += len(user) + len(answer)
                if len(messages) > 1 and used > CHAR_BUDGET:
                    break
                messages += [
                    {"role": "user", "content": user},
                    {"role": "assistant", "content": answer},
                ]
            yield {"messages": messages}


def wrong_span(sentence: str, answer: str) -> str | None:
    """A span of ``sentence`` as long as ``answer`` (in words) that does not overlap it: the
    words right after the answer, else right before; None when the sentence has no room."""
    words, size = sentence.split(), max(1, len(answer.split()))
    start = sentence.find(answer)
    if start < 0:
        return None
    first = len(sentence[:start].split())  # the answer's first word
    last = first + len(answer.split())
    for lo in (last, first - size):
        if lo >= 0 and lo + size <= len(words) and (lo >= last or lo + size <= first):
            span = " ".join(words[lo : lo + size]).strip(".,;:!?()\"'")
            if span and span.lower() != answer.lower():
                return span
    return None


def preference_pairs(rows: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Each conversation as a TRL preference pair: the conversation up to its last question is
    the prompt, the answer is chosen, a wrong span of the same sentence is rejected."""
    for row in rows:
        messages = row["messages"]
        sentence = messages[-2]["content"].split("\nQuestion: ")[0]
        answer = messages[-1]["content"]
        wrong = wrong_span(sentence, answer)
        if wrong is not None:
            yield {
                "prompt": messages[:-1],
                "chosen": [{"role": "assistant", "content": answer}],
                "rejected": [{"role": "assistant", "content": wrong}],
            }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--assets", type=Path, default=REPO_ROOT / "recipes" / "assets")
    parser.add_argument("--out", type=Path, default=None, help="default: --assets")
    parser.add_argument("--train-file", type=Path, help="an official SQuAD v1.1 JSON file")
    parser.add_argument("--dev-file", type=Path, help="an official SQuAD v1.1 JSON file")
    args = parser.parse_args()
    if args.train_file or args.dev_file:
        if not (args.train_file and args.dev_file and args.out):
            parser.error("--train-file needs --dev-file and --out")
        out, pairs_out = args.out, args.out / "pairs"
        sources = {"train": args.train_file, "dev": args.dev_file}
    else:
        root = args.out or args.assets
        out, pairs_out = root / OUT, root / PAIRS_OUT
        sources = {split: args.assets / source for split, source in SPLITS.items()}
    for split, source in sources.items():
        rows = list(conversations(load_squad(source)))
        _write(out / f"{split}.jsonl", rows, "conversations")
        _write(pairs_out / f"{split}.jsonl", list(preference_pairs(rows)), "preference pairs")


def _write(path: Path, rows: list[dict[str, Any]], what: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    path.write_text(lines, encoding="utf-8")
    print(f"{path}: {len(rows)} {what}")


if __name__ == "__main__":
    main()
