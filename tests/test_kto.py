"""KTO (``task=kto``) against TRL 1.16's ``KTOTrainer`` on the same tiny model and rows: the
tokens of each row and of its KL row (the completions rotated by one within the batch), the
loss, TRL's metrics and the gradient; the clamp of a negative KL estimate on the same
log-probabilities; refusals of malformed rows; and the recipe end to end. The loss and its metrics are
:func:`recipes.losses.kto_loss` and :func:`recipes.losses.kl_estimate`, called on the
log-probabilities the task gathers.

Rows: the first bundled held-out preference pairs (SQuAD answers against wrong spans), unpaired
into a desirable and an undesirable row each, not written for this test. The reference is the tiny
Llama, the policy the tiny Llama after three steps of SFT on the rows' completions (so that it
likes them after other prompts too: a positive KL estimate), its weights then perturbed. llama3's template writes nothing after a turn's end, so TRL's completion
mask (everything after the prompt) and the project's labels agree token for token.
"""

from __future__ import annotations

import copy
import json
import logging

import pytest
import torch
from conftest import ROOT, make_task, read_metrics, run_train
from transformers import AutoModelForCausalLM

from recipes.config import ConfigError, DataConfig, ModelConfig
from recipes.data import DataError
from recipes.losses import kl_estimate, kto_loss
from recipes.losses.kto import STATS
from recipes.model import fit_to_tokenizer, load_tokenizer
from recipes.tasks import chat
from recipes.tasks.base import RunContext
from recipes.tasks.chat import Reference, token_losses

PAIRS = ROOT / "recipes/assets/preferences/squad/dev.jsonl"
TINY_LLAMA = ROOT / "recipes/assets/tiny-llama"
BETA = 0.1


def _rows(pairs: int = 4) -> list[dict]:
    """TRL's unpaired rows from the first bundled pairs: chosen (desirable), then rejected."""
    rows = []
    for line in PAIRS.read_text().splitlines()[:pairs]:
        pair = json.loads(line)
        for side, label in (("chosen", True), ("rejected", False)):
            rows.append({"prompt": pair["prompt"], "completion": pair[side], "label": label})
    return rows


ROWS = _rows()


