"""task=grpo: the reward functions, the rows, the sampling seeds and the sampler that repeats
steps, refusals; and (slow) the smoke run's reward rising, resume after SIGKILL in the middle of
a generation batch, and two processes against one. The loss, advantages and gradient against
TRL's GRPOTrainer are in tests/test_grpo_trl.py."""

from __future__ import annotations

import math
import os
from fractions import Fraction

import pytest
import torch
from conftest import ROOT, make_task, read_metrics, run_cpu_launch, run_train
from datasets import Dataset

from recipes import rewards
from recipes.config import ConfigError
from recipes.data import DataError, RepeatedStepsSampler
from recipes.tasks import grpo


def _call(spec, completions, **row):
    _, _, fn = rewards.build(spec, max_completion_length=10)
    prompts = ["p"] * len(completions)
    ids = [[1] * len(c.split()) for c in completions]
    return fn(prompts=prompts, completions=completions, completion_ids=ids, **row)


# ------------------------------------------------------------------------------- rewards


def test_math_answer_reads_fractions_decimals_separators_and_final_markers():
    read = rewards.final_answer
    assert read("so the answer is 1/2") == Fraction(1, 2)
    assert read("It costs $1,000.50 in all.") == Fraction("1000.50")
    assert read("first 3, then \\boxed{-7} and 9 more") == Fraction(-7)
    assert read("<think>2+2 is 4</think><answer>4</answer> (or 5)") == Fraction(4)
    assert read("Natalia sold 48/2 = 24 clips in May.\n#### 72") == Fraction(72)
    assert read("no number here") is None
    got = _call(
        {"name": "math_answer"},
        ["the answer is 0.5", "1/2", "It is 2.", "", "I think 3/6"],
        answer=["1/2", "#### 0.5", "3", "1", "0.5"],
    )
    assert got == [1.0, 1.0, 0.0, 0.0, 1.0]
    # A reference without a number is not this reward's row: None, left out of the sum.
    assert _call({"name": "math_answer"}, ["4"], answer=["four"]) == [None]


def test_answer_rewards_format_length_and_span_overlap():
    row = {"answer": [["Saint Bernadette Soubirous"], "the Eiffel Tower"]}
    assert _call({"name": "answer_match"}, ["saint bernadette soubirous.", "Eiffel"], **row) == [
        1.0,
        0.0,
    ]
    f1 = _call({"name": "answer_f1"}, ["Bernadette", "The Eiffel Tower!"], **row)
    assert f1[0] == pytest.approx(0.5) and f1[1] == 1.0
    fmt = _call({"name": "format"}, ["<think>a</think>\n<answer>b</answer>", "<answer>b</answer>"])
    assert fmt == [1.0, 0.0]
    one_line = _call({"name": "format", "pattern": "[^\\n]+"}, ["a b", "a\nb"])
    assert one_line == [1.0, 0.0]
    assert _call({"name": "length"}, ["a b c", ""]) == [-0.3, -0.0]
    prompts = [[{"role": "user", "content": "The grotto at Lourdes, France."}]]
    _, _, overlap = rewards.build({"name": "span_overlap"}, 10)
    got = overlap(prompts=prompts, completions=[[{"role": "assistant", "content": "Lourdes x"}]])
    assert got == [0.5]


def test_user_reward_by_import_path_with_options(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def starts_with(prompts, completions, prefix, **kwargs):\n"
        "    return [float(c.startswith(prefix)) for c in completions]\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    name, weight, fn = rewards.build(
        {"name": "my_rewards:starts_with", "weight": 2, "prefix": "A"}, 5
    )
    assert (name, weight) == ("starts_with", 2.0)
    assert fn(prompts=["p", "p"], completions=["Ab", "b"]) == [1.0, 0.0]


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ({"name": "no_such_reward"}, "neither a built-in"),
        ({"name": "answer_f2"}, "did you mean answer_f1?"),
        ({"name": "math_anwser"}, "did you mean math_answer?"),
        ({"name": "json:dumpz"}, "no attribute 'dumpz'); did you mean dump?"),
        ({"name": "my_missing_module:fn"}, "cannot import"),
        ({"name": "answer_f1", "weight": "high"}, "weight='high' must be a number"),
        ({"name": "format", "pattern": "("}, "is not a regular expression"),
        ({"weight": 1}, "has no name"),
    ],
)
def test_bad_reward_specs_are_refused(spec, words):
    with pytest.raises(ConfigError, match=r"task\.rewards") as err:
        rewards.build(spec, 10)
    assert words in str(err.value)


