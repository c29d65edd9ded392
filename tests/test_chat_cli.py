"""``python -m recipes.chat``: each reply is transformers' answer (generate, greedy or sampled
from the seed) to the conversation so far, rendered by the model's own chat template
(apply_chat_template); /reset starts over."""

from __future__ import annotations

import subprocess

import pytest
import torch
from conftest import ROOT
from in_process import run_here
from transformers import AutoModelForCausalLM, AutoTokenizer

from recipes.config import ASSETS
from recipes.tasks import chat

NEW_TOKENS = 8


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """The bundled tiny Llama with zephyr's template, saved as a chat run's final/ is."""
    folder = tmp_path_factory.mktemp("final")
    tokenizer = AutoTokenizer.from_pretrained(ASSETS / "tiny-llama")
    tokenizer.chat_template = chat.CHAT_TEMPLATES["zephyr"]
    tokenizer.save_pretrained(folder)
    AutoModelForCausalLM.from_pretrained(ASSETS / "tiny-llama").save_pretrained(folder)
    return folder


def _chat(folder, lines: list[str], *args: str) -> subprocess.CompletedProcess:
    """``python -m recipes.chat`` with ``lines`` piped in, run in this process as the command
    line runs it (tests/in_process.py: its own terminal, logging and random state)."""
    return run_here(
        ["-m", "recipes.chat", str(folder), "--max-new-tokens", f"{NEW_TOKENS}", *args],
        cwd=ROOT,
        input="".join(line + "\n" for line in lines),
    )


class Peer:
    """transformers on the same folder: apply_chat_template, then generate."""

    def __init__(self, folder, temperature: float = 0.0) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.model = AutoModelForCausalLM.from_pretrained(folder).eval()
        self.sampling = {"do_sample": False}
        if temperature:
            self.sampling = {"do_sample": True, "temperature": temperature, "top_p": 1.0}
        torch.manual_seed(0)  # recipes.chat's --seed default, after loading

    def reply(self, messages: list[dict]) -> str:
        tokenizer = self.tokenizer
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)[
            "input_ids"
        ]
        inputs = torch.tensor([ids])
        with torch.no_grad():
            out = self.model.generate(
                input_ids=inputs,
                attention_mask=torch.ones_like(inputs),
                max_new_tokens=NEW_TOKENS,
                pad_token_id=tokenizer.pad_token_id,
                **self.sampling,
            )
        return tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True).strip()


def test_replies_follow_the_conversation_and_reset_starts_over(chat_model):
    question, follow_up = "Where do frogs live?", "And toads?"
    proc = _chat(
        chat_model,
        [question, "", follow_up, "/reset", question],
        "--system",
        "Be brief.",
        "--temperature",
        "1.5",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    replies = proc.stdout.split("\n")[:-1]
    assert len(replies) == 3  # the blank line asks nothing
    peer = Peer(chat_model, temperature=1.5)
    system = {"role": "system", "content": "Be brief."}
    messages = [system, {"role": "user", "content": question}]
    assert replies[0] == peer.reply(messages) and replies[0]
    messages += [
        {"role": "assistant", "content": replies[0]},
        {"role": "user", "content": follow_up},
    ]
    assert replies[1] == peer.reply(messages)
    assert replies[2] == peer.reply([system, {"role": "user", "content": question}])
    assert "Loading weights" not in proc.stderr and "LOAD REPORT" not in proc.stderr


def test_replies_are_greedy_by_default(chat_model):
    proc = _chat(chat_model, ["Where do frogs live?"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected = Peer(chat_model).reply([{"role": "user", "content": "Where do frogs live?"}])
    assert proc.stdout == expected + "\n"


def test_a_folder_without_a_chat_template_is_refused(tmp_path):
    AutoTokenizer.from_pretrained(ASSETS / "tiny-llama").save_pretrained(tmp_path)
    AutoModelForCausalLM.from_pretrained(ASSETS / "tiny-llama").save_pretrained(tmp_path)
    proc = _chat(tmp_path, ["hi"])
    assert proc.returncode != 0
    assert "has no chat template" in proc.stderr and "Traceback" not in proc.stderr
