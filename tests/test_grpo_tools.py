"""task=grpo with task.tools (multi-turn tool calling): the same traces through TRL's
``GRPOTrainer`` and ours give the same token ids, masks, conversations, tool counts and loss; a
tool that raises and one that hangs become tool messages in a rollout the tiny model continues;
and (slow) the bundled calculator example trains with tool calls happening.

The traces: the first bundled arithmetic prompts (recipes/assets/arithmetic, not written for this
test), each with completions that call the calculator right, call an unknown tool, pass an
argument the tool does not take, call twice in one turn, answer without a tool, keep calling
until the budget is spent, and write the arguments as a JSON string (a failed call) and call
again. Neither side samples: TRL gets the first turns through its ``rollout_func`` and the later
turns from its ``_generate_single_turn``; ours from the ``generate`` its loop is given (the turn
a completion asks for next, cut to what it may have)."""

from __future__ import annotations

import copy
import dataclasses
import json
import sys
import time

import pytest
import torch
from conftest import ROOT, make_task, read_metrics, run_train
from transformers import AutoModelForCausalLM

from recipes import tool_calling
from recipes.config import ModelConfig
from recipes.losses.grpo import PolicyLossSettings, policy_loss
from recipes.model import load_tokenizer
from recipes.tasks import chat, grpo
from recipes.tools import calculator

trl = pytest.importorskip("trl")
pytestmark = pytest.mark.skipif(
    not tool_calling.parse_supported(), reason="task.tools needs transformers >= 5.13"
)

ARITHMETIC = ROOT / "recipes/assets/arithmetic/dev.jsonl"
TINY_LLAMA = ROOT / "recipes/assets/tiny-llama"
PROMPTS = 1
GROUP = 7
MAX_COMPLETION = 256
ITERATIONS = 3
REWARDS = [{"name": "tool_math_answer", "weight": 1.0}]