def test_missing_answer_column_names_it():
    with pytest.raises(ConfigError, match="column 'solution'"):
        _call({"name": "math_answer", "column": "solution"}, ["1"], answer=["1"])


# --------------------------------------------------------------------------- advantages


def test_unscorable_completions_get_no_advantage_and_scaling_options():
    task = make_task("grpo", num_generations=2, rewards=[{"name": "answer_f1"}, {"name": "length"}])
    table = torch.tensor([[1.0, 0.0], [0.0, 0.0], [math.nan, math.nan], [0.5, math.nan]])
    advantages, stats = task.advantages(table)
    assert advantages[2] == 0 and advantages[3] == 0  # its group: one scorable completion
    assert advantages[0] == pytest.approx(0.5 / (math.sqrt(0.5) + 1e-4))
    assert stats["rewards/answer_f1/mean"] == pytest.approx(0.5)
    assert stats["frac_reward_zero_std"] == 0.0  # the NaN group's std is NaN, not zero
    task.args.scale_rewards = "none"
    assert task.advantages(table)[0][0] == pytest.approx(0.5)


def test_user_reward_failures_name_the_function_and_the_completion():
    rows = [{"prompt": "p", "place": "row 3"}, {"prompt": "q", "place": "row 4"}]

    def table(fn):
        return grpo.reward_table([fn], ["mine"], rows, ["a", "7"], [[1], [2]])

    def parse(prompts, completions, **kw):
        return [float(int(c)) for c in completions]

    with pytest.raises(ConfigError) as err:
        table(parse)
    assert "mine raised ValueError" in str(err.value)
    assert "on completion 0 (the prompt of train row 3)" in str(err.value)
    assert "stopped before any step used its rewards" in str(err.value)
    with pytest.raises(ConfigError, match=r"returned '1\.0' \(str\) for completion 0"):
        table(lambda prompts, completions, **kw: ["1.0", 1.0])
    with pytest.raises(ConfigError, match=r"returned inf \(float\) for completion 1 \(the"):
        table(lambda prompts, completions, **kw: [0.0, math.inf])
    with pytest.raises(ConfigError, match=r"returned 0\.5 \(float\) for 2 completions"):
        table(lambda prompts, completions, **kw: 0.5)
    # None and NaN are "not scored" (TRL's rule); numpy and one-element tensors are numbers.
    got = table(lambda prompts, completions, **kw: [None, torch.tensor(2.0)])
    assert math.isnan(got[0, 0]) and got[1, 0] == 2.0


def test_async_rewards_are_awaited_and_bad_signatures_or_float32_overflow_are_named():
    rows = [{"prompt": "p", "place": "row 3"}, {"prompt": "q", "place": "row 4"}]

    def table(fn):
        return grpo.reward_table([fn], ["mine"], rows, ["a", "bb"], [[1], [2]])

    async def lengths(prompts, completions, **kw):  # TRL awaits an async reward function
        return [float(len(c)) for c in completions]

    assert table(lengths).flatten().tolist() == [1.0, 2.0]
    with pytest.raises(ConfigError) as err:
        table(lambda completions: [0.0, 0.0])  # no **kwargs: TRL passes prompts too
    assert "mine cannot be called as TRL calls a reward function" in str(err.value)
    assert "def reward(completions, **kwargs)" in str(err.value)
    with pytest.raises(ConfigError, match=r"returned 1e\+39 \(float\) for completion 1"):
        table(lambda prompts, completions, **kw: [0.0, 1e39])  # inf once a float32 tensor


