"""DPO (``task=dpo``): pair layouts and their refusals, completion-only labels, padded and
padding-free batches, the reference (adapter disabled, precomputed), and the recipe end to end:
reward accuracy rising, accumulation and two processes training like one, kill -9 and resume."""

from __future__ import annotations

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
from transformers import AutoModelForCausalLM

from recipes.config import ConfigError, DataConfig, ModelConfig
from recipes.data import DataError
from recipes.model import load_tokenizer
from recipes.tasks import chat
from recipes.tasks.chat import Reference

PAIRS = ROOT / "recipes/assets/preferences/squad"
TINY_LLAMA = ROOT / "recipes/assets/tiny-llama"
PROMPT = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "Where is Paris?"},
]
CHOSEN = [{"role": "assistant", "content": "In France."}]
REJECTED = [{"role": "assistant", "content": "In Spain."}]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ModelConfig(name_or_path=str(TINY_LLAMA)))


# ------------------------------------------------------------------------------ layouts


@pytest.mark.parametrize(
    "row",
    [
        {"prompt": PROMPT, "chosen": CHOSEN, "rejected": REJECTED},  # TRL, conversational
        {"prompt": PROMPT, "chosen": PROMPT + CHOSEN, "rejected": PROMPT + REJECTED},  # binarized
        {"chosen": PROMPT + CHOSEN, "rejected": PROMPT + REJECTED},  # implicit prompt
    ],
    ids=["explicit", "ultrafeedback-binarized", "implicit"],
)
def test_layouts_read_as_one_pair(row):
    assert chat.preference.to_pair(row) == (PROMPT, CHOSEN, REJECTED)


def test_text_rows_and_raw_ultrafeedback():
    text = {"prompt": "Where is Paris?", "chosen": "In France.", "rejected": "In Spain."}
    assert chat.preference.to_pair(text) == (PROMPT[1:], CHOSEN, REJECTED)
    scored = {
        "instruction": "Where is Paris?",
        "completions": [
            {"response": "In Italy.", "overall_score": 3},
            {"response": "In France.", "overall_score": 9.5},
            {"response": "In Spain.", "overall_score": 1},
        ],
    }
    assert chat.preference.to_pair(scored) == (PROMPT[1:], CHOSEN, REJECTED)  # best against worst
    ties = {**scored, "completions": [{"response": "a", "overall_score": 2}] * 2}
    assert chat.preference.to_pair(ties) is None  # no preference: left out


def test_malformed_pair_file_is_refused_with_lines_and_fields(tmp_path):
    rows = [
        {"prompt": PROMPT, "chosen": CHOSEN, "rejected": REJECTED},
        {"prompt": PROMPT, "chosen": CHOSEN},  # no rejected: fits no layout
        {"prompt": PROMPT + CHOSEN, "chosen": CHOSEN, "rejected": REJECTED},
        {"prompt": PROMPT, "chosen": CHOSEN, "rejected": 7},
        {"chosen": CHOSEN, "rejected": REJECTED},  # nothing shared: no prompt
    ]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError) as err:
        chat.preference.read_pairs(path)
    message = str(err.value)
    assert "4 row(s) are not preference pairs" in message
    assert "line 2: fits no layout (fields: chosen, prompt)" in message
    assert "line 3: the prompt ends with an assistant turn" in message
    assert "line 4: field 'rejected' is int" in message
    assert "(and 1 more)" in message and "task.format=" in message


