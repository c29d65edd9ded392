"""Mixture-of-experts models (recipes/moe.py, recipes/adapters.py): the router's load-balancing
loss equals what transformers adds to its own loss, and LoRA with the default settings works.

A tiny Qwen3-MoE (random weights, built from its config, no download) stands in for
Qwen3-30B-A3B in the fast tests; the slow test runs the preset's shape, cut in depth, width,
experts and vocabulary (its docstring says which).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from conftest import sweep_train
from test_families import family_config
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from recipes import adapters, moe
from recipes.config import PeftSettings
from recipes.tasks.base import Averaging, LossShape, SummedLoss

VOCAB = 100
TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": VOCAB,
    "router_aux_loss_coef": 0.02,  # larger than Qwen3's 0.001, so the term is well above noise
}
LORA = PeftSettings(method="lora", r=4, alpha=8, dropout=0.05)  # conf/peft/lora.yaml's dropout


def tiny_moe(**changes: object) -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(
        AutoConfig.for_model("qwen3_moe", **{**TINY, **changes})
    )


def padded_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (3, 10), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    mask[2, 3:] = 0
    return ids, mask, ids.masked_fill(mask == 0, -100)


def test_router_loss_is_transformers_loss_minus_cross_entropy() -> None:
    """On a padded batch: transformers' ``outputs.loss`` (output_router_logits=True) minus the
    cross-entropy of its logits is what :func:`moe.router_loss` adds, and the padding counts
    nowhere (the same rows without it give another value)."""
    model = tiny_moe()
    ids, mask, labels = padded_batch()
    out = model(input_ids=ids, attention_mask=mask, labels=labels, output_router_logits=True)
    shifted = out.logits[:, :-1].reshape(-1, VOCAB).float()
    cross_entropy = torch.nn.functional.cross_entropy(shifted, labels[:, 1:].reshape(-1))
    with moe.router_loss(model) as router:
        model(input_ids=ids, attention_mask=mask)
    assert router.coef == pytest.approx(0.02)
    expected = (out.loss - cross_entropy).item()
    assert expected > 1e-3  # the term is there to compare
    assert (router.coef * router.aux).item() == pytest.approx(expected, rel=1e-4, abs=1e-6)
    with moe.router_loss(model) as unmasked:
        model(input_ids=ids)
    assert unmasked.aux.item() != pytest.approx(router.aux.item(), rel=1e-4)


def test_router_loss_added_per_term_and_logged() -> None:
    """:meth:`RouterLoss.added` adds coef x aux per term of a summed loss (the step's mean gets
    coef x aux, as transformers adds it to a mean) and logs aux per term; forwards without
    autograd (a reference pass) are left out; a dense model gets nothing."""
    model = tiny_moe()
    ids, mask, _ = padded_batch()
    with moe.router_loss(model) as router:
        with torch.no_grad():
            model(input_ids=ids)  # a reference pass: not recorded
        model(input_ids=ids, attention_mask=mask)
    with moe.router_loss(model) as alone:
        model(input_ids=ids, attention_mask=mask)
    assert router.aux.item() == pytest.approx(alone.aux.item())
    summed = router.added(SummedLoss(torch.tensor(5.0), torch.tensor(4.0)))
    assert summed.total.item() == pytest.approx(5.0 + 4 * 0.02 * router.aux.item(), rel=1e-6)
    assert summed.stats[moe.STAT].item() == pytest.approx(4 * router.aux.item(), rel=1e-6)
    dense = AutoModelForCausalLM.from_config(
        AutoConfig.for_model("qwen3", **{k: v for k, v in TINY.items() if "expert" not in k})
    )
    with moe.router_loss(dense) as none:
        dense(input_ids=ids)
    plain = SummedLoss(torch.tensor(5.0), torch.tensor(4.0))
    assert none.added(plain) is plain and not moe.routes(dense)
    shape = LossShape(Averaging.sum, stats=("a",))
    assert moe.with_router_stat(shape, model).stats == ("a", moe.STAT)
    assert moe.with_router_stat(shape, dense) is shape
    off = tiny_moe(router_aux_loss_coef=0.0)
    assert not moe.routes(off)


def test_router_loss_under_lora_with_packed_rows() -> None:
    """Through peft, and on packed rows given a 4-D block mask (where transformers' own
    output_router_logits=True fails): the term is the mask-free one of the same tokens."""
    model = adapters.apply_lora(tiny_moe(), LORA, [])
    ids = torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(2))
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]])
    block = torch.full((1, 1, 8, 8), float("-inf"))
    for start in (0, 4):
        block[0, 0, start : start + 4, start : start + 4] = torch.triu(
            torch.full((4, 4), float("-inf")), diagonal=1
        )
    with moe.router_loss(model) as router:
        model(input_ids=ids, attention_mask=block, position_ids=positions)
    assert router.aux is not None and router.aux.requires_grad
    router.aux.backward()  # reaches the router through the adapted layers
    assert any(p.grad is not None for n, p in model.named_parameters() if "lora_" in n)


def test_default_lora_on_moe_targets_experts_without_dropout(caplog) -> None:
    """peft.target_modules=null on a MoE model: the attention projections and (transformers 5)
    the fused experts through peft's target_parameters, dropout 0 (what peft's ParamWrapper
    needs, instead of ``lora_dropout != 0`` refused), the router frozen; the log says which."""
    with caplog.at_level(logging.INFO, logger="recipes.adapters"):
        model = adapters.apply_lora(tiny_moe(), LORA, [])
    config = model.peft_config["default"]
    fused = moe.fused_expert_parameters(model.get_base_model())
    assert set(config.target_modules) >= {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert "gate" not in set(config.target_modules) | set(config.target_parameters or [])
    if fused:  # transformers 5: experts stacked in 3-D parameters
        assert set(config.target_parameters) == {"gate_up_proj", "down_proj"}
        assert config.lora_dropout == 0
        assert "takes no dropout: peft.dropout=0.05 -> 0" in caplog.text
    else:  # transformers 4: experts are linear layers, dropout kept
        assert {"gate_proj", "up_proj", "down_proj"} <= set(config.target_modules)
        assert config.lora_dropout == pytest.approx(0.05)
    assert "the router (gate) stays frozen" in caplog.text
    router = [p for n, p in model.named_parameters() if n.endswith("mlp.gate.weight")]
    assert router and not any(p.requires_grad for p in router)
    ids, mask, labels = padded_batch()
    model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    trained = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is not None]
    assert any("experts" in n for n in trained)


def test_dense_lora_unchanged() -> None:
    """A dense model keeps peft's all-linear with the configured dropout."""
    dense = AutoModelForCausalLM.from_config(
        AutoConfig.for_model("qwen3", **{k: v for k, v in TINY.items() if "expert" not in k})
    )
    config = adapters.apply_lora(dense, LORA, []).peft_config["default"]
    assert config.lora_dropout == pytest.approx(0.05) and not config.target_parameters


