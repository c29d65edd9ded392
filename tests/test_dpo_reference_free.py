"""``task.loss_type=orpo`` and ``simpo`` (no reference model) against TRL 1.16's own loss code
(``trl/experimental/orpo/orpo_trainer.py``, ``trl/experimental/cpo/cpo_trainer.py``), their
refusals, and runs that never build, keep or ask for a reference.

TRL's trainers are called through their own ``get_batch_loss_metrics`` (forward, NLL, average
log-probs, loss and metrics) on an instance made without ``__init__`` and given only the
settings those methods read, on the project's token ids and completion labels, against
:func:`recipes.losses.preference_loss` on the log-probabilities the task gathers (TRL's tokenizer
path is checked for DPO in tests/test_dpo_trl.py). Rows: the first bundled held-out pairs (SQuAD
answers against wrong spans), not written for this test; the model: the tiny Llama's config,
randomly initialised.

TRL's NLL is one token-weighted mean over a micro-batch's chosen rows; the project's is each
pair's own mean (one loss term per pair, so accumulation and processes give the full batch's
mean). They agree for a batch of one pair, so the loss and gradient are compared with TRL run on
each pair alone (the mean of TRL's per-pair losses and gradients); on the whole batch at once,
the terms without the NLL and TRL's metrics are compared.
"""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
from conftest import ROOT, make_task, read_metrics, run_train
from transformers import AutoConfig, AutoModelForCausalLM

from recipes.config import ConfigError, DataConfig, ModelConfig
from recipes.losses import PairLosses, preference_loss
from recipes.model import fit_to_tokenizer, load_tokenizer

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
trl = pytest.importorskip("trl")
from trl.experimental.cpo import CPOTrainer  # noqa: E402
from trl.experimental.orpo import ORPOTrainer  # noqa: E402

PAIRS = ROOT / "recipes/assets/preferences/squad/dev.jsonl"
TINY_LLAMA = ROOT / "recipes/assets/tiny-llama"
ROWS = [json.loads(line) for line in PAIRS.read_text().splitlines()[:6]]
BETA = 0.1
WATCHED = ROOT / "tests" / "reference_free_run.py"

# (task settings, TRL trainer, the attributes its loss methods read besides beta)
CASES = {
    "orpo": ({"loss_type": "orpo"}, ORPOTrainer, {}),
    "simpo": (
        {"loss_type": "simpo"},
        CPOTrainer,
        {"loss_type": "simpo", "simpo_gamma": 0.5, "cpo_alpha": 0.0, "label_smoothing": 0.0},
    ),
    "simpo-smoothed": (
        {"loss_type": "simpo", "label_smoothing": 0.1, "simpo_gamma": 0.8},
        CPOTrainer,
        {"loss_type": "simpo", "simpo_gamma": 0.8, "cpo_alpha": 0.0, "label_smoothing": 0.1},
    ),
    "cpo-simpo": (  # TRL's CPOConfig default cpo_alpha=1.0: SimPO plus the chosen side's NLL
        {"loss_type": "simpo", "nll_weight": 1.0},
        CPOTrainer,
        {"loss_type": "simpo", "simpo_gamma": 0.5, "cpo_alpha": 1.0, "label_smoothing": 0.0},
    ),
}


class _OneProcess:
    device = torch.device("cpu")

    @staticmethod
    def gather_for_metrics(value):
        return value


def _ours(tmp_path, **task):
    tokenizer = load_tokenizer(ModelConfig(name_or_path=str(TINY_LLAMA)))
    tmp_path.mkdir(parents=True, exist_ok=True)
    for name in ("train.jsonl", "dev.jsonl"):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    dpo = make_task("dpo", chat_template="llama3", max_seq_length=256, beta=BETA, **task)
    data = dpo.build_data(
        DataConfig(path=str(tmp_path), cache_dir=str(tmp_path / "cache")), tokenizer
    )
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(TINY_LLAMA)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    fit_to_tokenizer(model, tokenizer, data.new_tokens, data.stop_tokens)
    dpo.check_model(model)
    return dpo, data, tokenizer, model.train()


