#!/usr/bin/env python
"""Build the bundled conversations (``recipes/assets/conversations/squad/{train,dev}.jsonl``)
from the bundled SQuAD v1 slices, for ``recipe=llama_sft debug=smoke``.

Each paragraph becomes one conversation in the ``messages`` layout: a fixed system message,
then for each of its first ``TURNS`` questions (those whose first answer lies within one
sentence) a user turn with that sentence and the question, and an assistant turn with the
answer; a second question is added only while the conversation's text stays within
``CHAR_BUDGET`` characters. The sentence, not the whole paragraph, and the budget keep most
conversations within the tiny Llama's 256 positions (the few longer ones exercise
``task.truncation``). Paragraphs with no such question are skipped. Nothing is random: the order is the
slices' own, so the files are byte-identical on every run.

Usage (from the repository root)::

    python scripts/make_chat_asset.py [--assets recipes/assets] [--out recipes/assets]
    # any official SQuAD v1.1 files (the SQuAD-as-chat runs in docs/results.md):
    python scripts/make_chat_asset.py --train-file train-v1.1.json --dev-file dev-v1.1.json \
        --out ./squad_chat        # writes ./squad_chat/{train,dev}.jsonl
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
        out, sources = args.out, {"train": args.train_file, "dev": args.dev_file}
    else:
        out = (args.out or args.assets) / OUT
        sources = {split: args.assets / source for split, source in SPLITS.items()}
    out.mkdir(parents=True, exist_ok=True)
    for split, source in sources.items():
        rows = list(conversations(load_squad(source)))
        lines = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
        (out / f"{split}.jsonl").write_text(lines, encoding="utf-8")
        print(f"{out / f'{split}.jsonl'}: {len(rows)} conversations")


if __name__ == "__main__":
    main()
