"""Builds the bundled multiple-choice slices (run from the repository root; deterministic).

    python recipes/assets/multiple-choice/build.py --hellaswag hellaswag_val_full.txt

``hellaswag/``: the 3,243 ActivityNet rows (the SWAG-style captions; the WikiHow rows follow
them) of HellaSwag's validation set, as klosax/hellaswag_text_data's ``hellaswag_val_full.txt``
holds it (6 lines a row: ``activity_label: ctx``, label, 4 endings), in SWAG's layout.
``squad/``: the generic layout (question, ``choices`` list, label as the choice's text), built
from the bundled SQuAD v1.1 slices: which sentence of the paragraph answers the question.
See README.md in each folder.
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

HERE = Path(__file__).resolve().parents[1] / "recipes" / "assets" / "multiple-choice"
ACTIVITYNET_ROWS = 3243  # HellaSwag val rows 0..3242 are ActivityNet; WikiHow rows follow
DEV_ROWS = 400
TRAIN_ROWS = 2000
MAX_CHOICES = 4
SQUAD_ROWS = {"train": 300, "dev": 80}  # the first questions of the bundled slices
SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9\"'(])")


def hellaswag(source: Path) -> None:
    lines = source.read_text(encoding="utf-8").split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    assert len(lines) % 6 == 0, len(lines)
    rows = []
    for ind in range(ACTIVITYNET_ROWS):
        head, label, *endings = lines[6 * ind : 6 * ind + 6]
        activity, sep, ctx = head.partition(": ")
        assert sep and len(endings) == 4, ind
        # HellaSwag's ctx is ctx_a + " " + ctx_b, ctx_b the lower-case start of the sentence
        # the ending completes ("the lady"): SWAG's sent1 / sent2.
        cut = ctx.rfind(". ")
        sent1, sent2 = (ctx[: cut + 1], ctx[cut + 2 :]) if cut >= 0 else ("", ctx)
        if not sent2 or not sent2[0].islower():
            sent1, sent2 = ctx, ""
        if not sent1:
            sent1, sent2 = ctx, ""
        row = {"ind": ind, "activity_label": activity, "sent1": sent1, "sent2": sent2}
        row.update({f"ending{i}": e for i, e in enumerate(endings)})
        row["label"] = int(label)
        rows.append(row)
    order = list(range(len(rows)))
    random.Random(0).shuffle(order)
    dev = sorted(order[:DEV_ROWS])
    train = sorted(order[DEV_ROWS : DEV_ROWS + TRAIN_ROWS])
    write(HERE / "hellaswag" / "train.jsonl", [rows[i] for i in train])
    write(HERE / "hellaswag" / "dev.jsonl", [rows[i] for i in dev])


def squad(split: str, out: str, rng: random.Random) -> None:
    articles = json.loads((HERE.parent / "squad" / "v1" / f"{split}.json").read_text())["data"]
    rows = []
    for article in articles:
        for paragraph in article["paragraphs"]:
            context = paragraph["context"]
            spans, start = [], 0
            for piece in SENTENCE_END.split(context):
                begin = context.index(piece, start)
                spans.append((begin, begin + len(piece)))
                start = begin + len(piece)
            if len(spans) < 2:
                continue
            for qa in paragraph["qas"]:
                answer = qa["answers"][0]
                at = answer["answer_start"]
                gold = next(i for i, (b, e) in enumerate(spans) if b <= at < e)
                if at + len(answer["text"]) > spans[gold][1]:
                    continue  # the answer runs over a sentence break
                others = [i for i in range(len(spans)) if i != gold]
                rng.shuffle(others)
                picked = sorted([gold, *others[: MAX_CHOICES - 1]])
                choices = [context[b:e] for b, e in (spans[i] for i in picked)]
                if len(set(choices)) != len(choices):
                    continue
                if len(rows) == SQUAD_ROWS[split]:
                    break
                rows.append(
                    {
                        "id": qa["id"],
                        "question": qa["question"],
                        "choices": choices,
                        "label": context[slice(*spans[gold])],
                    }
                )
    write(HERE / "squad" / out, rows)


def write(path: Path, rows: list[dict]) -> None:
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(f"{path}: {len(rows)} rows, {path.stat().st_size:,} bytes")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--hellaswag", type=Path, required=True)
    args = parser.parse_args()
    hellaswag(args.hellaswag)
    rng = random.Random(0)
    squad("train", "train.jsonl", rng)
    squad("dev", "dev.jsonl", rng)
