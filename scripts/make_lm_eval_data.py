"""Builds the SQuAD rows of the bundled lm-eval task ``recipes_squad`` (run from the repository
root; deterministic, reads only the bundled SQuAD v1.1 slices).

    python scripts/make_lm_eval_data.py

``recipes/assets/lm_eval/squad/dev.jsonl``: every question of ``squad/v1/dev.json`` (3 articles),
one row each; ``train.jsonl``: the questions of the train slice's smallest article
(Southern_Europe), which the few-shot examples are drawn from. Each row: SQuAD's ``id``,
``title``, ``context``, ``question`` and ``answers`` (every gold answer's text, in file order).
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SQUAD = ROOT / "recipes" / "assets" / "squad" / "v1"
OUT = ROOT / "recipes" / "assets" / "lm_eval" / "squad"
FEWSHOT_ARTICLE = "Southern_Europe"


def questions(squad_file: Path, titles: set[str] | None = None) -> list[dict]:
    rows = []
    for article in json.loads(squad_file.read_text(encoding="utf-8"))["data"]:
        if titles is not None and article["title"] not in titles:
            continue
        for paragraph in article["paragraphs"]:
            for qa in paragraph["qas"]:
                rows.append(
                    {
                        "id": qa["id"],
                        "title": article["title"],
                        "context": paragraph["context"],
                        "question": qa["question"],
                        "answers": [answer["text"] for answer in qa["answers"]],
                    }
                )
    return rows


def write(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    print(f"{path.relative_to(ROOT)}: {len(rows)} rows")


def main() -> None:
    write(OUT / "dev.jsonl", questions(SQUAD / "dev.json"))
    write(OUT / "train.jsonl", questions(SQUAD / "train.json", {FEWSHOT_ARTICLE}))


if __name__ == "__main__":
    main()
