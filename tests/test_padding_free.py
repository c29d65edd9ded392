"""Padding-free batches (``task.padding_free``) of DPO, KTO and GRPO: a micro-batch's sequences
in one row without padding, ``position_ids`` restarting at each, as a variable-length kernel
(flash attention's) reads them. Their losses and gradients must equal the padded batches'.

No flash kernel runs on a CPU: the tiny Llama runs here with :func:`_varlen_reference`, an
attention function registered with transformers that computes what flash-attention's
variable-length kernel computes (attention within each sequence of the row, found where
``position_ids`` restart), and that the tasks are told reads ``position_ids`` so
(``chat.VARLEN_ATTENTION``), as a device's own kernel would be."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from conftest import ROOT, make_task
from transformers import AttentionInterface, AutoModelForCausalLM

from recipes.config import DataConfig, ModelConfig
from recipes.model import load_tokenizer
from recipes.tasks import chat

# Loaded from its file: on sys.path, transformers would take it for an installed flash-attn.
_SPEC = importlib.util.spec_from_file_location(
    "flash_attn_standin", ROOT / "tests/flash_attn_standin/flash_attn/__init__.py"
)
_STANDIN = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(_STANDIN)

PAIRS = ROOT / "recipes/assets/preferences/squad"
TINY_LLAMA = ROOT / "recipes/assets/tiny-llama"
VARLEN = "varlen_reference"


def _varlen_reference(module, query, key, value, attention_mask, position_ids=None, **kwargs):
    """flash_attn_varlen_func's result on a row of sequences: attention (causal for a decoder)
    within each, the sequences starting where ``position_ids`` restart at 0; no mask. Computed
    by the flash_attn stand-in's :func:`varlen_attention` (the emulated card's kernel)."""
    assert query.shape[0] == 1, "a padding-free batch is one row"
    starts = (position_ids[0] == 0).nonzero().squeeze(1).tolist()
    out = _STANDIN.varlen_attention(
        query[0].transpose(0, 1),
        key[0].transpose(0, 1),
        value[0].transpose(0, 1),
        starts,
        module.is_causal,
        kwargs.get("scaling"),
    )
    return out.unsqueeze(0), None


AttentionInterface.register(VARLEN, _varlen_reference)


@pytest.fixture(autouse=True)
def varlen_kernel(monkeypatch):
    monkeypatch.setattr(chat.batches, "VARLEN_ATTENTION", {VARLEN})


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ModelConfig(name_or_path=str(TINY_LLAMA)))


def _model(attention: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(TINY_LLAMA, attn_implementation=attention)
    return model.float().train()


def _pairs(count: int) -> list[dict]:
    return [json.loads(line) for line in (PAIRS / "dev.jsonl").read_text().splitlines()[:count]]


def _data(task, tmp_path, tokenizer, rows):
    tmp_path.mkdir(parents=True, exist_ok=True)
    for name in ("train.jsonl", "dev.jsonl"):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return task.build_data(DataConfig(path=str(tmp_path), cache_dir=str(tmp_path / "c")), tokenizer)


def _loss_and_grads(task, model, batch):
    model.zero_grad()
    loss = task.loss(model, batch)
    loss.total.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss, grads


def _assert_same(padded, flat):
    (loss_p, grads_p), (loss_f, grads_f) = padded, flat
    torch.testing.assert_close(loss_f.total, loss_p.total, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(loss_f.count, loss_p.count)
    for name in loss_p.stats:
        torch.testing.assert_close(loss_f.stats[name], loss_p.stats[name], atol=1e-5, rtol=1e-5)
    assert grads_p.keys() == grads_f.keys() and grads_p
    for name, grad in grads_p.items():
        torch.testing.assert_close(grads_f[name], grad, atol=1e-5, rtol=1e-4, msg=name)


# ------------------------------------------------------------------------------------ DPO


@pytest.mark.parametrize("loss_type", ["sigmoid", "orpo"])
def test_dpo_padding_free_loss_and_gradients_equal_the_padded(tmp_path, tokenizer, loss_type):
    results, shapes = {}, {}
    for attention in ("sdpa", VARLEN):  # auto: padded under sdpa, padding-free under varlen
        dpo = make_task("dpo", chat_template="zephyr", max_seq_length=256, loss_type=loss_type)
        data = _data(dpo, tmp_path / attention, tokenizer, _pairs(6))
        model = _model(attention)
        dpo.check_model(model)
        data.layout.decide(dpo.flat_batches(model))  # as the loop does
        dpo.reference = None if loss_type == "orpo" else _frozen(model)
        batch = data.train_collator([data.train[i] for i in range(len(data.train))])
        shapes[attention] = batch["input_ids"].shape
        results[attention] = _loss_and_grads(dpo, model, batch)
    rows, width = shapes["sdpa"]
    assert rows == 12 and shapes[VARLEN][0] == 1  # chosen + rejected rows; one flat row
    assert shapes[VARLEN][1] < rows * width  # the padding is gone
    _assert_same(results["sdpa"], results[VARLEN])


def _frozen(model):
    import copy

    from recipes.tasks.chat import Reference

    return Reference(False, copy.deepcopy(model).eval().requires_grad_(False))


# ------------------------------------------------------------------------------------ KTO


@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
def test_kto_padding_free_loss_and_gradients_equal_the_padded(tmp_path, tokenizer, loss_type):
    results, shapes = {}, {}
    for attention in ("sdpa", VARLEN):
        kto = make_task("kto", chat_template="zephyr", max_seq_length=256, loss_type=loss_type)
        data = _data(kto, tmp_path / attention, tokenizer, _pairs(3))  # pairs: 6 rows unpaired
        model = _model(attention)
        kto.check_model(model)
        data.layout.decide(kto.flat_batches(model))  # as the loop does
        kto.reference = _frozen(model)
        batch = data.train_collator([data.train[i] for i in range(len(data.train))])
        shapes[attention] = batch["input_ids"].shape
        results[attention] = _loss_and_grads(kto, model, batch)
    assert shapes["sdpa"][0] == 6 and shapes[VARLEN][0] == 1
    _assert_same(results["sdpa"], results[VARLEN])


def test_padding_free_true_runs_the_row_under_a_dense_mask_and_false_pads(tokenizer):
    kto = make_task("kto", max_seq_length=256, padding_free=True)
    kto.check_model(_model("sdpa"))
    assert kto.flat_batches(_model("sdpa"))  # true: one row under sdpa too, block-diagonal mask
    kto = make_task("kto", max_seq_length=256, padding_free="false")
    kto.check_model(_model(VARLEN))
    assert not kto.flat_batches(_model(VARLEN))


# ----------------------------------------------------------------------------------- GRPO


def test_grpo_padding_free_loss_and_gradients_equal_the_padded():
    from recipes.tasks import grpo

    generator = torch.Generator().manual_seed(1)
    lengths = [(5, 7), (9, 2), (3, 11), (9, 1)]  # (prompt, completion) of each row
    prompts = [torch.randint(1, 2000, (p,), generator=generator).tolist() for p, _ in lengths]
    completions = [torch.randint(1, 2000, (c,), generator=generator).tolist() for _, c in lengths]
    sampled = (*grpo._pad(prompts, 0, left=True), *grpo._pad(completions, 0, left=False))
    advantages = torch.tensor([1.0, -0.5, 0.25, -1.0])
    results = {}
    for attention in ("sdpa", VARLEN):
        task = make_task(
            "grpo", beta=0.04, loss_type="grpo", max_prompt_length=128, max_completion_length=64
        )
        model = _model(attention)
        task.check_model(model)
        flat = grpo._flat_sequences(prompts, completions, torch.device("cpu"))
        flat = flat if task.flat_batches(model) else None
        with torch.no_grad():
            ref = task._logps(_frozen(model).frozen, *sampled, flat=flat)
        model.zero_grad()
        entropies: list[torch.Tensor] = []
        logps = task._logps(model, *sampled, entropies, flat=flat)
        total, count, stats = task.policy_loss(logps, None, ref, advantages, sampled[3])
        total.backward()
        mask = sampled[3].bool()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results[attention] = (total, count, stats, logps[mask], entropies[0][mask], grads)
    assert task.flat_batches(model)  # the varlen run ran padding-free
    padded, free = results["sdpa"], results[VARLEN]
    for a, b in zip(padded[:5], free[:5], strict=True):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    for name, grad in padded[5].items():
        torch.testing.assert_close(free[5][name], grad, atol=1e-5, rtol=1e-4, msg=name)
