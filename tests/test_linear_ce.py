"""The chunked losses of the output layer (recipes/losses/linear_ce.py, trainer.fused_linear_loss)
against the full logits they replace, at each chat task's loss call site on its real rows: with
the output layer frozen (LoRA's case) or training, the losses and every gradient agree to
float rounding. And the logits never exist whole."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import ROOT
from task_yaml import make_task
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM

from recipes.config import ConfigError, DataConfig, ModelConfig
from recipes.losses import linear_ce
from recipes.model import load_tokenizer
from recipes.tasks import chat
from recipes.tasks.chat import Reference

TINY_LLAMA = ROOT / "recipes/assets/tiny-llama"
CONVERSATIONS = ROOT / "recipes/assets/conversations/squad/dev.jsonl"
PAIRS = ROOT / "recipes/assets/preferences/squad/dev.jsonl"
VOCAB = 2000  # tiny-llama's


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    """Chunks of 7 positions: every loss below spans several, the last one shorter."""
    monkeypatch.setattr(linear_ce, "CHUNK_ELEMENTS", 7 * VOCAB)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ModelConfig(name_or_path=str(TINY_LLAMA)))


def _model(dtype: torch.dtype = torch.float32, head_trains: bool = False) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(TINY_LLAMA, attn_implementation="sdpa")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # away from the asset's init, so that every gradient is non-trivial
        for weight in model.parameters():
            weight.add_(torch.randn(weight.shape, generator=generator) * 0.02)
    model = model.to(dtype).train()
    model.get_output_embeddings().requires_grad_(head_trains)  # tied: the embedding too
    return model


def _build(task: str, tmp_path: Path, tokenizer, rows: list[dict], model=None, **settings):
    """The task and one batch of ``rows`` laid out for ``model`` (padding-free or padded), as
    the session builds them."""
    for name in ("train.jsonl", "dev.jsonl"):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    made = make_task(task, max_seq_length=256, **settings)
    data = made.build_data(
        DataConfig(path=str(tmp_path), cache_dir=str(tmp_path / "cache")), tokenizer
    )
    if model is not None:
        made.check_model(model)
        data.layout.decide(made.flat_batches(model))
    return made, data.train_collator([data.train[i] for i in range(len(data.train))])


def _both(model: torch.nn.Module, loss: Callable[[], tuple[torch.Tensor, ...]]) -> list:
    """``loss()``'s outputs and the gradients of their weighted sum, unfused then fused."""
    results = []
    for fused in (False, True):
        linear_ce.mark(model, fused)
        model.zero_grad()
        outs = loss()
        weights = torch.linspace(0.5, 2.0, outs[0].numel(), dtype=outs[0].dtype)
        (outs[0].reshape(-1) * weights).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append(([o.detach() for o in outs], grads))
    return results


