"""Every preset family trains: SFT, DPO, GRPO and the reward model, a few steps each, on the CPU
and on the emulated MUSA card, with the preset (``model=<preset>``) pointed at a folder holding a
model built from its kept shape (recipes/model_shapes.py, random weights) and a tiny tokenizer
carrying the family's chat template (tests/family_templates.py). No download.

What is real and what is cut (CI's time budget, issue 55: the Qwen3-0.6B family at full width,
one layer and its 151,936-token vocabulary took 7 minutes of CPU and 3.8 GB for one sweep):

- real, from the kept shape: ``model_type`` and architecture; the ratio of attention heads to
  key-value heads (grouped-query attention as the model has it); RoPE and its scaling (Llama
  3.1's ``llama3`` rope, Gemma 3's linear scaling and local base frequency); GLM-4's partial
  rotary factor and attention bias; Gemma 3's ``query_pre_attn_scalar`` (equal to its head
  width, as in the real model) and its sliding / full layer pattern; tied or untied embeddings;
  the MoE's router (top-k with normalised weights, ``router_aux_loss_coef``, every layer
  sparse); normalisation epsilons, activations, positions;
- cut: width (hidden 64, head width 16 - the same number of heads per key-value head -, MLP 128,
  experts' MLP 32), depth (2 layers), vocabulary (the tiny tokenizer's 2,000 tokens and the
  family's chat tokens), experts (8 of 128, 2 routed per token instead of 8: the same top-k
  routing), Gemma 3's sliding window (1,024 -> 32, so that it bites on rows of ~100 tokens).

CPU: one in-process Hydra sweep per task over the six families (``model=<preset>``, each job
reads ``model.name_or_path`` from the preset's name). The card: one process sweeping the four
tasks over the six families. There the MoE's experts run one by one
(``"experts_implementation": "eager"`` in its config.json): transformers 5's default,
``grouped_mm``, counts tokens per expert with ``torch.histc`` on int32 ids on every device but
the CPU, and the emulated card runs the CPU's kernel, which has no integer histc (whether
torch_musa has one is not known here; docs/models.md).
"""

from __future__ import annotations

import functools
import json
import math
import tempfile
from pathlib import Path

import pytest
import torch
from conftest import on_musa, read_metrics, run_train
from family_templates import family_tokenizer
from transformers import AutoConfig, AutoModelForCausalLM

from recipes import moe
from recipes.model_shapes import reduced

pytestmark = pytest.mark.slow

