"""The reward model task (``task=reward_model``) against TRL 1.16's ``RewardTrainer`` on the same
tiny model and rows: the tokens of each side, and for one batch the loss and TRL's metrics, with
and without a margin column and the centring term (the loss is
:func:`recipes.losses.bradley_terry_loss` on the rewards the task's model gives); refusals; and
the recipe end to end.

Rows: the first bundled held-out pairs (SQuAD answers against wrong spans), not written for this
test; their margins, where a test gives them, are each side's length in characters apart.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from conftest import (
    ROOT,
    kill_at_checkpoint,
    make_task,
    read_metrics,
    run_torchrun,
    run_train,
    start_train,
)
from safetensors.torch import load_file
from transformers import AutoModelForSequenceClassification

from recipes.config import ConfigError, DataConfig, ModelConfig
from recipes.data import DataError
from recipes.losses import bradley_terry_loss
from recipes.losses.reward import STATS
from recipes.model import load_tokenizer
from recipes.tasks.reward_model import pair_rewards

PAIRS = ROOT / "recipes/assets/preferences/squad/dev.jsonl"
TINY_LLAMA = ROOT / "recipes/assets/tiny-llama"
ROWS = [json.loads(line) for line in PAIRS.read_text().splitlines()[:8]]


def _with_margins(rows: list[dict]) -> list[dict]:
    """Each pair with a margin: its sides' lengths apart, in tens of characters."""
    length = lambda side: len(side if isinstance(side, str) else side[0]["content"])  # noqa: E731
    return [r | {"margin": (length(r["chosen"]) - length(r["rejected"])) / 10} for r in rows]


def _ours(tmp_path: Path, rows: list[dict], **task):
    """The task, its one batch of ``rows`` (in file order), the tokenizer and the model (its
    score head drawn from seed 0)."""
    tokenizer = load_tokenizer(ModelConfig(name_or_path=str(TINY_LLAMA)))
    tmp_path.mkdir(parents=True, exist_ok=True)
    for name in ("train.jsonl", "dev.jsonl"):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    rm = make_task("reward_model", chat_template="zephyr", max_seq_length=256, **task)
    data = rm.build_data(
        DataConfig(path=str(tmp_path), cache_dir=str(tmp_path / "cache")), tokenizer
    )
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(
        TINY_LLAMA, attn_implementation="sdpa", **rm.model_kwargs(data)
    )
    rm.check_model(model)
    batch = data.train_collator([data.train[i] for i in range(len(data.train))])
    return rm, data, batch, tokenizer, model


def _trl(tmp_path: Path, tokenizer, model, rows: list[dict], **config):
    """TRL's trainer on ``rows`` and its batch of all of them (in its own order)."""
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    args = trl.RewardConfig(
        output_dir=str(tmp_path / "trl"),
        report_to="none",
        per_device_train_batch_size=len(rows),
        max_length=None,
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        **config,
    )
    trainer = trl.RewardTrainer(
        model=copy.deepcopy(model),
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
    )
    return trainer, next(iter(trainer.get_train_dataloader()))


def _sides(batch: dict) -> list[tuple[int, ...]]:
    """Each row's tokens, padding left out (chosen rows, then rejected rows)."""
    return [
        tuple(ids[: sum(mask)])
        for ids, mask in zip(
            batch["input_ids"].tolist(), batch["attention_mask"].tolist(), strict=True
        )
    ]


def _plain(rows: list[dict]) -> list[dict]:
    """TRL's standard (plain-text) pairs: the question as the prompt, the replies' text."""
    return [
        {
            "prompt": r["prompt"][-1]["content"] + "\nAnswer: ",
            "chosen": r["chosen"][0]["content"],
            "rejected": r["rejected"][0]["content"],
        }
        for r in rows
    ]


