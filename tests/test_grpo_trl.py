"""The GRPO task against TRL's ``GRPOTrainer`` on the same model, prompts, completions, reward
functions and weights: the rewards and advantages, then for each loss type (and with the KL
term) the loss, TRL's logged statistics and the gradient.

TRL gets our completions through its ``rollout_func`` (so neither side samples), then runs its
own ``_generate_and_score_completions`` (rewards, group normalisation) and ``_compute_loss``;
ours are :func:`recipes.losses.group_advantages` and :func:`recipes.losses.policy_loss`, called
on the rewards and log-probabilities the task computes.
Rows: the first bundled held-out SQuAD prompts, not written for this test. Completions per
prompt: its reference answer, the answer's first word, and two strings of random tokens; the
tiny Llama's weights are perturbed, so that log-probabilities differ between tokens."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from conftest import ROOT, make_task
from transformers import AutoModelForCausalLM

from recipes.config import ModelConfig
from recipes.losses import PolicyLossSettings, group_advantages, policy_loss
from recipes.losses.grpo import advantage_stat_names
from recipes.model import load_tokenizer
from recipes.tasks import chat, grpo

trl = pytest.importorskip("trl")

CONVERSATIONS = ROOT / "recipes/assets/conversations/squad/dev.jsonl"
TINY_LLAMA = ROOT / "recipes/assets/tiny-llama"
GROUP = 4
PROMPTS = 3
MAX_COMPLETION = 12
REWARDS = [{"name": "answer_f1", "weight": 1.0}, {"name": "span_overlap", "weight": 0.5}]


def _rows(start: int = 0):
    lines = CONVERSATIONS.read_text().splitlines()[start : start + PROMPTS]
    from datasets import Dataset

    return grpo.prompt_rows(Dataset.from_list([json.loads(line) for line in lines]), "dev")


def _setup(loss_type: str, beta: float, start: int = 0, **settings):
    tokenizer = load_tokenizer(ModelConfig(name_or_path=str(TINY_LLAMA)))
    template = chat.resolve_chat_template(tokenizer, "zephyr")
    tokenizer.chat_template = template
    task = make_task(
        "grpo",
        chat_template="zephyr",
        max_prompt_length=200,
        max_completion_length=MAX_COMPLETION,
        num_generations=GROUP,
        loss_type=loss_type,
        beta=beta,
        rewards=REWARDS,
        **settings,
    )
    model = AutoModelForCausalLM.from_pretrained(TINY_LLAMA, attn_implementation="eager")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for weight in model.parameters():
            weight.add_(torch.randn(weight.shape, generator=generator) * 0.05)
    rows = _rows(start)
    prompt_ids = [chat.render(tokenizer, template, r["prompt"], True) for r in rows]
    eos = tokenizer.eos_token_id
    completions = []
    for r in rows:
        answer = tokenizer(r["answer"], add_special_tokens=False)["input_ids"]
        first = tokenizer(r["answer"].split()[0], add_special_tokens=False)["input_ids"]
        completions += [[*answer[: MAX_COMPLETION - 1], eos], [*first, eos]]
        for k in range(GROUP - 2):
            sampled = torch.randint(1, 2000, (MAX_COMPLETION,), generator=generator).tolist()
            completions.append(sampled[: 6 + k])
    return task, tokenizer, model, rows, prompt_ids, completions


def _advantages(task, table) -> tuple[torch.Tensor, dict[str, float]]:
    """:func:`recipes.losses.group_advantages` of the rewards under the task's settings, and
    its statistics by name."""
    advantages, values = group_advantages(
        table, task.reward_weights, task.args.num_generations, task.args.scale_rewards
    )
    names = advantage_stat_names(task.reward_names)
    return advantages, dict(zip(names, values.tolist(), strict=True))


def _trl_trainer(tmp_path, task, tokenizer, model, rows, prompt_ids, completions, beta, **settings):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    def rollout(prompts, trainer):  # TRL passes each prompt GROUP times in a row
        assert len(prompts) == len(completions)
        return {
            "prompt_ids": [p for p in prompt_ids for _ in range(GROUP)],
            "completion_ids": completions,
            "logprobs": None,
        }

    config = GRPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=GROUP * PROMPTS,
        num_generations=GROUP,
        max_completion_length=MAX_COMPLETION,
        loss_type=task.args.loss_type,
        beta=beta,
        report_to="none",
        use_cpu=True,
        bf16=False,
        reward_weights=[r["weight"] for r in REWARDS],
        **settings,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=task.reward_fns,
        args=config,
        train_dataset=Dataset.from_list(
            [{"prompt": r["prompt"], "answer": r["answer"]} for r in rows]
        ),
        processing_class=tokenizer,
        rollout_func=rollout,
    )
    trainer.current_gradient_accumulation_steps = 1
    return trainer


# The newer losses and settings (TRL's names), each where the policy has moved since sampling:
# the old log-probabilities come from the weights before a step, so ratios differ from 1 and
# clipping bites. Other rows than the first cases'.
MOVED = [
    ("dapo", 0.0, {"delta": 1.25, "off_policy_mask_threshold": 0.05}),
    ("grpo", 0.04, {"importance_sampling_level": "sequence", "epsilon": 0.02}),  # GSPO
    (
        "luspo",
        0.04,
        {"importance_sampling_level": "sequence", "epsilon": 0.02, "use_bias_correction_kl": False},
    ),
    ("cispo", 0.0, {"epsilon_high": 1.05}),
    ("sapo", 0.0, {"sapo_temperature_pos": 0.9}),
    ("vespo", 0.0, {"vespo_k_neg": 2.5}),
]


@pytest.mark.parametrize(
    ("loss_type", "beta", "settings", "moved"),
    [
        *[(lt, b, {}, False) for lt, b in [("dapo", 0.0), ("grpo", 0.0), ("bnpo", 0.0)]],
        ("dr_grpo", 0.0, {}, False),
        ("dapo", 0.04, {}, False),
        *[(lt, b, settings, True) for lt, b, settings in MOVED],
    ],
)
def test_loss_advantages_and_gradient_equal_trl(tmp_path, loss_type, beta, settings, moved):
    task, tokenizer, model, rows, prompt_ids, completions = _setup(
        loss_type, beta, PROMPTS if moved else 0, **settings
    )
    # TRL builds its reference from the model's path: the unperturbed tiny Llama.
    reference = AutoModelForCausalLM.from_pretrained(TINY_LLAMA, attn_implementation="eager").eval()
    old_model = model
    if moved:  # a step since sampling: the policy is the old one plus a small change
        model = copy.deepcopy(model)
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for weight in model.parameters():
                weight.add_(torch.randn(weight.shape, generator=generator) * 0.01)
    trainer = _trl_trainer(
        tmp_path,
        task,
        tokenizer,
        copy.deepcopy(model),
        rows,
        prompt_ids,
        completions,
        beta,
        **settings,
    )
    trainer.model.train()
    inputs = [{"prompt": r["prompt"], "answer": r["answer"]} for r in rows for _ in range(GROUP)]
    theirs = trainer._generate_and_score_completions(inputs)

    # Rewards and advantages: ours from the same functions on the same completions.
    row_list = [r for r in rows for _ in range(GROUP)]
    table = task._rewards(tokenizer, row_list, completions)
    advantages, stats = _advantages(task, table)
    torch.testing.assert_close(advantages, theirs["advantages"].float(), rtol=1e-5, atol=1e-6)
    for name in ("reward", "reward_std", "frac_reward_zero_std", "rewards/answer_f1/mean"):
        assert stats[name] == pytest.approx(trainer._metrics["train"][name][-1], abs=1e-6)
    assert (advantages != 0).any()

    prompt, prompt_mask = grpo._pad([p for p in prompt_ids for _ in range(GROUP)], 0, left=True)
    completion, completion_mask = grpo._pad(completions, 0, left=False)
    torch.testing.assert_close(completion_mask, theirs["completion_mask"].long())
    old = None
    if moved:  # both sides step from the same old log-probabilities
        with torch.no_grad():
            old = task._logps(old_model.eval(), prompt, prompt_mask, completion, completion_mask)
        theirs["old_per_token_logps"] = old.clone()

    # The loss and gradient of one micro-batch holding every completion.
    trl_loss = trainer._compute_loss(trainer.model, theirs)
    trl_loss.backward()
    # The loss's maths on TRL's own inputs (its fused log-softmax differs from ours by ~1e-7
    # per token, which cispo and vespo multiply by the log-probabilities).
    with torch.no_grad():
        trl_logps = trainer._get_per_token_logps_and_entropies(
            trainer.model,
            torch.cat([theirs["prompt_ids"], theirs["completion_ids"]], dim=1),
            torch.cat([theirs["prompt_mask"], theirs["completion_mask"]], dim=1),
            theirs["completion_ids"].shape[1],
        )[0]
    settings = PolicyLossSettings.of(task.args)
    total, count, _ = policy_loss(
        trl_logps,
        old,
        theirs.get("ref_per_token_logps"),
        theirs["advantages"],
        theirs["completion_mask"],
        settings,
    )
    assert float(total / count) == pytest.approx(float(trl_loss.detach()), rel=0, abs=1e-6)

    ours_model = copy.deepcopy(model).train()
    ref = None
    if beta:
        with torch.no_grad():
            ref = task._logps(reference, prompt, prompt_mask, completion, completion_mask)
    logps = task._logps(ours_model, prompt, prompt_mask, completion, completion_mask)
    total, count, ours_stats = policy_loss(logps, old, ref, advantages, completion_mask, settings)
    loss = total / count
    loss.backward()
    assert float(loss.detach()) == pytest.approx(float(trl_loss.detach()), rel=1e-5, abs=1e-7)
    logged = [n for n in task.loss_shape().stats if n in ours_stats]
    assert set(logged) == set(ours_stats)  # every statistic computed is logged
    for name in logged:  # clip ratios, KL, VESPO's weights: TRL's numbers
        assert float(ours_stats[name]) == pytest.approx(
            trainer._metrics["train"][name][-1], rel=1e-4, abs=1e-6
        ), name
    if moved:
        ratio = torch.exp(logps.detach() - old)[completion_mask.bool()]
        assert (ratio - 1).abs().max() > 0.05
        bites = {n: float(v) for n, v in ours_stats.items() if "clip" in n}
        assert not bites or 0 < max(bites.values()) < 1, bites
    grads = {n: p.grad for n, p in ours_model.named_parameters() if p.grad is not None}
    theirs_grads = {n: p.grad for n, p in trainer.model.named_parameters() if p.grad is not None}
    assert grads.keys() == theirs_grads.keys() and grads
    worst = max(
        float(
            (grads[n] - theirs_grads[n]).abs().max() / theirs_grads[n].abs().max().clamp(min=1e-12)
        )
        for n in grads
    )
    assert worst < 1e-3, worst


def test_frac_reward_zero_std_follows_batch_scaling(tmp_path):
    """Under scale_rewards=batch, frac_reward_zero_std counts the completions whose batch std
    is zero (TRL's is_std_zero), not those in a group of equal rewards; rows 6-8, the first
    prompt's group four copies of its answer."""
    task, tokenizer, model, rows, prompt_ids, completions = _setup(
        "dapo", 0.0, 2 * PROMPTS, scale_rewards="batch"
    )
    completions[:GROUP] = [completions[0]] * GROUP
    trainer = _trl_trainer(
        tmp_path,
        task,
        tokenizer,
        model,
        rows,
        prompt_ids,
        completions,
        0.0,
        scale_rewards="batch",
    )
    trainer.model.train()
    inputs = [{"prompt": r["prompt"], "answer": r["answer"]} for r in rows for _ in range(GROUP)]
    theirs = trainer._generate_and_score_completions(inputs)
    table = task._rewards(tokenizer, [r for r in rows for _ in range(GROUP)], completions)
    advantages, stats = _advantages(task, table)
    torch.testing.assert_close(advantages, theirs["advantages"].float(), rtol=1e-5, atol=1e-6)
    totals = (table * task.reward_weights).nansum(dim=1).view(-1, GROUP)
    assert float(totals[0].std()) == 0 and float(totals.std()) > 0  # a group of equal rewards
    assert stats["frac_reward_zero_std"] == trainer._metrics["train"]["frac_reward_zero_std"][-1]
    assert stats["frac_reward_zero_std"] == 0.0