def _ours(tmp_path, rows: list[dict] = ROWS, max_seq_length: int = 256, **task):
    """The project's task, features and one batch of ``rows`` (in file order), and the
    models."""
    tokenizer = load_tokenizer(ModelConfig(name_or_path=str(TINY_LLAMA)))
    tmp_path.mkdir(parents=True, exist_ok=True)
    for name in ("train.jsonl", "dev.jsonl"):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    kto = make_task("kto", chat_template="llama3", max_seq_length=max_seq_length, beta=BETA, **task)
    data = kto.build_data(
        DataConfig(path=str(tmp_path), cache_dir=str(tmp_path / "cache")), tokenizer
    )
    torch.manual_seed(0)  # the new template tokens' embedding rows
    reference = AutoModelForCausalLM.from_pretrained(TINY_LLAMA, attn_implementation="sdpa")
    fit_to_tokenizer(reference, tokenizer, data.new_tokens, data.stop_tokens)
    reference.eval()
    kto.check_model(reference)
    batch = data.train_collator([data.train[i] for i in range(len(data.train))])
    # The policy: a few steps of SFT on the completions, so that it likes them in any context
    # (a positive KL estimate), then perturbed.
    policy = copy.deepcopy(reference).train()
    optimizer = torch.optim.Adam(policy.parameters(), lr=1e-2)
    for _ in range(3):
        out = policy(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        nll, count = token_losses(out.logits, batch["labels"])
        (nll.sum() / count.sum()).backward()
        optimizer.step()
        optimizer.zero_grad()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for weight in policy.parameters():
            weight.add_(torch.randn(weight.shape, generator=generator) * 0.01)
    return kto, batch, tokenizer, policy, reference


def _trl(tmp_path, tokenizer, policy, reference, rows: list[dict] = ROWS, **config):
    """TRL's trainer on ``rows`` (one batch of all of them, in order), and that batch."""
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    args = trl.KTOConfig(
        output_dir=str(tmp_path / "trl"),
        report_to="none",
        beta=BETA,
        per_device_train_batch_size=len(rows),
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        **{"max_length": None, **config},
    )
    trainer = trl.KTOTrainer(
        model=copy.deepcopy(policy),
        ref_model=copy.deepcopy(reference),
        args=args,
        train_dataset=Dataset.from_list(rows),
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


def _trl_metrics(trainer) -> dict[str, float]:
    return {name: values[-1] for name, values in trainer._metrics["train"].items()}


def _our_metrics(stats: dict[str, torch.Tensor], rows: int) -> dict[str, float]:
    """TRL's names from the logged sums (each divided by the rows, as the loop logs them)."""
    logged = {name: float(value) / rows for name, value in stats.items()}
    metrics = {"kl": logged["kl"]}
    for side in ("chosen", "rejected"):
        for what in ("rewards", "logps"):
            metrics[f"{what}/{side}"] = logged[f"{what}/{side}_sum"] / logged[f"count/{side}"]
    metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
    return metrics


def _loss(kto, policy, batch, ref: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`recipes.losses.kto_loss` under the task's settings, on the (rows, 2) log-probs
    the task gathers from ``policy`` (each row's completion, and its KL row's without gradient)
    and the reference's ``ref``, the KL estimate from :func:`recipes.losses.kl_estimate`: the
    rows' mean loss, and their summed statistics (what the loop logs, times the rows)."""
    logps = kto._logps_of(policy, batch)[0]
    kl = kl_estimate(logps[:, 1], ref[:, 1]) if kto.uses_kl else torch.zeros(())
    losses, stats = kto_loss(logps[:, 0], ref[:, 0], batch["label"], kl, **kto.loss_settings)
    return losses.mean(), dict(zip(STATS, stats.sum(0), strict=True))


def _reference_logps(kto, reference, batch) -> torch.Tensor:
    """The frozen reference's (rows, 2) log-probs of the rows and their KL rows."""
    with torch.no_grad():
        return kto._logps_of(reference, batch)[0]


def _rows_equal_trls(batch, theirs) -> list:
    """Asserts that the rows and the KL rows have TRL's ids and labelled tokens; the KL rows'."""
    for prefix in ("", "KL_"):
        ours = _sequences(
            batch[f"{prefix}input_ids"],
            batch[f"{prefix}labels"] != chat.IGNORE_INDEX,
            batch[f"{prefix}attention_mask"],
        )
        expected = _sequences(
            theirs[f"{prefix}input_ids"],
            theirs[f"{prefix}completion_mask"],
            theirs[f"{prefix}attention_mask"],
        )
        assert ours == expected, prefix
    return ours


def test_rows_and_kl_rows_are_tokenized_as_trl(tmp_path):
    _, batch, tokenizer, policy, reference = _ours(tmp_path)
    _, theirs = _trl(tmp_path, tokenizer, policy, reference)
    _rows_equal_trls(batch, theirs)
    assert batch["label"].tolist() == theirs["label"].tolist() == [True, False] * 4


def test_kl_rows_pair_whole_completions_then_cut_as_trls(tmp_path):
    """Other bundled rows, cut at 200 tokens: train pair 228 (line 229) has the file's longest
    completion (54 tokens after a 194-token prompt, so both its rows are cut), pair 360 its
    shortest prompt (93 tokens). TRL pairs each prompt with another row's whole completion and
    cuts the assembled row: the short prompt gets all 54 tokens of the cut row's completion,
    and the long prompt's KL row is cut in turn. Ids, labels and the KL estimate equal TRL's."""
    lines = (PAIRS.parent / "train.jsonl").read_text().splitlines()
    long, short = json.loads(lines[228]), json.loads(lines[360])
    rows = [  # each cut row just before a short prompt: its completion is that prompt's KL one
        {"prompt": pair["prompt"], "completion": pair[side], "label": side == "chosen"}
        for side in ("chosen", "rejected")
        for pair in (long, short)
    ]
    kto, batch, tokenizer, policy, reference = _ours(tmp_path, rows, max_seq_length=200)
    trainer, theirs = _trl(tmp_path, tokenizer, policy, reference, rows, max_length=200)
    ours = _rows_equal_trls(batch, theirs)
    labelled = [len(labels) for _, labels in ours]  # the KL rows'
    # Row 1: the cut row's whole completion; row 2: 194 + 11 tokens, cut after assembly.
    assert labelled == [6, 54, 6, 30] and len(ours[2][0]) == 200
    trainer.model.train()
    trainer.compute_loss(trainer.model, theirs)
    # The task's own loss here (its reference, its KL estimate): its wiring against TRL's.
    kto.reference = Reference(adapter_disabled=False, frozen=reference)
    out = kto.loss(copy.deepcopy(policy).train(), batch)
    kl = float(out.stats["kl"]) / len(rows)
    print(f"KL rows labelled {labelled}; KL {kl:.6f}, TRL {_trl_metrics(trainer)['kl']:.6f}")
    assert kl > 0 and kl == pytest.approx(_trl_metrics(trainer)["kl"], rel=2e-5, abs=2e-5)


@pytest.mark.parametrize(
    "loss_type, desirable, undesirable",
    [("kto", 1.0, 1.0), ("kto", 1.33, 0.8), ("apo_zero_unpaired", 1.0, 1.0)],
)
def test_loss_metrics_and_gradient_equal_trls(tmp_path, loss_type, desirable, undesirable):
    weights = {"desirable_weight": desirable, "undesirable_weight": undesirable}
    kto, batch, tokenizer, policy, reference = _ours(tmp_path, loss_type=loss_type, **weights)
    trainer, theirs = _trl(tmp_path, tokenizer, policy, reference, loss_type=loss_type, **weights)
    trainer.model.train()
    trl_loss = trainer.compute_loss(trainer.model, theirs)
    trl_loss.backward()

    ours = copy.deepcopy(policy).train()
    mean, stats = _loss(kto, ours, batch, _reference_logps(kto, reference, batch))
    mean.backward()

    loss = float(mean.detach())
    print(f"{loss_type}: loss {loss:.8f}, TRL {float(trl_loss.detach()):.8f}")
    assert loss == pytest.approx(float(trl_loss.detach()), rel=1e-5, abs=1e-7)
    expected = _trl_metrics(trainer)
    got = _our_metrics(stats, len(ROWS))
    for name, value in got.items():
        print(f"  {name}: {value:.8f}, TRL {expected.get(name, 0.0):.8f}")
        assert value == pytest.approx(expected.get(name, 0.0), rel=1e-4, abs=1e-6), name
    if loss_type == "kto":
        assert got["kl"] > 0  # the estimate is not clamped away: a real comparison
    assert got["rewards/chosen"] != 0 and got["rewards/rejected"] != 0
    theirs_params = dict(trainer.model.named_parameters())
    gap = max((w.grad - theirs_params[n].grad).abs().max() for n, w in ours.named_parameters())
    print(f"  largest gradient difference: {float(gap):.3g}")
    for name, weight in ours.named_parameters():
        torch.testing.assert_close(weight.grad, theirs_params[name].grad, rtol=1e-4, atol=1e-7)


def test_a_step_of_unequal_micro_batches_weighs_every_row_alike_where_trl_averages_them(
    tmp_path,
):
    """The step weighting (docs/configuration.md, KTO's differences from TRL): micro-batches of
    4, 4 and 2 rows give each the same loss as TRL's ``compute_loss`` (a micro-batch's mean),
    but a step here is the mean over its 10 rows (the loop divides the summed
    :class:`SummedLoss` by the step's rows), where TRL's Trainer divides each micro-batch's mean
    by the accumulation steps (``loss_is_scaled_for_ga = False``), so a row of the short
    micro-batch weighs twice as much."""
    from recipes.tasks.base import SummedLoss

    rows, spans = _rows(5), ((0, 4), (4, 8), (8, 10))
    kto, _, tokenizer, policy, reference = _ours(tmp_path, rows)
    kto.reference = Reference(adapter_disabled=False, frozen=reference)
    data = kto.build_data(
        DataConfig(path=str(tmp_path), cache_dir=str(tmp_path / "cache")), tokenizer
    )
    ours, theirs = [], []
    for a, b in spans:
        batch = data.train_collator([data.train[i] for i in range(a, b)])
        with torch.no_grad():
            out = kto.loss(policy.eval(), batch)
        assert isinstance(out, SummedLoss) and float(out.count) == b - a
        ours.append(out)
        trainer, trl_batch = _trl(tmp_path / f"trl{a}", tokenizer, policy, reference, rows[a:b])
        with torch.no_grad():
            theirs.append(float(trainer.compute_loss(trainer.model.eval(), trl_batch)))
    for out, trl_mean in zip(ours, theirs, strict=True):  # each micro-batch alike
        assert float(out.total / out.count) == pytest.approx(trl_mean, rel=1e-5, abs=1e-7)
    step = float(sum(o.total for o in ours) / sum(o.count for o in ours))  # the loop's rule
    trl_step = sum(theirs) / len(theirs)  # TRL: each mean / gradient_accumulation_steps, summed
    weighted = sum(m * (b - a) for m, (a, b) in zip(theirs, spans, strict=True)) / 10
    print(f"step loss {step:.6f} (mean of rows), TRL {trl_step:.6f} (mean of micro-batch means)")
    assert step == pytest.approx(weighted, rel=1e-5)
    assert abs(step - trl_step) > 1e-3 * abs(step)


def test_a_negative_kl_estimate_is_clamped_as_trls(tmp_path):
    """The same reference log-probs in both (TRL's precomputed path reads them from the batch),
    the KL rows' made larger than the policy's: both clamp the estimate to 0."""
    kto, batch, tokenizer, policy, reference = _ours(tmp_path)
    trainer, theirs = _trl(tmp_path, tokenizer, policy, reference)
    with torch.no_grad():
        ref = kto._logps_of(reference, batch)[0]
    ref[:, 1] += 50.0  # the reference likes the mismatched completions far more
    trainer.precompute_ref_logps = True
    theirs = {**theirs, "ref_logps": ref[:, 0].clone(), "ref_KL_logps": ref[:, 1].clone()}
    trainer.model.train()
    trl_loss = trainer.compute_loss(trainer.model, theirs)

    mean, stats = _loss(kto, copy.deepcopy(policy).train(), batch, ref)
    assert float(mean.detach()) == pytest.approx(float(trl_loss.detach()), rel=1e-5)
    assert _trl_metrics(trainer)["kl"] == 0 and float(stats["kl"]) == 0


# ------------------------------------------------------------------------------ rows


def test_pairs_are_unpaired_and_text_rows_read():
    pair = json.loads(PAIRS.read_text().splitlines()[0])
    chosen, rejected = chat.unpaired.to_rows(pair)
    assert (chosen[1], chosen[2]) == (pair["chosen"], True)
    assert (rejected[1], rejected[2]) == (pair["rejected"], False)
    (row,) = chat.unpaired.to_rows(
        {"prompt": "Where is Paris?", "completion": "In France.", "label": 0 == 0}
    )
    assert row == (
        [{"role": "user", "content": "Where is Paris?"}],
        [{"role": "assistant", "content": "In France."}],
        True,
        True,  # TRL's standard (plain-text) row
    )


def test_rows_read_by_datasets_are_checked_by_row():
    """Parquet or a saved folder: rows ``datasets`` read, each checked and named by its row."""
    from datasets import Dataset

    rows = chat.unpaired.normalise(Dataset.from_list(ROWS), "auto", "rows.parquet")
    assert rows["label"] == [True, False] * 4
    assert rows[1]["completion"] == ROWS[1]["completion"] and rows[1]["place"] == "row 1"
    again = chat.unpaired.normalise(rows, "auto", "cached")  # the module's own columns: kept
    assert again["place"] == rows["place"] and again["prompt"] == rows["prompt"]
    bad = Dataset.from_list([{**row, "label": "yes" if row["label"] else "no"} for row in ROWS])
    with pytest.raises(
        DataError, match=r"rows\.parquet: 8 row\(s\) .* row 0: field 'label' is str"
    ):
        chat.unpaired.normalise(bad, "auto", "rows.parquet")


def test_kl_is_averaged_over_processes_then_clamped():
    """TRL gathers each process's micro-batch estimate, averages, then clamps at 0."""

    class TwoProcesses:
        num_processes = 2

        def __init__(self, other: float) -> None:
            self.other = other

        def gather(self, value):
            return torch.cat([value, torch.tensor([self.other])])

    kto = make_task("kto")
    policy = torch.tensor([[-5.0, -4.0], [-6.0, -6.0]])
    reference = torch.tensor([[-5.0, -5.0], [-6.0, -6.0]])  # this process: KL 0.5
    assert float(kto.batch_kl(policy, reference)) == pytest.approx(0.5)
    assert float(kto.batch_kl(policy, reference, TwoProcesses(1.5))) == pytest.approx(1.0)
    assert float(kto.batch_kl(policy, reference, TwoProcesses(-3.0))) == 0  # mean -1.25: clamped
    apo = make_task("kto", loss_type="apo_zero_unpaired")
    assert float(apo.batch_kl(policy, reference)) == 0


def test_malformed_rows_are_refused_in_one_line_naming_file_row_and_field(tmp_path):
    prompt = [{"role": "user", "content": "Where is Paris?"}]
    reply = [{"role": "assistant", "content": "In France."}]
    rows = [
        {"prompt": prompt, "completion": reply, "label": True},
        {"prompt": prompt, "completion": reply},  # no label
        {"prompt": prompt, "completion": reply, "label": "true"},  # a string
        {"prompt": prompt, "completion": reply, "label": 1},  # a number
        {"prompt": prompt, "completion": "", "label": False},  # an empty completion
        {"completion": reply, "label": True},  # no prompt
        {"prompt": prompt + reply, "completion": reply, "label": True},  # prompt ends replied
    ]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError) as err:
        chat.unpaired.read_unpaired(path)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"{path}: 6 row(s) are not unpaired preference rows or pairs")
    assert "line 2: field 'label' is missing: true (desirable) or false" in message
    assert "line 3: field 'label' is str 'true', not a boolean" in message
    assert "line 4: field 'label' is int 1, not a boolean" in message
    assert "(and 3 more)" in message
    # Not a layout problem: the layout is plain (a label), so task.format is no fix.
    assert "task.format" not in message and message.endswith("Fix or remove them.")
    # Each kind alone, to see its own words.
    for row, words in (
        (rows[4], "line 1: field 'completion' is empty"),
        (rows[5], "line 1: field 'prompt' is missing"),
        (rows[6], "line 1: the prompt ends with an assistant turn"),
    ):
        path.write_text(json.dumps(row) + "\n")
        with pytest.raises(DataError, match=words):
            chat.unpaired.read_unpaired(path)
    # A row of no layout at all: the message names both layouts, and task.format as a fix.
    path.write_text(json.dumps({"question": "Where is Paris?", "answer": "In France."}) + "\n")
    with pytest.raises(DataError) as err:
        chat.unpaired.read_unpaired(path)
    message = str(err.value)
    assert "\n" not in message
    assert (
        "line 1: fits no layout (fields: answer, question); expected prompt/completion/label"
        in (message)
    )
    assert message.endswith(
        "Fix or remove them, or name the layout with "
        "task.format=unpaired|explicit|implicit|ultrafeedback."
    )


def test_rows_cut_or_dropped_by_the_length_are_counted_in_the_log(tmp_path, caplog):
    """A row whose prompt alone fills task.max_seq_length keeps no completion token once cut:
    it is dropped even under truncation=truncate, and the log counts it (as SFT's does)."""
    tokenizer = load_tokenizer(ModelConfig(name_or_path=str(TINY_LLAMA)))
    long_prompt = [{"role": "user", "content": "Where is Paris? " * 200}]
    long_reply = [{"role": "assistant", "content": "In France. " * 200}]
    rows = [
        *ROWS,
        {"prompt": long_prompt, "completion": ROWS[0]["completion"], "label": True},
        {"prompt": ROWS[0]["prompt"], "completion": long_reply, "label": False},
    ]
    for name in ("train.jsonl", "dev.jsonl"):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = DataConfig(path=str(tmp_path), cache_dir=str(tmp_path / "cache"))
    for truncation, kept, words in (
        ("truncate", 9, "1 truncated, 1 dropped (task.truncation=truncate"),
        ("drop", 8, "0 truncated, 2 dropped (task.truncation=drop"),
    ):
        caplog.clear()
        kto = make_task("kto", chat_template="llama3", max_seq_length=256, truncation=truncation)
        with caplog.at_level(logging.INFO, logger="recipes"):
            data = kto.build_data(cfg, tokenizer)
        assert len(data.train) == kept and "cut" not in data.train.column_names
        assert f"train: 10 rows -> {kept} features" in caplog.text
        assert f"task.max_seq_length=256: {words}" in caplog.text


def test_a_field_no_row_has_is_said_once_with_the_fields_the_rows_have(tmp_path):
    """Every row refused for one reason (no row has a label): said once, with the row count
    and the rows' fields, not line by line."""
    rows = [{"prompt": r["prompt"], "completion": r["completion"]} for r in ROWS]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError) as err:
        chat.unpaired.read_unpaired(path)
    assert str(err.value) == (
        f"{path}: 8 row(s) are not unpaired preference rows or pairs: every row: field 'label' "
        "is missing: true (desirable) or false (undesirable) (8 rows; the rows' fields: "
        "completion, prompt). Fix them."
    )