WIDTH = {"hidden_size": 64, "intermediate_size": 128, "head_dim": 16}
# preset: (hub id, attention heads, key-value heads, template family, further cuts)
FAMILIES = {
    "qwen3_8b": ("Qwen/Qwen3-8B", 4, 1, "qwen3", {}),
    "qwen3_30b_a3b": (
        "Qwen/Qwen3-30B-A3B",
        8,
        1,
        "qwen3",
        {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    ),
    "qwen2_5_7b_instruct": ("Qwen/Qwen2.5-7B-Instruct", 7, 1, "qwen2_5", {}),
    "llama3_1_8b_instruct": ("meta-llama/Llama-3.1-8B-Instruct", 4, 1, "llama3_1", {}),
    "gemma3_4b_it": (
        "google/gemma-3-4b-it",
        2,
        1,
        "gemma3",
        {
            "query_pre_attn_scalar": 16,
            "sliding_window": 32,
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ),
    "glm4_9b_chat": ("THUDM/glm-4-9b-chat-hf", 16, 1, "glm4", {}),
}
EAGER_EXPERTS = {"experts_implementation": "eager"}
TASKS = ("llama_sft", "llama_dpo", "llama_grpo", "llama_rm")
SHORT = (
    "debug=smoke",
    "++task.chat_template=null",  # the family's own, from its tokenizer
    "model.dtype=float32",  # the presets' bf16 matmuls are several times slower on this CPU
    "trainer.max_steps=2",
    "trainer.log_every_n_steps=1",
    "trainer.per_device_train_batch_size=2",
    "trainer.eval_at_start=false",
    "trainer.eval_at_end=false",
    "trainer.save_final_model=false",
    "trainer.progress_bar=false",
    "data.max_train_examples=4",
    "data.max_eval_examples=2",
    "logger=none",
)


def family_config(preset: str, vocab: int) -> dict:
    hub, heads, kv_heads, _, cuts = FAMILIES[preset]
    return reduced(
        hub,
        2,
        **WIDTH,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=vocab,
        **cuts,
    )


@functools.cache
def models(eager_experts: bool = False) -> Path:
    """A folder of ``<preset>/`` model folders (config, random weights, tokenizer); with
    ``eager_experts``, the MoE's experts run one by one (the card's runs: see the module's
    docstring)."""
    root = Path(tempfile.mkdtemp(prefix="families-"))
    for preset, (_, _, _, family, _) in FAMILIES.items():
        tokenizer = family_tokenizer(family)
        config = AutoConfig.for_model(
            **family_config(preset, len(tokenizer)),
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(root / preset)
        tokenizer.save_pretrained(root / preset)
        if eager_experts and "num_experts" in family_config(preset, len(tokenizer)):
            # save_pretrained leaves the setting out; from_pretrained reads it from the file.
            saved = root / preset / "config.json"
            saved.write_text(json.dumps({**json.loads(saved.read_text()), **EAGER_EXPERTS}))
    return root


def swept(recipes: tuple[str, ...], out: Path, root: Path, **kwargs) -> dict[tuple[str, str], Path]:
    """``recipes`` x every family of ``root`` as one Hydra sweep; the job folders by (recipe,
    preset), in Hydra's order (the product of the swept values in command-line order)."""
    run_train(
        "-m",
        f"recipe={','.join(recipes)}",
        f"model={','.join(FAMILIES)}",
        f"model.name_or_path={root}/${{hydra:runtime.choices.model}}",
        *SHORT,
        f"output_dir={out}",
        check=False,
        **kwargs,
    )
    pairs = [(recipe, preset) for recipe in recipes for preset in FAMILIES]
    return {pair: out / str(job) for job, pair in enumerate(pairs)}


@functools.cache
def cpu_sweep(recipe: str) -> dict[tuple[str, str], Path]:
    return swept((recipe,), Path(tempfile.mkdtemp(prefix=f"families-{recipe}-")), models())


@functools.cache
def card_sweep() -> dict[tuple[str, str], Path]:
    out = Path(tempfile.mkdtemp(prefix="families-musa-"))
    return swept(TASKS, out, models(eager_experts=True), script=on_musa())


def check_job(job: Path, preset: str, root: Path) -> list[dict]:
    """The job ended well, trained ``preset``'s model, and logged finite losses."""
    results = job / "results.json"
    assert results.is_file(), f"{job}: no results.json"
    result = json.loads(results.read_text())
    log = (job / "train.log").read_text()
    assert result.get("error") is None, f"{preset}: {result['error']}\n{log[-3000:]}"
    assert result["model"] == str(root / preset)
    rows = read_metrics(job)
    losses = [row["train/loss"] for row in rows if "train/loss" in row]
    assert len(losses) == 2 and all(map(math.isfinite, losses)), preset
    return rows


@pytest.mark.parametrize("recipe", TASKS)
def test_every_family_trains_on_the_cpu(recipe: str) -> None:
    for (_, preset), job in cpu_sweep(recipe).items():
        rows = check_job(job, preset, models())
        if preset == "qwen3_30b_a3b" and recipe != "llama_rm":
            aux = [row[f"train/{moe.STAT}"] for row in rows if f"train/{moe.STAT}" in row]
            assert aux and all(value > 0 for value in aux), recipe


def test_every_family_trains_on_the_emulated_card() -> None:
    for (recipe, preset), job in card_sweep().items():
        check_job(job, preset, models(eager_experts=True))
        assert "device musa, 1 process(es)" in (job / "train.log").read_text(), (recipe, preset)