def _loss(dpo, policy, tokens, nll) -> PairLosses:
    """:func:`recipes.losses.preference_loss` of the task's gathered log-probs, under its
    settings."""
    return preference_loss(policy, None, tokens, nll, **dpo.loss_settings)


def _trl_batch(batch) -> dict[str, torch.Tensor]:
    """The project's padded pair batch (chosen rows, then rejected rows) in TRL's keys."""
    pairs = len(batch["index"])
    halves = {"chosen": slice(None, pairs), "rejected": slice(pairs, None)}
    return {
        f"{side}_{key}": batch[source][rows]
        for side, rows in halves.items()
        for key, source in (
            ("input_ids", "input_ids"),
            ("attention_mask", "attention_mask"),
            ("labels", f"{side}_labels"),
        )
    }


def _trl_loss(trainer_class, settings, model, batch, pad_token_id):
    """TRL's loss and metrics of ``batch``, through the trainer's own methods."""
    trainer = object.__new__(trainer_class)
    vars(trainer).update(
        beta=BETA,
        is_encoder_decoder=False,
        padding_value=pad_token_id,
        pad_token_id=pad_token_id,
        aux_loss_enabled=False,
        alpha=0.0,  # CPO's AlphaPO reward shaping off (its default)
        accelerator=_OneProcess(),
        **settings,
    )
    return trainer.get_batch_loss_metrics(model, _trl_batch(batch), train_eval="train")


@pytest.mark.parametrize("case", list(CASES))
def test_loss_and_gradient_equal_trls(tmp_path, case):
    task, trainer_class, settings = CASES[case]
    dpo, data, tokenizer, model = _ours(tmp_path, **task)
    assert dpo.reference is None and dpo.reference_free
    collate = data.train_collator
    pairs = [data.train[i] for i in range(len(data.train))]

    # TRL, each pair alone: the mean of the pairs' losses and of their gradients.
    theirs = copy.deepcopy(model)
    trl_losses, trl_metrics = [], []
    for pair in pairs:
        loss, metrics = _trl_loss(
            trainer_class, settings, theirs, collate([pair]), tokenizer.pad_token_id
        )
        (loss / len(pairs)).backward()
        trl_losses.append(float(loss.detach()))
        trl_metrics.append(metrics)

    ours = copy.deepcopy(model)
    losses, stats = _loss(dpo, *dpo._policy_terms(ours, collate(pairs), dpo.with_nll))
    losses.mean().backward()

    loss_diff = abs(float(losses.detach().mean()) - sum(trl_losses) / len(pairs))
    grads = dict(theirs.named_parameters())
    grad_diff = max(
        float((weight.grad - grads[name].grad).abs().max())
        for name, weight in ours.named_parameters()
    )
    print(f"{case}: max abs diff vs TRL: loss {loss_diff:.3g}, gradient {grad_diff:.3g}")
    assert loss_diff <= 1e-5 * abs(sum(trl_losses) / len(pairs)) + 1e-7
    for name, weight in ours.named_parameters():
        torch.testing.assert_close(weight.grad, grads[name].grad, rtol=1e-4, atol=1e-6)
    assert all(weight.grad.abs().max() > 0 for weight in ours.parameters())  # all trained

    # The metrics, summed over pairs, are TRL's per-pair metrics summed.
    assert set(dpo.stats) <= set(trl_metrics[0])
    for name, summed in zip(dpo.stats, stats.sum(0), strict=True):
        expected = sum(m[name] for m in trl_metrics)
        assert float(summed) == pytest.approx(expected, rel=1e-4, abs=1e-5), name