@pytest.mark.slow
def test_moe_preset_runs_dpo_and_grpo_with_default_lora(tmp_path: Path) -> None:
    """model=qwen3_30b_a3b runs DPO and GRPO with peft=lora's defaults and logs the router's
    loss. Its kept shape (recipes/model_shapes.py) with its routing real (top-k with normalised
    weights, every layer sparse, router_aux_loss_coef 0.001, the ratio of attention heads to
    key-value heads) and the size cut for CI's CPU budget: 2 layers, hidden 64, head width 16,
    8 experts of 32, 2 routed per token, the tiny tokenizer's 2,000-token vocabulary (at full
    width and vocabulary one layer took 57 s of CPU and 9.8 GB)."""
    shape = family_config("qwen3_30b_a3b", vocab=2000)  # tests/test_families.py's cuts
    folder = tmp_path / "model"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**shape)).save_pretrained(folder)
    tokenizer = Path(__file__).resolve().parents[1] / "recipes/assets/tiny-llama"
    AutoTokenizer.from_pretrained(tokenizer).save_pretrained(folder)
    recipes = ("llama_dpo", "llama_grpo")
    sweep = sweep_train(
        recipes,
        "debug=smoke",
        "model=qwen3_30b_a3b",
        f"model.name_or_path={folder}",
        "model.dtype=float32",  # bf16 matmuls are several times slower on this CPU
        "trainer.max_steps=2",
        "trainer.eval_at_start=false",
        "trainer.eval_at_end=false",
        "trainer.log_every_n_steps=1",
        "trainer.per_device_train_batch_size=2",
        "data.max_train_examples=4",
        "data.max_eval_examples=2",
        "logger=none",
        output_dir=tmp_path / "runs",
    )
    for recipe in recipes:
        job = sweep.job(recipe)
        log = (job / "train.log").read_text()
        assert "fused experts" in log or "experts are linear layers" in log
        rows = [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]
        aux = [row[f"train/{moe.STAT}"] for row in rows if f"train/{moe.STAT}" in row]
        assert aux and all(value > 0 for value in aux), recipe
