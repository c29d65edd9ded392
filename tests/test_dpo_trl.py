"""The DPO task against TRL's ``DPOTrainer`` on the same model, rows and beta: the tokens and
completion masks of each side, and for one batch the loss, TRL's metrics and the gradient.

Rows: the first bundled held-out pairs (SQuAD answers against wrong spans), not written for
this test. The loss is :func:`recipes.losses.dpo_loss`, called on the log-probabilities the
task gathers. The policy is the tiny Llama with its weights perturbed, the reference the tiny
Llama itself, so rewards and margins are not zero. TRL (1.x) labels a side's whole text after
the prompt, the project its reply and end-of-turn token, not the template's whitespace after it
(what TRL's own SFT ``assistant_only_loss`` and the project's SFT label): with llama3's template,
which writes none, the two agree token for token; with zephyr's (a newline after EOS) they
differ by exactly that token per side, checked below.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from conftest import ROOT, make_task
from transformers import AutoModelForCausalLM

from recipes.config import DataConfig, ModelConfig
from recipes.losses import dpo_loss
from recipes.model import fit_to_tokenizer, load_tokenizer
from recipes.tasks import chat

trl = pytest.importorskip("trl")

PAIRS = ROOT / "recipes/assets/preferences/squad/dev.jsonl"
TINY_LLAMA = ROOT / "recipes/assets/tiny-llama"
ROWS = [json.loads(line) for line in PAIRS.read_text().splitlines()[:6]]
BETA = 0.1


def _ours(tmp_path, template: str, **task):
    """The project's task, features and batch of ROWS (in file order), and the models."""
    tokenizer = load_tokenizer(ModelConfig(name_or_path=str(TINY_LLAMA)))
    tmp_path.mkdir(parents=True, exist_ok=True)
    for name in ("train.jsonl", "dev.jsonl"):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    dpo = make_task("dpo", chat_template=template, max_seq_length=256, beta=BETA, **task)
    data = dpo.build_data(
        DataConfig(path=str(tmp_path), cache_dir=str(tmp_path / "cache")), tokenizer
    )
    reference = AutoModelForCausalLM.from_pretrained(TINY_LLAMA, attn_implementation="sdpa")
    fit_to_tokenizer(reference, tokenizer, data.new_tokens, data.stop_tokens)
    reference.eval()
    policy = copy.deepcopy(reference)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for weight in policy.parameters():
            weight.add_(torch.randn(weight.shape, generator=generator) * 0.05)
    dpo.check_model(policy)
    return dpo, data, tokenizer, policy, reference


def _trl(tmp_path, tokenizer, policy, reference, **config):
    """TRL's trainer on ROWS, and its batch of all of them (in its own order)."""
    from datasets import Dataset

    args = trl.DPOConfig(
        output_dir=str(tmp_path / "trl"),
        report_to="none",
        beta=BETA,
        per_device_train_batch_size=len(ROWS),
        max_length=None,
        use_cpu=True,
        bf16=False,
        **config,
    )
    trainer = trl.DPOTrainer(
        model=copy.deepcopy(policy),
        ref_model=copy.deepcopy(reference),
        args=args,
        train_dataset=Dataset.from_list(ROWS),
        processing_class=tokenizer,
    )
    return trainer, next(iter(trainer.get_train_dataloader()))


def _sequences(input_ids, mask, attention) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Each row's tokens and labelled positions, padding left out."""
    out = []
    for ids, labelled, keep in zip(
        input_ids.tolist(), mask.tolist(), attention.tolist(), strict=True
    ):
        length = sum(keep)
        out.append((tuple(ids[:length]), tuple(i for i in range(length) if labelled[i])))
    return out


def _our_sequences(data) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    out = []
    for side in ("chosen", "rejected"):
        for feature in data.train:
            labels = feature[f"{side}_labels"]
            out.append(
                (
                    tuple(feature[f"{side}_input_ids"]),
                    tuple(i for i, t in enumerate(labels) if t != chat.IGNORE_INDEX),
                )
            )
    return out


def test_tokens_and_completion_masks_equal_trls(tmp_path):
    _, data, tokenizer, policy, reference = _ours(tmp_path, "llama3")
    _, batch = _trl(tmp_path, tokenizer, policy, reference)
    theirs = _sequences(batch["input_ids"], batch["completion_mask"], batch["attention_mask"])
    assert sorted(_our_sequences(data)) == sorted(theirs)


def test_with_a_newline_after_eos_only_that_token_differs(tmp_path):
    """zephyr writes "\\n" after each turn's EOS: TRL labels it, the project does not."""
    _, data, tokenizer, policy, reference = _ours(tmp_path, "zephyr")
    _, batch = _trl(tmp_path, tokenizer, policy, reference)
    theirs = dict(_sequences(batch["input_ids"], batch["completion_mask"], batch["attention_mask"]))
    ours = dict(_our_sequences(data))
    assert ours.keys() == theirs.keys()
    for ids, labelled in ours.items():
        extra = sorted(set(theirs[ids]) - set(labelled))
        assert set(labelled) < set(theirs[ids]) and len(extra) == 1
        assert ids[extra[0] - 1] == tokenizer.eos_token_id
        assert tokenizer.decode([ids[extra[0]]]).strip() == ""


@pytest.mark.parametrize("loss_type, smoothing", [("sigmoid", 0.0), ("ipo", 0.0), ("robust", 0.1)])
def test_loss_metrics_and_gradient_equal_trls(tmp_path, loss_type, smoothing):
    dpo, data, tokenizer, policy, reference = _ours(
        tmp_path, "llama3", loss_type=loss_type, label_smoothing=smoothing
    )
    trainer, batch = _trl(
        tmp_path, tokenizer, policy, reference, loss_type=[loss_type], label_smoothing=smoothing
    )
    trainer.model.train()
    trl_loss = trainer.compute_loss(trainer.model, batch)
    trl_loss.backward()
    trl_metrics = {name: values[-1] for name, values in trainer._metrics["train"].items()}

    ours = copy.deepcopy(policy).train()
    ours_batch = data.train_collator([data.train[i] for i in range(len(data.train))])
    with torch.no_grad():
        reference_logps = dpo._logps_of(reference, ours_batch)[0]
    policy_logps, tokens = dpo._logps_of(ours, ours_batch)
    losses, stats = dpo_loss(
        policy_logps,
        reference_logps,
        tokens,
        beta=BETA,
        loss_type=loss_type,
        label_smoothing=smoothing,
    )
    losses.mean().backward()

    assert float(losses.mean()) == pytest.approx(float(trl_loss), rel=1e-5)
    means = stats.mean(dim=0).tolist()
    for name, value in zip(
        ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
         "logps/chosen", "logps/rejected"),
        means,
        strict=True,
    ):  # fmt: skip
        assert value == pytest.approx(trl_metrics[name], rel=1e-4, abs=1e-6), name
    assert 0 < means[2] < 1  # some pairs preferred, some not: a real comparison
    theirs = dict(trainer.model.named_parameters())
    for name, weight in ours.named_parameters():
        torch.testing.assert_close(weight.grad, theirs[name].grad, rtol=1e-4, atol=1e-6)