@pytest.mark.parametrize("case", ["orpo", "simpo-smoothed"])
def test_whole_batch_terms_and_metrics_equal_trls(tmp_path, case):
    """All pairs in one TRL batch: the preference term (the loss less TRL's NLL) and every
    metric but the NLL (a token-weighted mean in TRL) are TRL's; the pairs are a real mix."""
    task, trainer_class, settings = CASES[case]
    dpo, data, tokenizer, model = _ours(tmp_path, **task)
    batch = data.train_collator([data.train[i] for i in range(len(data.train))])
    with torch.no_grad():
        loss, metrics = _trl_loss(trainer_class, settings, model, batch, tokenizer.pad_token_id)
        policy, tokens, nll = dpo._policy_terms(model, batch, dpo.with_nll)
        losses, stats = _loss(dpo, policy, tokens, nll)
    means = dict(zip(dpo.stats, stats.mean(0).tolist(), strict=True))
    ours_nll = float(nll.mean()) if nll is not None else 0.0
    their_nll = metrics.get("nll_loss", 0.0) if case == "orpo" else 0.0
    assert float(losses.mean()) - ours_nll == pytest.approx(float(loss) - their_nll, rel=1e-5)
    for name, value in means.items():
        if name != "nll_loss":
            assert value == pytest.approx(metrics[name], rel=1e-4, abs=1e-6), name
    assert 0 < means["rewards/accuracies"] < 1
    if case == "orpo":  # TRL's NLL: the chosen rows' tokens' mean, each pair's weighed by its
        # tokens (every token but the first, prompt included); the project's: the pairs' mean
        counts = batch["attention_mask"][: len(nll)].sum(1) - 1
        assert len(set(counts.tolist())) > 1  # rows of different lengths: the two differ
        weighted = float((nll * counts).sum() / counts.sum())
        assert weighted == pytest.approx(their_nll, rel=1e-5)
        assert abs(weighted - ours_nll) > 1e-4


def test_orpo_nll_covers_the_prompt_in_padded_and_padding_free_batches(tmp_path):
    """ORPO's NLL covers the chosen row's every token but the first, as TRL's; padding-free
    rows (chosen then rejected in one row) give the padded batch's losses."""
    results = {}
    for free in (False, True):
        dpo, data, _, model = _ours(tmp_path / str(free), loss_type="orpo", padding_free=free)
        batch = data.train_collator([data.train[i] for i in range(len(data.train))])
        with torch.no_grad():
            policy, tokens, nll = dpo._policy_terms(model.eval(), batch, True)
        results[free] = _loss(dpo, policy, tokens, nll).losses
        lengths = torch.tensor([len(data.train[i]["chosen_input_ids"]) for i in range(6)])
        labelled = (batch["chosen_sequence_labels"] != -100).sum(1)[:6]
        assert labelled.tolist() == lengths.tolist()  # the prompt included
    torch.testing.assert_close(results[True], results[False], atol=1e-4, rtol=1e-5)


# ------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("loss_type", ["orpo", "simpo"])
def test_precomputed_reference_is_refused(loss_type):
    with pytest.raises(ConfigError) as err:
        make_task("dpo", loss_type=loss_type, precompute_reference=True)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("task.precompute_reference=true")
    assert f"task.loss_type={loss_type} uses no reference model" in message


@pytest.mark.parametrize(
    "settings, field",
    [
        ({"loss_type": "simpo", "simpo_gamma": -0.5}, "task.simpo_gamma=-0.5"),
        ({"loss_type": "simpo", "simpo_gamma": float("inf")}, "task.simpo_gamma=inf"),
        ({"loss_type": "simpo", "nll_weight": -1.0}, "task.nll_weight=-1.0"),
        ({"loss_type": "orpo", "nll_weight": 1.0}, "task.nll_weight=1.0 is for"),
        ({"loss_type": "orpo", "label_smoothing": 0.1}, "task.label_smoothing=0.1 is for"),
        ({"loss_type": "simpo", "label_smoothing": 0.5}, "task.label_smoothing=0.5"),
    ],
)
def test_settings_out_of_range_are_refused(settings, field):
    with pytest.raises(ConfigError) as err:
        make_task("dpo", **settings)
    assert str(err.value).startswith(field) and "\n" not in str(err.value)