def test_a_reward_that_scores_no_completion_logs_no_number_not_zero():
    task = make_task("grpo", num_generations=2, rewards=[{"name": "answer_f1"}, {"name": "length"}])
    table = torch.tensor([[math.nan, -0.5], [math.nan, -0.25]])
    _, stats = task.advantages(table)
    assert math.isnan(stats["rewards/answer_f1/mean"])  # null in metrics.jsonl, not 0
    assert stats["reward"] == pytest.approx(-0.375)


def test_user_reward_returning_the_wrong_count_is_refused():
    with pytest.raises(ConfigError, match="returned 1 rewards for 2 completions"):
        grpo.reward_table(
            [lambda prompts, completions, **kw: [1.0]],
            ["short"],
            [{"prompt": "p"}, {"prompt": "p"}],
            ["a", "b"],
            [[1], [2]],
        )


# ------------------------------------------------------------------------------ data


def test_prompt_rows_from_trl_prompts_and_conversations():
    rows = grpo.prompt_rows(
        Dataset.from_list(
            [
                {
                    "messages": [
                        {"role": "user", "content": "Q?"},
                        {"role": "assistant", "content": "A"},
                    ]
                }
            ]
        ),
        "f",
    )
    assert rows[0]["prompt"] == [{"role": "user", "content": "Q?"}] and rows[0]["answer"] == "A"
    rows = grpo.prompt_rows(Dataset.from_list([{"prompt": "2+2?", "solution": "4"}]), "f")
    assert rows[0]["prompt"] == "2+2?" and rows[0]["solution"] == "4"
    with pytest.raises(DataError, match="f row 0: a GRPO row needs 'prompt'"):
        grpo.prompt_rows(Dataset.from_list([{"question": "?"}]), "f")
    with pytest.raises(DataError, match="f row 0: the prompt is empty"):
        grpo.prompt_rows(Dataset.from_list([{"prompt": ""}]), "f")


def test_row_seeds_depend_on_the_row_and_epoch_not_the_batch():
    collate = grpo.PromptCollator(0)
    collate.start_epoch(7, 0)
    rows = [{"input_ids": [1, 2, 3], "index": 5}, {"input_ids": [4], "index": 9}]
    together = collate(rows)
    alone = collate(rows[1:])
    assert together["row_seed"][1] == alone["row_seed"][0]
    assert together["input_ids"].tolist() == [[1, 2, 3], [0, 0, 4]]  # left-padded
    collate.start_epoch(7, 1)
    assert collate(rows[1:])["row_seed"][0] != alone["row_seed"][0]


def test_repeated_steps_sampler_gives_each_global_batch_num_iterations_times():
    sampler = RepeatedStepsSampler(size=10, batch_size=4, repeat=2, seed=3)
    order = list(sampler)
    assert len(order) == len(sampler) == 20
    assert order[0:4] == order[4:8] and order[8:12] == order[12:16] and order[16:18] == order[18:]
    assert sorted(order[0:4] + order[8:12] + order[16:18]) == list(range(10))
    sampler.set_epoch(1)
    assert list(sampler) != order


@pytest.mark.parametrize(
    ("setting", "words"),
    [
        ({"loss_type": "ppo"}, "task.loss_type='ppo'"),
        ({"num_generations": 1}, "task.num_generations=1: must be >= 2"),
        ({"rewards": []}, "task.rewards is empty"),
        ({"scale_rewards": "std"}, "task.scale_rewards='std'"),
        ({"rewards": [{"name": "length"}, {"name": "length"}]}, "names repeat"),
        ({"loss_type": "luspo"}, "set task.importance_sampling_level=sequence"),
        (
            {"loss_type": "vespo", "importance_sampling_level": "sequence"},
            "set task.importance_sampling_level=token",
        ),
        ({"loss_type": "sapo", "delta": 1.5}, "task.delta=1.5 caps the clipped ratio"),
        ({"importance_sampling_level": "seq"}, "task.importance_sampling_level='seq'"),
    ],
)
def test_bad_settings_are_refused(setting, words):
    with pytest.raises(ConfigError) as err:
        make_task("grpo", **setting)
    assert words in str(err.value)


