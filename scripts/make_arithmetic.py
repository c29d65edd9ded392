#!/usr/bin/env python
"""Write the bundled arithmetic prompts of the tool-calling GRPO example
(``recipe=llama_grpo_tools``): ``recipes/assets/arithmetic/{train,dev}.jsonl``, and with
``--model`` the smoke run's tiny tool caller ``recipes/assets/tiny-llama-tools/``.

Each row is TRL's prompt-only layout: ``prompt`` (a system turn that points at the calculator and
a user question such as "What is 37 * 12 + 5?") and ``answer`` (the integer result, which the
``tool_math_answer`` reward checks). Seeded: running it twice writes the same files.

The tiny tool caller is the bundled tiny Llama (random weights) taught, by plain next-token
training on the assistant turns of the train rows' conversations (the calculator called with the
question's expression, its result, the answer), to write Hermes tool calls in the qwen2_5 chat
template, so that a smoke run on the CPU has tool calls to run (a random tiny model never writes
one). It calls the tool in about every completion, not always with a right expression.

    python scripts/make_arithmetic.py [--out recipes/assets/arithmetic] [--train 256 --dev 32]
    python scripts/make_arithmetic.py --model --steps 800   (about 10 minutes on 2 CPU cores)
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


def conversation(row: dict) -> list[dict]:
    """The row's prompt, the calculator's call and result, and the answer."""
    expression = row["prompt"][-1]["content"].removeprefix("What is ").removesuffix("?")
    call = {"type": "function", "function": {"name": "calculator", "arguments": {}}}
    call["function"]["arguments"] = {"expression": expression}
    return [
        *row["prompt"],
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "calculator", "content": calculator(expression)},
        {"role": "assistant", "content": f"The answer is {row['answer']}."},
    ]


def make_model(rows_path: Path, out: Path, steps: int, seed: int) -> None:
    """Teach the tiny Llama the train rows' tool-calling conversations; save it to ``out``."""
    import torch
    from transformers import AutoModelForCausalLM

    from recipes.config import ASSETS, ModelConfig
    from recipes.model import load_tokenizer
    from recipes.tasks import chat

    torch.manual_seed(seed)
    tokenizer = load_tokenizer(ModelConfig(name_or_path=str(ASSETS / "tiny-llama")))
    chat_template = chat.use_template(tokenizer, "qwen2_5")
    tokenizer.eos_token = "<|im_end|>"  # the end of an assistant turn
    model = AutoModelForCausalLM.from_pretrained(
        ASSETS / "tiny-llama", max_position_embeddings=1024
    )
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    model.generation_config.eos_token_id = chat_template.stop_tokens
    rows = [json.loads(line) for line in rows_path.read_text().splitlines()]
    examples = [
        chat.tokenize_conversation(
            tokenizer, chat_template.template, conversation(r), tools=[calculator]
        )
        for r in rows
    ]
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    order = torch.Generator().manual_seed(seed)
    model.train()
    for step in range(steps):
        batch = [examples[i] for i in torch.randint(len(examples), (4,), generator=order)]
        width = max(len(e["input_ids"]) for e in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        labels = torch.full((len(batch), width), -100)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for k, e in enumerate(batch):
            n = len(e["input_ids"])
            ids[k, :n], labels[k, :n] = torch.tensor(e["input_ids"]), torch.tensor(e["labels"])
            mask[k, :n] = 1
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % 50 == 0 or step == steps - 1:
            print(f"step {step}: loss {loss.item():.3f}")
    model.config.max_position_embeddings = 1024
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    print(f"{out}: saved")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("recipes/assets/arithmetic"))
    parser.add_argument("--train", type=int, default=256)
    parser.add_argument("--dev", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", action="store_true", help="write the tiny tool caller")
    parser.add_argument("--model-out", type=Path, default=Path("recipes/assets/tiny-llama-tools"))
    parser.add_argument("--steps", type=int, default=800)
    args = parser.parse_args()
    if args.model:
        make_model(args.out / "train.jsonl", args.model_out, args.steps, args.seed)
        return
    rng = random.Random(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, count in (("train", args.train), ("dev", args.dev)):
        path = args.out / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows(count, rng)))
        print(f"{path}: {count} rows")


if __name__ == "__main__":
    main()