def test_cli_refusal_is_one_line(tmp_path):
    proc = run_train(
        "recipe=llama_dpo",
        "debug=smoke",
        "task.loss_type=orpo",
        "task.precompute_reference=true",
        f"output_dir={tmp_path}",
        check=False,
    )
    assert proc.returncode == 2
    assert (
        proc.stderr.strip()
        .splitlines()[-1]
        .startswith(
            "error: task.precompute_reference=true: task.loss_type=orpo uses no reference model"
        )
    )


# ------------------------------------------------------------------------- no reference

SMOKE = ("recipe=llama_dpo", "debug=smoke", "logger=none", "trainer.progress_bar=false")


def _watched_run(tmp_path, cache_dir, *overrides: str) -> dict:
    report = tmp_path / "report.json"
    run_train(
        *SMOKE,
        f"output_dir={tmp_path / 'run'}",
        f"data.cache_dir={cache_dir}",
        "task.num_generations=0",
        "trainer.max_steps=2",
        "trainer.log_every_n_steps=1",
        "trainer.save_every_n_steps=0",
        "trainer.eval_at_start=false",
        "trainer.save_final_model=false",
        *overrides,
        script=(str(WATCHED), str(report)),
    )
    return json.loads(report.read_text())


@pytest.mark.slow  # two training runs, each in a process of its own (the watch)
@pytest.mark.parametrize(
    "overrides",
    [("peft=none", "task.loss_type=orpo"), ("peft=lora", "task.loss_type=simpo")],
    ids=["orpo-full", "simpo-lora"],
)
def test_runs_build_no_reference(tmp_path, cache_dir, overrides):
    """Full fine-tuning (where DPO copies the model) and LoRA (where DPO disables the adapter):
    neither happens, one model lives in the process, and training and evaluation ran."""
    report = _watched_run(tmp_path, cache_dir, *overrides)
    assert report["deepcopies"] == 0 and report["adapter_disabled"] == 0
    assert report["reference_after_setup"] is False
    assert report["losses"] == 2 and not any(report["references"])
    assert report["models_before"] == report["models_after"] == 1
    assert report["parameters_alive"] == report["parameters_policy"]
    records = read_metrics(tmp_path / "run")
    evals = [m for m in records if "eval/loss" in m]
    assert evals and "eval/rewards/accuracies" in evals[-1]
    if "task.loss_type=orpo" in overrides:
        assert {"train/nll_loss", "train/log_odds_ratio", "eval/log_odds_chosen"} <= {
            k for m in records for k in m
        }


@pytest.mark.slow
def test_the_watch_sees_dpos_reference(tmp_path, cache_dir):
    """The control: with loss_type=sigmoid and full fine-tuning the watched run stops at DPO's
    frozen copy, so the runs above would have seen a reference."""
    with pytest.raises(AssertionError, match="copied the model"):
        _watched_run(tmp_path, cache_dir, "peft=none", "task.loss_type=sigmoid")
    assert json.loads((tmp_path / "report.json").read_text())["deepcopies"] == 1


# ---------------------------------------------------------------------------- end to end


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", ["orpo", "simpo"])
def test_smoke_recipe_trains_and_final_reloads(tmp_path, cache_dir, loss_type):
    run = tmp_path / "run"
    run_train(
        *SMOKE,
        f"task.loss_type={loss_type}",
        f"output_dir={run}",
        f"data.cache_dir={cache_dir}",
        "trainer.max_steps=20",
        "trainer.save_every_n_steps=0",
        "task.num_generations=1",
    )
    evals = [m for m in read_metrics(run) if "eval/loss" in m]
    assert len(evals) >= 2 and evals[-1]["eval/loss"] < evals[0]["eval/loss"]
    AutoModelForCausalLM.from_pretrained(run / "final")