def _call(name: str, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def _call_as_string(name: str, **arguments) -> str:
    """A call whose arguments are a JSON string (``"{\\"expression\\": ...}"``), as models
    often write them: a failed call, with TRL's message (``argument after ** must be a
    mapping, not str``)."""
    encoded = {"name": name, "arguments": json.dumps(arguments)}
    return f"<tool_call>\n{json.dumps(encoded)}\n</tool_call>"


def _traces(question: str, answer: str) -> list[list[str]]:
    """Each completion's turns (text; each ends with <|im_end|>)."""
    expression = question.removeprefix("What is ").removesuffix("?")
    right = _call("calculator", expression=expression)
    return [
        [right, f"The answer is {answer}."],
        [_call("search", query=question), f"It is {answer}1."],
        [_call("calculator", formula=expression), right, f"So {answer}."],
        [right + "\n" + _call("calculator", expression="2 * 3"), f"{answer}"],
        ["I think it is 12."],
        ["Let me compute.\n" + right, right, right, right],  # past the budget
        [_call_as_string("calculator", expression=expression), right, f"So {answer}."],
    ]


def _setup():
    tokenizer = load_tokenizer(ModelConfig(name_or_path=str(TINY_LLAMA)))
    chat_template = chat.use_template(tokenizer, "qwen2_5")
    tokenizer.eos_token = "<|im_end|>"  # TRL ends a turn at EOS; ours at the template's stop
    tool_calling.use_parser(tokenizer)
    rows = [json.loads(line) for line in ARITHMETIC.read_text().splitlines()[:PROMPTS]]
    end = "<|im_end|>"
    turns = []  # per completion: token ids of each turn
    for row in rows:
        for trace in _traces(row["prompt"][-1]["content"], row["answer"]):
            turns.append([tokenizer(t + end, add_special_tokens=False)["input_ids"] for t in trace])
    model = AutoModelForCausalLM.from_pretrained(
        TINY_LLAMA, attn_implementation="sdpa", max_position_embeddings=2048
    )
    model.resize_token_embeddings(len(tokenizer))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for weight in model.parameters():
            weight.add_(torch.randn(weight.shape, generator=generator) * 0.05)
    return tokenizer, chat_template, rows, turns, model


class Script:
    """Hands each completion its next turn; a completion is known by its first turn."""

    def __init__(self, prompt_ids: list[list[int]], turns: list[list[list[int]]]) -> None:
        self.starts = [p + t[0] for p, t in zip(prompt_ids, turns, strict=True)]
        self.turns = turns
        self.asked = [1] * len(turns)

    def next_turn(self, ids: list[int]) -> list[int]:
        i = next(k for k, start in enumerate(self.starts) if ids[: len(start)] == start)
        turn = self.turns[i][self.asked[i]]
        self.asked[i] += 1
        return turn


def test_tool_calling_equals_trl(tmp_path):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    tokenizer, chat_template, rows, turns, model = _setup()
    task = make_task(
        "grpo",
        chat_template="qwen2_5",
        max_completion_length=MAX_COMPLETION,
        num_generations=GROUP,
        rewards=REWARDS,
        tools=["recipes.tools.calculator"],
        max_tool_calling_iterations=ITERATIONS,
    )
    ours_prompts = [
        task._prompt_ids(tokenizer, chat_template.template, {**r, "place": f"row {i}"}, "dev")
        for i, r in enumerate(rows)
    ]
    repeated = [p for p in ours_prompts for _ in range(GROUP)]
    seen = []  # the completions TRL's reward function is given

    def recorded(prompts, completions, **kwargs):
        seen.extend(copy.deepcopy(completions))
        return task.reward_fns[0](prompts=prompts, completions=completions, **kwargs)

    def rollout(prompts, trainer):
        return {
            "prompt_ids": repeated,
            "completion_ids": [t[0] for t in turns],
            "logprobs": None,
        }

    config = GRPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=GROUP * PROMPTS,
        num_generations=GROUP,
        max_completion_length=MAX_COMPLETION,
        max_tool_calling_iterations=ITERATIONS,
        report_to="none",
        use_cpu=True,
        bf16=False,
    )
    trainer = GRPOTrainer(
        model=copy.deepcopy(model),
        reward_funcs=[recorded],
        args=config,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        rollout_func=rollout,
        tools=[calculator],
    )
    trainer.current_gradient_accumulation_steps = 1
    # The same prompt ids: ours rendered with the tools' schemas as TRL renders them.
    assert trainer._tokenize_prompts([r["prompt"] for r in rows])[0] == ours_prompts
    theirs_script = Script(repeated, turns)
    trainer._generate_single_turn = lambda ids, *args, **kwargs: (
        [theirs_script.next_turn(i) for i in ids],
        None,
    )
    trainer.model.train()
    inputs = [row for row in rows for _ in range(GROUP)]
    theirs = trainer._generate_and_score_completions(inputs)

    ours_script = Script(repeated, turns)

    def generate(which, ids, limits):
        return [ours_script.next_turn(i)[:limit] for i, limit in zip(ids, limits, strict=True)]

    got = tool_calling.tool_call_loop(
        generate,
        tokenizer,
        chat_template.template,
        task.tools,
        repeated,
        [t[0] for t in turns],
        max_completion_length=MAX_COMPLETION,
        max_iterations=ITERATIONS,
        timeout=10.0,
        max_length=model.config.max_position_embeddings,
        ends=chat_template.stop_tokens,
    )
    completion, completion_mask = grpo._pad(got.completion_ids, tokenizer.pad_token_id, False)
    tool_mask = grpo._pad(got.tool_mask, 0, False)[0]
    width = theirs["completion_ids"].shape[1]
    assert completion.shape[1] == width
    assert torch.equal(completion * completion_mask, theirs["completion_ids"] * completion_mask)
    assert torch.equal(completion_mask, theirs["completion_mask"].long())
    assert torch.equal(tool_mask * completion_mask, theirs["tool_mask"] * completion_mask)
    assert got.messages == seen
    # Arguments as a JSON string: a failed call with TRL's message, then a second round of calls.
    as_string = got.messages[GROUP - 1]
    assert [m["role"] for m in as_string] == ["assistant", "tool", "assistant", "tool", "assistant"]
    assert "argument after ** must be a mapping, not str" in as_string[1]["content"]
    assert "error" not in as_string[3]["content"]
    # Results, failures, and a completion cut at the budget.
    assert 0 < got.failures < got.calls and (tool_mask == 0).any()
    for name, value in got.stats().items():
        assert value == pytest.approx(trainer._metrics["train"][name][-1], abs=1e-6), name
    assert max(len(c) for c in got.completion_ids) == MAX_COMPLETION  # cut at the budget

    row_list = [{**r, "place": f"row {i}"} for i, r in enumerate(rows) for _ in range(GROUP)]
    table = task._rewards(tokenizer, row_list, got.completion_ids, "dev", got.messages)
    advantages, _ = task.advantages(table)
    torch.testing.assert_close(advantages, theirs["advantages"].float(), rtol=1e-5, atol=1e-6)
    assert (advantages != 0).any()

    # The loss of every loss type: tool tokens out of the loss and of its token counts.
    prompt, prompt_mask = grpo._pad(repeated, tokenizer.pad_token_id, left=True)
    loss_mask = completion_mask * tool_mask
    with torch.no_grad():
        logps = task._logps(model.train(), prompt, prompt_mask, completion, loss_mask)
        for loss_type in ("dapo", "grpo", "bnpo", "dr_grpo"):
            trainer.loss_type = trainer.args.loss_type = loss_type
            theirs_loss = trainer._compute_loss(trainer.model, theirs)
            settings = PolicyLossSettings.of(dataclasses.replace(task.args, loss_type=loss_type))
            total, count, _ = policy_loss(logps, None, None, advantages, loss_mask, settings)
            assert float(total / count) == pytest.approx(float(theirs_loss), abs=1e-6), loss_type