def test_pairs_whose_two_replies_are_the_same_are_kept_and_warned_of_once(tmp_path):
    """A pair that prefers nothing trains as TRL trains it, but is said, with a count: once per
    file, however many there are (two here, one in the implicit layout)."""
    import logging

    rows = [
        {"prompt": PROMPT, "chosen": CHOSEN, "rejected": REJECTED},
        {"prompt": PROMPT, "chosen": CHOSEN, "rejected": CHOSEN},
        {"prompt": "Where is Paris?", "chosen": "In France.", "rejected": "In France."},
        {"chosen": PROMPT + REJECTED, "rejected": PROMPT + CHOSEN},
    ]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger(chat.preference.__name__)
    logger.addHandler(handler)
    try:
        pairs = chat.preference.read_pairs(path)
    finally:
        logger.removeHandler(handler)
    assert len(pairs) == 4
    said = [r for r in records if "same chosen and rejected" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING
    assert said[0].getMessage().startswith(f"{path}: 2 pair(s) have the same chosen and rejected")


# ----------------------------------------------------------------------------- features


def _build(tmp_path: Path, tokenizer, rows: list[dict], **task) -> tuple:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "dev.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    dpo = make_task("dpo", chat_template="zephyr", max_seq_length=256, **task)
    cfg = DataConfig(path=str(tmp_path), cache_dir=str(tmp_path / "cache"))
    return dpo, dpo.build_data(cfg, tokenizer)


def test_only_the_completion_is_labelled(tmp_path, tokenizer):
    earlier = [{"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Rome?"}]
    row = {"prompt": PROMPT + earlier, "chosen": CHOSEN, "rejected": REJECTED}
    _, data = _build(tmp_path, tokenizer, [row])
    feature = data.train[0]
    for side, reply in (("chosen", "In France."), ("rejected", "In Spain.")):
        labelled = [t for t in feature[f"{side}_labels"] if t != chat.IGNORE_INDEX]
        # The reply and the end of its turn (zephyr's EOS); not the prompt's earlier reply.
        assert tokenizer.decode(labelled) == reply + tokenizer.eos_token
    assert feature["chosen_input_ids"][:5] == feature["rejected_input_ids"][:5]


def test_padded_and_padding_free_batches_give_the_same_log_probs(tmp_path, tokenizer):
    rows = [json.loads(line) for line in (PAIRS / "dev.jsonl").read_text().splitlines()[:6]]
    model = AutoModelForCausalLM.from_pretrained(TINY_LLAMA, attn_implementation="sdpa").eval()
    logps = {}
    for free in (False, True):
        dpo, data = _build(tmp_path / str(free), tokenizer, rows, padding_free=free)
        dpo.check_model(model)
        batch = data.train_collator([data.train[i] for i in range(len(data.train))])
        assert ("position_ids" in batch) is free
        assert batch["input_ids"].shape[0] == (6 if free else 12)
        with torch.no_grad():
            logps[free] = dpo._logps_of(model, batch)[0]
    torch.testing.assert_close(logps[True], logps[False], atol=1e-4, rtol=1e-5)
    assert (logps[False] < 0).all()


def test_lora_reference_is_the_base_model(tmp_path, tokenizer):
    from omegaconf import OmegaConf

    from recipes import adapters
    from recipes.config import peft_settings

    rows = [json.loads(line) for line in (PAIRS / "dev.jsonl").read_text().splitlines()[:4]]
    dpo, data = _build(tmp_path, tokenizer, rows)
    base = AutoModelForCausalLM.from_pretrained(TINY_LLAMA).eval()
    dpo.check_model(base)
    batch = data.train_collator([data.train[i] for i in range(len(data.train))])
    with torch.no_grad():
        expected = dpo._logps_of(base, batch)[0]
    lora = peft_settings(OmegaConf.load(ROOT / "conf/peft/lora.yaml"))
    model = adapters.apply_lora(AutoModelForCausalLM.from_pretrained(TINY_LLAMA), lora, []).eval()
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if "lora_B" in name:
                weight.normal_(std=0.5)  # a trained adapter
        trained = dpo._logps_of(model, batch)[0]
        reference = Reference(adapter_disabled=True).logps(model, batch, dpo._reference_forward)
    assert not torch.allclose(trained, expected, atol=1e-3)
    torch.testing.assert_close(reference, expected)


def test_settings_are_checked():
    with pytest.raises(ConfigError, match=r"task\.loss_type='hinge'"):
        make_task("dpo", loss_type="hinge")
    with pytest.raises(
        ConfigError, match=r"task\.label_smoothing=0\.1 is for task\.loss_type=robust"
    ):
        make_task("dpo", loss_type="ipo", label_smoothing=0.1)
    with pytest.raises(ConfigError, match=r"task\.beta=0"):
        make_task("dpo", beta=0)


# ---------------------------------------------------------------------------- end to end

SMOKE = ("recipe=llama_dpo", "debug=smoke", "logger=none", "trainer.progress_bar=false")


@pytest.mark.slow
def test_smoke_run_raises_reward_accuracy_and_saves_what_trains(tmp_path, cache_dir):
    run = tmp_path / "run"
    run_train(*SMOKE, f"output_dir={run}", f"data.cache_dir={cache_dir}")
    evals = [m for m in read_metrics(run) if "eval/rewards/accuracies" in m]
    first, last = evals[0], evals[-1]
    assert first["eval/rewards/accuracies"] == 0  # policy == reference at step 0
    assert first["eval/loss"] == pytest.approx(0.693147, abs=1e-5)  # -log sigmoid(0)
    assert last["eval/rewards/accuracies"] > 0.65
    assert last["eval/rewards/margins"] > 0 and last["eval/loss"] < first["eval/loss"]
    train = [m for m in read_metrics(run) if "train/rewards/margins" in m]
    assert train and all(
        f"train/{name}" in train[-1] for name in ("logps/chosen", "rewards/chosen")
    )
    # The checkpoint holds the adapter only (what trains); final/ is the merged model with the
    # chat template it was trained with.
    (checkpoint,) = (run / "checkpoints").glob("step-*")
    weights = load_file(checkpoint / "model.safetensors")
    assert weights and all("lora_" in k for k in weights)
    config = json.loads((run / "final" / "tokenizer_config.json").read_text())
    template = config.get("chat_template") or (run / "final" / "chat_template.jinja").read_text()
    assert "<|assistant|>" in template
    AutoModelForCausalLM.from_pretrained(run / "final")


def _steps(run: Path) -> list[tuple[float, ...]]:
    keys = ("train/loss", "train/grad_norm", "train/rewards/margins", "train/logps/chosen")
    return [tuple(m[k] for k in keys) for m in read_metrics(run) if "train/loss" in m]


def _short(run: Path, cache: Path, per_device: int, accumulation: int, *more: str) -> tuple:
    return (
        *SMOKE,
        f"output_dir={run}",
        f"data.cache_dir={cache}",
        "task.num_generations=0",
        "trainer.max_steps=3",
        "trainer.log_every_n_steps=1",
        "trainer.save_every_n_steps=0",
        "trainer.eval_at_start=false",
        "trainer.eval_at_end=false",
        "trainer.save_final_model=false",
        f"trainer.per_device_train_batch_size={per_device}",
        f"trainer.gradient_accumulation_steps={accumulation}",
        *more,
    )


@pytest.mark.slow
def test_accumulation_two_processes_and_precomputed_reference_train_like_one(tmp_path, cache_dir):
    """Each pair weighs the same however pairs fall into micro-batches and processes. The two
    processes precompute the reference's log-probs (each a share) and cache them; the run with
    accumulation reads them from the cache; both equal the live reference of the first run."""
    whole, accumulated, two = tmp_path / "whole", tmp_path / "accumulated", tmp_path / "two"
    precompute = "task.precompute_reference=true"
    run_train(*_short(whole, cache_dir, 8, 1))
    proc = run_torchrun(*_short(two, cache_dir, 4, 1, precompute), processes=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "precomputed log-probs cached in" in proc.stderr
    done = run_train(*_short(accumulated, cache_dir, 2, 4, precompute))
    assert "precomputed log-probs read from the cache" in done.stderr
    expected = _steps(whole)
    assert len(expected) == 3
    for run in (accumulated, two):
        got = _steps(run)
        for column in range(4):
            assert [g[column] for g in got] == pytest.approx(
                [e[column] for e in expected], rel=1e-4, abs=1e-6
            )


@pytest.mark.slow
def test_full_fine_tuning_killed_and_resumed_equals_the_uninterrupted_run(tmp_path, cache_dir):
    """peft=none: the reference is a frozen copy of the starting weights, made again from them
    (not from the checkpoint) when the killed run resumes."""
    more = ("peft=none", "trainer.max_steps=12", "trainer.save_every_n_steps=4")
    reference = tmp_path / "reference"
    run_train(*_short(reference, cache_dir, 4, 1, *more))
    run = tmp_path / "run"
    proc = start_train(*_short(run, cache_dir, 4, 1, *more))
    kill_at_checkpoint(proc, run, 8)
    done = run_train(*_short(run, cache_dir, 4, 1, *more), "resume=auto")
    assert "resumed from" in done.stderr and "frozen copy" in done.stderr
    assert _steps(run) == _steps(reference)  # every step, exactly
    # A checkpoint holds the trained model once, not the frozen reference beside it.
    saved = sorted(p.name for p in (run / "checkpoints" / "step-00000012").glob("model*"))
    assert saved == ["model.safetensors"], saved
