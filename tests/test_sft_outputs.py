"""What a chat fine-tuning run leaves is ready to serve: ``final/`` (and ``final/adapter/``)
render prompts with the template the run trained with, stop at its end-of-turn token, and the
adapter's base loads from what its config names (a full fine-tuning run's template: in
``test_sft.py``'s smoke run).

``task.chat_template=chatml`` on the bundled tiny Llama, a base model without ChatML tokens,
adds them as special tokens with new embedding rows (trained under LoRA), as TRL's
``clone_chat_template`` does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import ROOT
from test_sft import _smoke
from transformers import AutoModelForCausalLM, AutoTokenizer

from recipes.tasks import chat

pytestmark = pytest.mark.slow

CONVERSATION = json.loads(
    (ROOT / "recipes/assets/conversations/squad/dev.jsonl").read_text().splitlines()[7]
)["messages"]


def _prompt_ids(tokenizer, template: str | None = None) -> list[int]:
    """The prompt of the conversation's last reply, as the run rendered it in training."""
    prompt = CONVERSATION[:-1]
    if template is not None:
        return chat.render(tokenizer, template, prompt, generation_prompt=True)
    return tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)


def test_chatml_on_a_base_model_adds_its_tokens_and_the_lora_adapter_loads(tmp_path, cache_dir):
    from peft import AutoPeftModelForCausalLM

    run = tmp_path / "run"
    _smoke(run, cache_dir, "trainer.max_steps=3", "trainer.eval_at_start=false",
           "task.num_generations=1", "task.chat_template=chatml", "peft=lora")  # fmt: skip
    final = run / "final"
    saved = AutoTokenizer.from_pretrained(final)
    end = saved.convert_tokens_to_ids("<|im_end|>")
    assert saved("<|im_end|>", add_special_tokens=False)["input_ids"] == [end]
    assert end in json.loads((final / "generation_config.json").read_text())["eos_token_id"]
    # The saved template renders the training prompt (ids, with the tokenizer as trained).
    rendered = saved(_prompt_ids(saved), add_special_tokens=False)["input_ids"]
    assert rendered == _prompt_ids(saved, chat.CHAT_TEMPLATES["chatml"])
    assert AutoTokenizer.from_pretrained(final / "adapter").chat_template == saved.chat_template

    merged = AutoModelForCausalLM.from_pretrained(final)
    config = json.loads((final / "adapter" / "adapter_config.json").read_text())
    assert Path(config["base_model_name_or_path"]) == (final / "base").resolve()
    base = AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"])
    adapted = AutoPeftModelForCausalLM.from_pretrained(final / "adapter")
    ids = torch.tensor([rendered])
    with torch.no_grad():
        expected = merged(input_ids=ids).logits
        torch.testing.assert_close(adapted(input_ids=ids).logits, expected, atol=1e-4, rtol=1e-4)
    # The new rows trained: the merged embeddings of the ChatML tokens moved from the base's.
    rows = [saved.convert_tokens_to_ids("<|im_start|>"), end]
    trained = merged.get_input_embeddings().weight[rows]
    assert not torch.allclose(trained, base.get_input_embeddings().weight[rows])