@pytest.mark.parametrize(
    "text, margins, center",
    [
        (False, False, None),
        (False, True, None),
        (False, True, 0.01),
        (False, False, 0.5),
        (True, True, 0.01),  # task.text_rows=raw: prompt + reply + EOS, no template, as TRL
    ],
)
def test_tokens_loss_and_metrics_equal_trls(tmp_path, text, margins, center):
    rows = _plain(ROWS) if text else ROWS
    rows = _with_margins(rows) if margins else rows
    task = {"center_rewards_coefficient": center, "text_rows": "raw" if text else "chat"}
    rm, data, batch, tokenizer, model = _ours(tmp_path, rows, **task)
    trainer, theirs = _trl(tmp_path, tokenizer, model, rows, center_rewards_coefficient=center)
    pairs = len(rows)
    # The same sides, pair for pair (TRL shuffles the pairs of its batch).
    ours_sides, their_sides = _sides(batch), _sides(theirs)
    assert sorted(zip(ours_sides[:pairs], ours_sides[pairs:], strict=True)) == sorted(
        zip(their_sides[:pairs], their_sides[pairs:], strict=True)
    )
    assert ("margin" in theirs) == margins
    if margins:
        assert sorted(theirs["margin"].tolist()) == sorted(batch["margin"].tolist())
    else:
        assert batch["margin"].abs().sum() == 0

    rewards = pair_rewards(model.train(), batch)
    losses, stats = bradley_terry_loss(rewards, batch["margin"], center)
    expected = trainer.compute_loss(trainer.model.train(), theirs)
    assert float(losses.detach().mean()) == pytest.approx(float(expected), abs=1e-6)
    logged = _trl_metrics(trainer)
    for name, value in zip(STATS, stats.mean(0), strict=True):
        assert float(value) == pytest.approx(logged[name], abs=1e-6)
    with torch.no_grad():
        scores = rm.score(rm.eval_step(model, batch), data, None)
    for name in ("accuracy", "margin", "mean_reward", "min_reward", "max_reward"):
        assert scores[name] == pytest.approx(logged[name], abs=1e-6), name
    assert scores["loss"] == pytest.approx(float(expected), abs=1e-6)
    if not margins and center is None:  # the head is random: rewards spread, some pairs wrong
        assert 0 < scores["accuracy"] < 1 and scores["max_reward"] > scores["min_reward"]


def _trl_metrics(trainer) -> dict[str, float]:
    return {name: values[-1] for name, values in trainer._metrics["train"].items()}