def test_settings_are_checked():
    with pytest.raises(ConfigError, match=r"task\.loss_type='sigmoid'"):
        make_task("kto", loss_type="sigmoid")
    with pytest.raises(ConfigError, match=r"task\.precompute_reference=true with task\.loss_type"):
        make_task("kto", precompute_reference=True)
    make_task("kto", precompute_reference=True, loss_type="apo_zero_unpaired")
    with pytest.raises(ConfigError, match=r"task\.undesirable_weight=-1"):
        make_task("kto", undesirable_weight=-1)


def test_a_batch_of_one_row_is_refused(tmp_path):
    kto, *_ = _ours(tmp_path)
    for train, evaluation, key in ((1, 2, "train"), (2, 1, "eval"), (None, 1, "eval")):
        run = RunContext(None, None, None, None, train_batch_size=train)
        with pytest.raises(ConfigError, match=f"per_device_{key}_batch_size=1"):
            kto.before_training(torch.nn.Linear(1, 1), None, run, evaluation)


# ---------------------------------------------------------------------------- end to end

SMOKE = ("recipe=llama_kto", "debug=smoke", "logger=none", "trainer.progress_bar=false")


@pytest.mark.slow
def test_smoke_run_lowers_the_loss_and_final_reloads(tmp_path, cache_dir):
    run = tmp_path / "run"
    run_train(*SMOKE, f"output_dir={run}", f"data.cache_dir={cache_dir}")
    evals = [m for m in read_metrics(run) if "eval/loss" in m]
    first, last = evals[0], evals[-1]
    assert first["eval/loss"] == pytest.approx(0.5, abs=1e-6)  # 1 - sigmoid(0): policy == ref
    assert first["eval/kl"] == 0 and first["eval/rewards/margins"] == 0
    assert last["eval/loss"] < first["eval/loss"] and last["eval/rewards/margins"] > 0
    train = [m for m in read_metrics(run) if "train/loss" in m]
    assert train[-1]["train/loss"] < train[0]["train/loss"]
    assert all(
        f"train/{name}" in train[-1] for name in ("kl", "rewards/chosen_sum", "count/chosen")
    )
    config = json.loads((run / "final" / "tokenizer_config.json").read_text())
    template = config.get("chat_template") or (run / "final" / "chat_template.jinja").read_text()
    assert "<|assistant|>" in template
    AutoModelForCausalLM.from_pretrained(run / "final")