@pytest.mark.parametrize("beams,warned", [(4, 1), (1, 0), (None, 0)])
def test_unused_beams_are_warned_of_once(beams, warned):
    """generation.num_beams=4 with the continuous engine: GRPO samples its rollouts and answers
    its evaluation greedily, so the beams are unused; said once, when the run starts."""
    import logging
    import types

    from accelerate import Accelerator

    from recipes.config import GenerationConfig, ModelConfig
    from recipes.model import load_tokenizer
    from recipes.tasks.base import RunContext

    task = make_task("grpo", num_generations=2, beta=0.0, rewards=[{"name": "length"}])
    tokenizer = load_tokenizer(ModelConfig(name_or_path=str(ROOT / "recipes/assets/tiny-llama")))
    generation = GenerationConfig(num_beams=beams, engine="continuous")
    run = RunContext(Accelerator(cpu=True), tokenizer, None, generation)
    data = types.SimpleNamespace(
        rows={"train": []}, layout=types.SimpleNamespace(flat=False), stop_tokens=[]
    )
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger(grpo.__name__)
    logger.addHandler(handler)
    try:
        task.before_training(torch.nn.Linear(1, 1), data, run, 1)
    finally:
        logger.removeHandler(handler)
    lines = [r.getMessage() for r in records if "num_beams" in r.getMessage()]
    assert len(lines) == warned
    if warned:
        assert lines[0].startswith("generation.num_beams=4 (generation.engine=continuous) is ")
        assert records[0].levelno == logging.WARNING


# ----------------------------------------------------------------------------- runs

SHORT = (
    "recipe=llama_grpo",
    "debug=smoke",
    "logger=none",
    "trainer.log_every_n_steps=1",
    "trainer.eval_at_start=false",
    "trainer.eval_every_n_steps=0",
    "trainer.save_final_model=false",
    "task.num_held_out_answers=0",
)