@pytest.mark.parametrize(
    ("setting", "words"),
    [
        ({"tools": ["recipes.tools.calculater"]}, "task.tools: cannot import 'recipes.tools.calc"),
        ({"tools": ["json.dumps"]}, "task.tools: 'json.dumps' cannot be shown to the model"),
        ({"tools": ["recipes.tools.calculator"], "text_rows": "raw"}, "task.text_rows=raw"),
        ({"tool_timeout": 0}, "task.tool_timeout=0.0: must be > 0"),
        ({"max_tool_calling_iterations": 0}, "task.max_tool_calling_iterations=0: must be >= 1"),
    ],
)
def test_bad_tool_settings_are_refused(setting, words):
    from recipes.config import ConfigError

    with pytest.raises(ConfigError) as err:
        make_task("grpo", **setting)
    assert words in str(err.value)


def test_a_template_without_tool_calls_is_refused():
    from recipes.config import ConfigError
    from recipes.tasks import chat

    tokenizer, chat_template, *_ = _setup()
    tool_calling.check_template(
        tokenizer, chat_template.template, [calculator], chat_template.stop_tokens
    )
    zephyr = chat.CHAT_TEMPLATES["zephyr"]
    with pytest.raises(ConfigError, match="does not render tool calls and tool messages"):
        tool_calling.check_template(tokenizer, zephyr, [calculator])


def hang(seconds: int) -> str:
    """Sleep.

    Args:
        seconds: how long
    """
    time.sleep(seconds)
    return "awake"


def broken(x: int) -> str:
    """Raise.

    Args:
        x: anything
    """
    raise RuntimeError(f"broken on {x}")


def quits(x: int) -> str:
    """Exit the process.

    Args:
        x: anything
    """
    sys.exit(0)


def test_tool_errors_and_timeouts_become_tool_messages_in_a_rollout():
    """The tiny model goes on after a tool that hangs (past task.tool_timeout), one that raises,
    one that calls sys.exit(0) (which would end the run with exit 0), an unknown tool, bad arguments and a call that is not JSON; each later turn is drawn from
    its completion's own stream: the same alone as in a batch."""
    from accelerate import Accelerator

    from recipes.config import GenerationConfig
    from recipes.tasks.base import RunContext

    tokenizer, chat_template, rows, _, model = _setup()
    model.generation_config.eos_token_id = chat_template.stop_tokens
    task = make_task(
        "grpo",
        chat_template="qwen2_5",
        max_completion_length=192,
        num_generations=GROUP,
        rewards=REWARDS,
        tools=[f"test_grpo_tools.{fn.__name__}" for fn in (hang, broken, quits)]
        + ["recipes.tools.calculator"],
        max_tool_calling_iterations=1,
        tool_timeout=0.5,
    )
    run = RunContext(Accelerator(cpu=True), tokenizer, None, GenerationConfig())
    prompt = task._prompt_ids(
        tokenizer, chat_template.template, {**rows[0], "place": "row 0"}, "dev"
    )
    end = "<|im_end|>"
    first = [
        _call("hang", seconds=30),
        _call("broken", x=3),
        _call("lookup", key="x"),
        _call("calculator", expression="__import__('os')"),
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": </tool_call>',
        _call("quits", x=1),
    ]
    firsts = [tokenizer(t + end, add_special_tokens=False)["input_ids"] for t in first]
    sampling = GenerationConfig(do_sample=True, top_k=0, batch_size=len(first))

    def rollout(which: list[int]):
        streams = [torch.Generator().manual_seed(100 + i) for i in which]
        return task._tool_turns(
            model, run, [prompt] * len(which), [firsts[i] for i in which], sampling, streams
        )

    started = time.perf_counter()
    got = rollout(list(range(len(first))))
    assert time.perf_counter() - started < 20  # the hanging tool's 30 s were not waited for
    assert (got.calls, got.failures) == (6, 6)
    errors = [m[1]["content"] for m in got.messages]
    assert [m[1]["role"] for m in got.messages] == ["tool"] * 6
    assert "hang did not return within 0.5 s (task.tool_timeout)" in errors[0]
    assert "broken on 3" in errors[1]
    assert "Tool lookup not found." in errors[2]
    assert "not arithmetic" in errors[3]
    assert "could not be read" in errors[4]
    assert "quits exited (SystemExit: 0)" in errors[5]
    for ids, mask, messages in zip(got.completion_ids, got.tool_mask, got.messages, strict=True):
        assert messages[2]["role"] == "assistant"  # the model's next turn
        assert 0 in mask and mask[-1] == 1 and len(mask) == len(ids) <= 192
    alone = rollout([1])
    assert alone.completion_ids[0] == got.completion_ids[1]


@pytest.mark.slow
def test_smoke_run_trains_with_tool_calls(tmp_path):
    """recipe=llama_grpo_tools debug=smoke: the tiny tool caller (scripts/make_arithmetic.py)
    calls the calculator in training and evaluation, and the run trains on what follows."""
    run = tmp_path / "run"
    run_train("recipe=llama_grpo_tools", "debug=smoke", "logger=none", f"output_dir={run}")
    records = read_metrics(run)
    train = [r for r in records if "train/loss" in r]
    assert len(train) == 4 and all(r["train/tools/call_frequency"] > 0 for r in train), train
    assert any(r["train/tools/failure_frequency"] < 1 for r in train), train  # some calls work
    assert all(r["train/grad_norm"] > 0 for r in train), train
    assert all(r["train/reward_std"] > 0 for r in train), train
