"""Chat with a trained chat model (a run's ``final/``) in the terminal.

    python -m recipes.chat outputs/llama_sft/<run>/final
    python -m recipes.chat <final/> --system "Answer briefly." --temperature 0.7

Each reply is generated from the whole conversation so far, rendered with the chat template
the run trained with (saved with ``final/``'s tokenizer) by the same code as training and
``mode=predict`` (:mod:`recipes.tasks.chat`), and it stops at the template's end of turn (the
``generation_config`` the run saved). Greedy by default; ``--temperature`` > 0 samples. The
device is accelerate's (MUSA, CUDA or CPU). Type ``/reset`` to start over, ``/exit`` or Ctrl-D to
leave. Piped input works too (one user turn per line; the replies are printed one per turn).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

PROMPT = "you> "


def main(argv: Sequence[str] | None = None) -> None:
    from recipes.config import ENGINES

    parser = argparse.ArgumentParser(prog="python -m recipes.chat", description=__doc__)
    parser.add_argument("model", type=Path, help="a chat run's final/ (or any chat model folder)")
    parser.add_argument("--system", help="a system turn that opens the conversation")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0 samples")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0, help="of the sampled replies")
    parser.add_argument(
        "--engine", choices=ENGINES, default="batched", help="generation.engine (the same replies)"
    )
    args = parser.parse_args(argv)
    if not (args.model / "config.json").is_file():
        parser.error(f"{args.model}: no model here (config.json); give a run's final/ folder")
    if args.max_new_tokens < 1 or args.temperature < 0 or not 0 < args.top_p <= 1:
        parser.error("--max-new-tokens must be >= 1, --temperature >= 0, --top-p in (0, 1]")
    from recipes.log import quiet_libraries

    quiet_libraries()
    chat = Chat(args.model, args.system, args.max_new_tokens, args.temperature, args.top_p)
    chat.generation.engine = args.engine
    chat.seed(args.seed)
    interactive = sys.stdin.isatty()
    while True:
        try:
            line = input(PROMPT if interactive else "")
        except (EOFError, KeyboardInterrupt):
            break
        text = line.strip()
        if text == "/exit":
            break
        if text == "/reset":
            chat.reset()
            continue
        if text:
            print(chat.reply(text), flush=True)


class Chat:
    """A conversation with the model of ``model_dir``: the turns so far, and the next reply."""

    def __init__(
        self,
        model_dir: Path,
        system: str | None,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
    ) -> None:
        from accelerate import PartialState
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from recipes.config import GenerationConfig
        from recipes.model import backend_kwargs

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        if not self.tokenizer.chat_template:
            raise SystemExit(
                f"error: {model_dir}: its tokenizer has no chat template. A task=sft run saves "
                "the one it trained with in final/; for a base model, train one first."
            )
        self.device = PartialState().device
        self.model = (
            AutoModelForCausalLM.from_pretrained(model_dir, **backend_kwargs())
            .to(self.device)
            .eval()
        )
        self.head = [{"role": "system", "content": system}] if system else []
        self.seed(0)
        self.messages: list[dict[str, Any]] = list(self.head)
        self.max_new_tokens = max_new_tokens
        self.generation = GenerationConfig(
            do_sample=temperature > 0, temperature=temperature or 1.0, top_p=top_p
        )

    def seed(self, seed: int) -> None:
        """Sampled replies draw from one stream, seeded here, reply after reply."""
        import torch

        self.stream = torch.Generator().manual_seed(seed)

    def reset(self) -> None:
        self.messages = list(self.head)

    def reply(self, text: str) -> str:
        """The model's answer to the user's ``text`` after the conversation so far (the
        oldest turns are left out when the whole would not fit the model's positions)."""

        from recipes import generation
        from recipes.tasks import chat

        self.messages.append({"role": "user", "content": text})
        template = self.tokenizer.chat_template
        limit = getattr(self.model.config, "max_position_embeddings", None) or 1 << 30
        ids = chat.render(self.tokenizer, template, self.messages, True)
        while len(ids) + self.max_new_tokens > limit and self._forget_a_turn():
            ids = chat.render(self.tokenizer, template, self.messages, True)
        (text,) = generation.complete(
            self.model,
            [ids],
            self.tokenizer,
            self.generation,
            self.max_new_tokens,
            max_length=limit,
            streams=[self.stream],
        )
        answer = text.strip()
        self.messages.append({"role": "assistant", "content": answer})
        return answer

    def _forget_a_turn(self) -> bool:
        """Drop the oldest exchange after the system turn; False when only the last is left."""
        start = len(self.head)
        if len(self.messages) - start <= 1:
            return False
        del self.messages[start : start + 2]
        return True


if __name__ == "__main__":
    main()
