#!/usr/bin/env python
"""Write the bundled arithmetic prompts of the tool-calling GRPO example
(``recipe=llama_grpo_tools``): ``recipes/assets/arithmetic/{train,dev}.jsonl``.

Each row is TRL's prompt-only layout: ``prompt`` (a system turn that points at the calculator and
a user question such as "What is 37 * 12 + 5?") and ``answer`` (the integer result, which the
``math_answer`` reward checks). Seeded: running it twice writes the same files.

    python scripts/make_arithmetic.py [--out recipes/assets/arithmetic] [--train 256 --dev 32]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from recipes.tools import calculator

SYSTEM = "Use the calculator tool for arithmetic, then give the final answer as a number."
OPERATORS = ("+", "-", "*")


def question(rng: random.Random) -> tuple[str, int]:
    """An expression of two or three integers (results stay integers: no division)."""
    terms = [str(rng.randint(2, 99)) for _ in range(rng.choice((2, 3)))]
    expression = terms[0]
    for term in terms[1:]:
        expression += f" {rng.choice(OPERATORS)} {term}"
    return expression, int(calculator(expression))  # the example's own tool


def rows(count: int, rng: random.Random) -> list[dict]:
    out = []
    for _ in range(count):
        expression, answer = question(rng)
        prompt = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"What is {expression}?"},
        ]
        out.append({"prompt": prompt, "answer": str(answer)})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("recipes/assets/arithmetic"))
    parser.add_argument("--train", type=int, default=256)
    parser.add_argument("--dev", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, count in (("train", args.train), ("dev", args.dev)):
        path = args.out / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows(count, rng)))
        print(f"{path}: {count} rows")


if __name__ == "__main__":
    main()