def test_bad_settings_and_margins_are_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"task\.center_rewards_coefficient=-1"):
        make_task("reward_model", center_rewards_coefficient=-1)
    with pytest.raises(ConfigError, match=r"task\.truncation='cut'"):
        make_task("reward_model", truncation="cut")
    from recipes import rewards

    with pytest.raises(ConfigError, match=r"reward_model's path=.*: not a model folder"):
        rewards.build({"name": "reward_model", "path": str(tmp_path)}, 16)
    rm = make_task("reward_model", chat_template="zephyr", max_seq_length=256)
    tokenizer = load_tokenizer(ModelConfig(name_or_path=str(TINY_LLAMA)))
    cfg = DataConfig(path=str(tmp_path), cache_dir=str(tmp_path / "cache"))
    for margins, words in (
        (
            [1.0, None, 2.0, None],
            "2 pair(s) have no 'margin' where others have one (first: line 2)",
        ),
        ([1.0, "big", 2.0, 0.0], "line 2: field 'margin' is 'big', not a finite number"),
    ):
        given = zip(ROWS[:4], margins, strict=True)
        rows = [r | ({"margin": m} if m is not None else {}) for r, m in given]
        for name in ("train.jsonl", "dev.jsonl"):
            (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
        with pytest.raises(DataError) as err:
            rm.build_data(cfg, tokenizer)
        assert words in str(err.value)


# ---------------------------------------------------------------------------- end to end

SMOKE = ("recipe=llama_rm", "debug=smoke", "logger=none", "trainer.progress_bar=false")


def _rewards(final: Path, rows: list[dict]) -> list[list[float]]:
    """final/'s rewards of each pair's sides, loaded as a user loads it (its tokenizer renders
    them with the template it was trained with)."""
    from transformers import AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(final).eval()
    tokenizer = AutoTokenizer.from_pretrained(final)
    out = []
    for row in rows:
        sides = [row["prompt"] + row[side] for side in ("chosen", "rejected")]
        ids = [tokenizer.apply_chat_template(s, tokenize=True, return_dict=True) for s in sides]
        with torch.no_grad():
            out.append([float(model(torch.tensor([i["input_ids"]])).logits[0, 0]) for i in ids])
    return out


def _trained(run: Path, cache: Path, *more: str) -> tuple[str, ...]:
    """The smoke recipe (LoRA, the score head trained in full) for 16 steps of 8 pairs,
    evaluated before and after, a checkpoint at step 8."""
    return (
        *SMOKE,
        f"output_dir={run}",
        f"data.cache_dir={cache}",
        "trainer.max_steps=16",
        "trainer.log_every_n_steps=2",
        "trainer.eval_every_n_steps=16",
        "trainer.save_every_n_steps=8",
        *more,
    )


@pytest.fixture(scope="module")
def trained(tmp_path_factory, cache_dir) -> Path:
    run = tmp_path_factory.mktemp("trained") / "run"
    run_train(*_trained(run, cache_dir))
    return run


@pytest.mark.slow
def test_smoke_run_learns_and_mode_eval_scores_final_as_the_run(trained, tmp_path, cache_dir):
    """Accuracy rises; a checkpoint holds what trains (the adapter and the score head); mode=eval
    of final/ gives the run's last evaluation."""
    evals = [m for m in read_metrics(trained) if "eval/accuracy" in m]
    first, last = evals[0], evals[-1]
    assert last["eval/accuracy"] > first["eval/accuracy"] + 0.1
    assert last["eval/loss"] < first["eval/loss"] and last["eval/margin"] > 0
    train = [m for m in read_metrics(trained) if "train/loss" in m]
    assert all(f"train/{k}" in train[-1] for k in ("accuracy", "margin", "mean_reward"))
    checkpoint = sorted((trained / "checkpoints").glob("step-*"))[-1]
    weights = load_file(checkpoint / "model.safetensors")
    assert any("score" in k for k in weights)
    assert all("lora_" in k or "score" in k for k in weights)

    out = tmp_path / "eval"
    final = f"model.name_or_path={trained / 'final'}"
    run_train(*SMOKE, "mode=eval", final, f"data.cache_dir={cache_dir}", f"output_dir={out}")
    (evaluated,) = [m for m in read_metrics(out) if "eval/accuracy" in m]
    for name in ("loss", "accuracy", "margin", "min_reward"):
        assert evaluated[f"eval/{name}"] == pytest.approx(last[f"eval/{name}"], abs=1e-5)


@pytest.mark.slow
def test_mode_predict_scores_as_final_loaded_by_transformers(trained, tmp_path):
    """mode=predict's rewards of each pair's sides are those of final/ loaded with
    AutoModelForSequenceClassification and its tokenizer's chat template."""
    rows = ROWS[:3]
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "predict"
    final = f"model.name_or_path={trained / 'final'}"
    run_train(*SMOKE, "mode=predict", final, f"data.predict_file={pairs}", f"output_dir={out}")
    lines = (out / "predictions.jsonl").read_text().splitlines()
    predicted = [json.loads(line) for line in lines]
    assert [p["id"] for p in predicted] == [0, 1, 2]
    got = [p[f"{side}_reward"] for p in predicted for side in ("chosen", "rejected")]
    expected = [r for pair in _rewards(trained / "final", rows) for r in pair]
    assert got == pytest.approx(expected, abs=1e-5)
    assert len(set(got)) == len(got)


def _steps(run: Path) -> list[tuple[float, ...]]:
    keys = ("train/loss", "train/grad_norm", "train/accuracy", "train/margin", "eval/accuracy")
    keys += ("eval/loss",)
    return [(m["step"], k, m[k]) for m in read_metrics(run) for k in keys if k in m]


@pytest.mark.slow
def test_killed_and_resumed_equals_the_uninterrupted_run(trained, tmp_path, cache_dir):
    run = tmp_path / "run"
    proc = start_train(*_trained(run, cache_dir))
    kill_at_checkpoint(proc, run, 8)
    done = run_train(*_trained(run, cache_dir), "resume=auto")
    assert "resumed from" in done.stderr
    assert len(_steps(trained)) == 8 * 4 + 2 * 2
    assert _steps(run) == _steps(trained)  # every step and both evaluations, exactly


@pytest.mark.slow
def test_two_processes_train_like_one(trained, tmp_path, cache_dir):
    """Two gloo processes of four pairs each: each pair weighs the same as in one process."""
    two = tmp_path / "two"
    more = ("trainer.per_device_train_batch_size=4", "trainer.eval_at_start=false")
    more += ("trainer.save_every_n_steps=0", "trainer.save_final_model=false")  # faster
    proc = run_torchrun(*_trained(two, cache_dir, *more))
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected, got = [s for s in _steps(trained) if s[0] > 0], _steps(two)
    assert [g[:2] for g in got] == [e[:2] for e in expected]
    # Sums in another order drift by about 1e-5 over 16 steps at the smoke run's lr 5e-3.
    assert [g[2] for g in got] == pytest.approx([e[2] for e in expected], rel=1e-3, abs=1e-4)


@pytest.mark.slow
def test_grpo_scores_completions_with_the_trained_reward_model(trained, tmp_path, cache_dir):
    """task.rewards=[{name: reward_model, path: final/}]: the reward of a prompt and completion
    is final/'s score of the whole conversation (batched, padded: equal to one at a time), and a
    GRPO smoke run trains on it."""
    from recipes import rewards

    final = trained / "final"
    name, _, reward = rewards.build(
        {"name": "reward_model", "path": str(final), "batch_size": 2}, 16
    )
    rows = ROWS[:3]
    got = reward(prompts=[r["prompt"] for r in rows], completions=[r["chosen"] for r in rows])
    expected = [pair[0] for pair in _rewards(final, rows)]
    assert name == "reward_model" and got == pytest.approx(expected, abs=1e-5)

    run = tmp_path / "grpo"
    run_train(
        "recipe=llama_grpo",
        "debug=smoke",
        "logger=none",
        "trainer.progress_bar=false",
        f"output_dir={run}",
        f"data.cache_dir={cache_dir}",
        f"task.rewards=[{{name:reward_model,path:'{final}'}}]",
        "trainer.max_steps=3",
        "trainer.log_every_n_steps=1",
        "trainer.eval_at_start=false",
        "trainer.eval_every_n_steps=0",
        "trainer.eval_at_end=false",
        "trainer.save_final_model=false",
        "task.num_held_out_answers=0",
    )
    train = [m for m in read_metrics(run) if "train/reward" in m]
    assert len(train) == 3
    # Rewards of the tiny random policy's completions: real scores, spread within each step.
    assert all(m["train/rewards/reward_model/std"] > 0 for m in train)
    assert all(m["train/reward"] == m["train/rewards/reward_model/mean"] for m in train)


def test_predict_rows_are_pairs_or_whole_conversations(tmp_path):
    """mode=predict reads a file of pairs (both sides) or of conversations (each whole): the
    bundled SQuAD conversations render as the chosen sides of the pairs built from them."""
    conversations_file = ROOT / "recipes/assets/conversations/squad/dev.jsonl"
    files = {"pairs": PAIRS, "conversations": tmp_path / "conversations.jsonl"}
    lines = conversations_file.read_text().splitlines()[:4]
    files["conversations"].write_text("".join(line + "\n" for line in lines))
    rm = make_task("reward_model", chat_template="zephyr", max_seq_length=256)
    read = {}
    for kind, path in files.items():
        tokenizer = load_tokenizer(ModelConfig(name_or_path=str(TINY_LLAMA)))
        read[kind] = rm.build_predict_data(DataConfig(predict_file=str(path)), tokenizer)
    assert read["pairs"].pairs and not read["conversations"].pairs
    # Every pair gets its rewards, those that training would drop for their length cut to it.
    assert read["pairs"].row_ids == list(range(len(PAIRS.read_text().splitlines())))
    assert len(read["pairs"].eval) == len(read["pairs"].row_ids)
    assert max(map(len, read["pairs"].eval["chosen_input_ids"])) == 256
    chosen = read["pairs"].eval["chosen_input_ids"][:4]
    assert read["conversations"].eval["input_ids"] == chosen
    batch = read["conversations"].eval_collator([read["conversations"].eval[i] for i in range(4)])
    assert set(batch) == {"input_ids", "attention_mask"}