def _assert_equal(results: list) -> None:
    """Outputs and gradients equal to float rounding: a chunk's matrix products round as the
    whole batch's only where the chunk has enough rows (fewer than 4 take another CPU kernel),
    and a position with two loss terms (DPO's NLL) has its gradients summed after the output
    layer rather than before."""
    (plain, plain_grads), (fused, fused_grads) = results
    assert plain_grads.keys() == fused_grads.keys() and plain_grads
    for a, b in zip(plain, fused, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    for name, grad in plain_grads.items():
        assert grad.abs().sum() > 0, name
        error = (fused_grads[name] - grad).norm() / grad.norm()
        assert error < 1e-6, (name, error)  # fp32 rounding; a wrong term is far larger


@pytest.mark.parametrize("packing", [False, True])
def test_sft_loss_and_gradients_equal_unfused(tmp_path, tokenizer, packing):
    rows = [json.loads(line) for line in CONVERSATIONS.read_text().splitlines()[:4]]
    sft, batch = _build("sft", tmp_path, tokenizer, rows, chat_template="zephyr", packing=packing)
    assert ("position_ids" in batch) is packing
    model = _model()

    def loss():
        out = sft.loss(model, batch)
        return out.total.reshape(1), out.count

    _assert_equal(_both(model, loss))


def test_trainable_output_layer_gradient_equals_unfused_in_float64(tmp_path, tokenizer):
    rows = [json.loads(line) for line in CONVERSATIONS.read_text().splitlines()[:3]]
    sft, batch = _build("sft", tmp_path, tokenizer, rows, chat_template="zephyr", packing=True)
    model = _model(torch.float64, head_trains=True)

    def loss():
        out = sft.loss(model, batch)
        return out.total.reshape(1), out.count

    results = _both(model, loss)
    assert "model.embed_tokens.weight" in results[0][1]  # tied to the output layer: it trains
    _assert_equal(results)


@pytest.mark.parametrize("padding_free", [False, True])
def test_dpo_log_probs_and_nll_equal_unfused(tmp_path, tokenizer, padding_free):
    rows = [json.loads(line) for line in PAIRS.read_text().splitlines()[:3]]
    model = _model(torch.float64)
    dpo, batch = _build(
        "dpo",
        tmp_path,
        tokenizer,
        rows,
        model,
        chat_template="zephyr",
        padding_free=padding_free,
        loss_type="orpo",  # with the chosen rows' NLL over the whole sequence
    )
    assert ("position_ids" in batch or "sequence" in batch) is padding_free
    _assert_equal(_both(model, lambda: dpo._policy_terms(model, batch, with_nll=True)))


@pytest.mark.parametrize("padding_free", [False, True])
def test_kto_log_probs_equal_unfused(tmp_path, tokenizer, padding_free):
    rows = []
    for line in PAIRS.read_text().splitlines()[:2]:
        pair = json.loads(line)
        for side, label in (("chosen", True), ("rejected", False)):
            rows.append({"prompt": pair["prompt"], "completion": pair[side], "label": label})
    model = _model()
    kto, batch = _build(
        "kto", tmp_path, tokenizer, rows, model, chat_template="zephyr", padding_free=padding_free
    )
    assert ("position_ids" in batch or "sequence" in batch) is padding_free
    _assert_equal(_both(model, lambda: kto._logps_of(model, batch)))


@pytest.mark.parametrize("flat", [False, True])
def test_grpo_log_probs_and_entropies_equal_unfused(flat):
    from recipes.tasks import grpo

    generator = torch.Generator().manual_seed(1)
    lengths = [(5, 17), (9, 2), (3, 11), (9, 1)]  # (prompt, completion) of each row
    prompts = [torch.randint(1, VOCAB, (p,), generator=generator).tolist() for p, _ in lengths]
    completions = [torch.randint(1, VOCAB, (c,), generator=generator).tolist() for _, c in lengths]
    sampled = (*grpo._pad(prompts, 0, left=True), *grpo._pad(completions, 0, left=False))
    task = make_task("grpo", temperature=0.7, max_prompt_length=64, max_completion_length=32)
    model = _model()
    positions = grpo._flat_sequences(prompts, completions, torch.device("cpu")) if flat else None

    entropies: list[torch.Tensor] = []

    def loss():
        return (task._logps(model, *sampled, entropies, flat=positions),)

    _assert_equal(_both(model, loss))
    # Logged only; a sum over the vocabulary whose rounding follows the rows' count.
    torch.testing.assert_close(entropies[1], entropies[0], rtol=1e-6, atol=1e-6)
    assert entropies[0].abs().sum() > 0


@pytest.mark.parametrize("teacher_fused", [False, True])
def test_gkd_divergence_and_gradients_equal_unfused(tmp_path, tokenizer, teacher_fused):
    rows = [json.loads(line) for line in CONVERSATIONS.read_text().splitlines()[:3]]
    gkd, batch = _build("gkd", tmp_path, tokenizer, rows, chat_template="zephyr", beta=0.5)
    model = _model(torch.float64)
    teacher = copy.deepcopy(model).eval().requires_grad_(False)
    with torch.no_grad():
        for weight in teacher.parameters():
            weight.mul_(1.1)
    linear_ce.mark(teacher, teacher_fused)
    gkd.teacher = Reference(adapter_disabled=False, frozen=teacher)
    _assert_equal(_both(model, lambda: gkd.divergence(model, batch)))


class _LargestLogits(TorchDispatchMode):
    """Records the largest tensor of the vocabulary's width any op returns."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.largest = 0
        self.weight = weight.untyped_storage().data_ptr()  # its views (weight.T) do not count

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if (
                isinstance(tensor, torch.Tensor)
                and tensor.shape[-1:] == (VOCAB,)
                and tensor.untyped_storage().data_ptr() != self.weight
            ):
                self.largest = max(self.largest, tensor.numel())
        return out


def test_no_op_makes_more_than_one_chunk_of_logits(tmp_path, tokenizer):
    """Every tensor of the vocabulary's width that forward and backward make: the whole
    batch's logits on the unfused path, at most one chunk's on the fused one."""
    rows = [json.loads(line) for line in CONVERSATIONS.read_text().splitlines()[:4]]
    sft, batch = _build("sft", tmp_path, tokenizer, rows, chat_template="zephyr", packing=True)
    model = _model()
    largest = {}
    for fused in (False, True):
        linear_ce.mark(model, fused)
        with _LargestLogits(model.get_output_embeddings().weight) as seen:
            sft.loss(model, batch).total.backward()
        largest[fused] = seen.largest
    assert largest[False] >= batch["input_ids"].numel() * VOCAB
    assert 0 < largest[True] <= linear_ce.chunk_rows(VOCAB) * VOCAB


def test_the_setting_is_decided_for_the_model():
    model = _model()
    assert "on (its output layer is frozen)" in chat.choose_fused_loss(model, None)
    assert linear_ce.enabled(model)
    model.get_output_embeddings().requires_grad_(True)
    assert "off (its output layer trains" in chat.choose_fused_loss(model, None)
    assert not linear_ce.enabled(model)
    chat.choose_fused_loss(model, True)
    assert linear_ce.enabled(model)
    chat.choose_fused_loss(model, False)
    assert not linear_ce.enabled(model)
    model.config.logit_scale = 0.5  # Cohere's: applied by the model's own forward only
    assert "off (the model scales its logits" in chat.choose_fused_loss(model, None)
    with pytest.raises(ConfigError, match=r"^trainer.fused_linear_loss=true: .*=false$"):
        chat.choose_fused_loss(model, True)


def test_chunks_run_under_the_autocast_of_the_models_forward(tmp_path, tokenizer):
    """accelerate wraps the model's forward in autocast, not the loss: the chunks' logits are
    still bf16 products, as the full logits are."""
    rows = [json.loads(line) for line in CONVERSATIONS.read_text().splitlines()[:2]]
    sft, batch = _build("sft", tmp_path, tokenizer, rows, chat_template="zephyr", packing=True)
    model = _model()
    forward = model.forward
    model.forward = lambda *a, **k: _in_bf16(forward, *a, **k)
    losses = {}
    for fused in (False, True):
        linear_ce.mark(model, fused)
        losses[fused] = sft.loss(model, batch).total
    torch.testing.assert_close(losses[True], losses[False], rtol=1e-6, atol=1e-6)
    head = chat.forward(model, batch, lazy_head=True).logits  # fused: still marked
    assert head.project(head.hidden[0, :3]).dtype == torch.bfloat16  # outside any autocast


def _in_bf16(forward, *args, **kwargs):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return forward(*args, **kwargs)