@pytest.mark.slow
def test_smoke_reward_rises_and_final_reloads(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run = tmp_path / "run"
    proc = run_train("recipe=llama_grpo", "debug=smoke", "logger=none", f"output_dir={run}")
    assert "UserWarning" not in proc.stderr  # peft's two on the tied lm_head: said our way
    records = read_metrics(run)
    train = [r["train/reward"] for r in records if "train/reward" in r]
    evals = [r["eval/reward"] for r in records if "eval/reward" in r]
    assert sum(train[-2:]) / 2 > sum(train[:2]) / 2 + 0.3, train
    assert evals[-1] > evals[0] + 0.3, evals
    assert all("train/rewards/span_overlap/mean" in r for r in records if "train/reward" in r)
    model = AutoModelForCausalLM.from_pretrained(run / "final")  # merged LoRA, no adapter needed
    tokenizer = AutoTokenizer.from_pretrained(run / "final")
    assert tokenizer.chat_template and model.generation_config.eos_token_id is not None
    assert not (run / "final" / "adapter_config.json").exists()
    kept = run / "checkpoints"
    assert all("lora_" in k or "lm_head" in k for k in _checkpoint_keys(kept))


def _checkpoint_keys(checkpoints):
    from safetensors import safe_open

    folder = sorted(checkpoints.glob("step-*"))[-1]
    keys = []
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            keys += list(f.keys())
    return keys


@pytest.mark.slow
def test_resume_after_kill_mid_generation_equals_uninterrupted(tmp_path):
    """num_iterations=2: steps 1, 3, 5, 7 generate; the checkpoint of step 3 holds the rollout
    step 4 reuses (the old policy's log-probs); SIGKILL in step 5's generation, then resume."""
    settings = (
        *SHORT,
        "task.num_iterations=2",
        "trainer.max_steps=7",
        "trainer.save_every_n_steps=3",
        "trainer.per_device_train_batch_size=2",
    )
    whole = tmp_path / "whole"
    run_train(*settings, f"output_dir={whole}")
    killed = tmp_path / "killed"
    script = (str(ROOT / "tests/grpo_kill_during_generation.py"), "3")
    proc = run_train(*settings, f"output_dir={killed}", script=script, check=False)
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert (killed / "checkpoints/step-00000003").is_dir()
    run_train(*settings, f"output_dir={killed}", "resume=auto")

    def by_step(run):
        return {
            r["step"]: (r["train/loss"], r["train/reward"], r["train/completions/mean_length"])
            for r in read_metrics(run)
            if "train/loss" in r
        }

    want, got = by_step(whole), by_step(killed)
    for step in range(4, 8):
        assert got[step] == pytest.approx(want[step], rel=1e-5, abs=1e-7), step


@pytest.mark.slow
def test_two_processes_sample_and_learn_as_one(tmp_path):
    """The same global batch on one process (4 prompts) and on two (2 each): each completion is
    sampled from its row's own seed, so the rewards and losses are those of the one process
    (LoRA's dropout off: its masks are drawn per process)."""
    settings = (*SHORT, "trainer.max_steps=3", "peft.dropout=0")
    one = tmp_path / "one"
    run_train(*settings, "trainer.per_device_train_batch_size=4", f"output_dir={one}")
    two = tmp_path / "two"
    proc = run_cpu_launch(
        ROOT / "train.py", *settings, "trainer.per_device_train_batch_size=2", f"output_dir={two}"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]

    def curve(run):
        keys = ("train/reward", "train/loss", "train/completions/mean_length", "train/grad_norm")
        return [r[k] for r in read_metrics(run) if "train/loss" in r for k in keys]

    assert len(curve(one)) == 3 * 4 and any(curve(one)[3::4])  # gradients flowed
    assert curve(two) == pytest.approx(curve(one), rel=1e-4, abs=1e-6)


# A user's reward module (task.rewards: my_rewards:<name>), for the runs below.
MY_REWARDS = """
import math


def parse_int(prompts, completions, **kwargs):
    return [float(int(c[0]["content"])) for c in completions]  # a tiny model writes no number


def words(prompts, completions, **kwargs):
    return ["good" for c in completions]


def never(prompts, completions, **kwargs):
    return [math.nan for c in completions]


def every_third(prompts, completions, **kwargs):
    return [None if i % 3 == 0 else 1.0 for i in range(len(completions))]
"""


def _run_with_reward(tmp_path, name, *settings):
    (tmp_path / "my_rewards.py").write_text(MY_REWARDS)
    run = tmp_path / "run"
    proc = run_train(
        *SHORT,
        f"task.rewards=[{{name: my_rewards:{name}}}]",
        f"output_dir={run}",
        *settings,
        check=False,
        env={"PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"},
    )
    return run, proc


@pytest.mark.parametrize(
    ("name", "code", "words"),
    [
        ("parse_int", 2, "parse_int raised ValueError (invalid literal for int()"),
        ("words", 2, "words returned 'good' (str) for completion 0 (the prompt of train row"),
        ("never", 1, "no function scored any of a training step's 16 completions"),
    ],
)
def test_a_failing_reward_stops_the_run_in_one_line_recorded_in_train_log(
    tmp_path, name, code, words
):
    run, proc = _run_with_reward(tmp_path, name, "trainer.max_steps=2")
    assert proc.returncode == code, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and words in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "UserWarning" not in proc.stderr
    assert "stopped before" in errors[0]
    assert errors[0] in (run / "train.log").read_text()
    assert not (run / "final").exists()
    assert not [r for r in read_metrics(run) if "train/reward" in r]  # no step was logged


@pytest.mark.slow
def test_completions_no_function_scores_are_warned_once_per_log_window(tmp_path):
    run, proc = _run_with_reward(
        tmp_path, "every_third", "trainer.max_steps=4", "trainer.log_every_n_steps=2"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = (run / "train.log").read_text()
    assert log.count("got no reward from any function") == 2, log  # steps 1 and 3, not 4 times
    rewards = [r["train/reward"] for r in read_metrics(run) if "train/reward" in r]
    assert rewards == [1.0, 1.0]  # the mean of the scored completions, not diluted by zeros
