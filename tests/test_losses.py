"""The pure loss functions of :mod:`recipes.losses` on hand-made tensors whose answers are known
(the comparisons with TRL on real models' log-probabilities are in test_dpo_trl.py,
test_dpo_reference_free.py, test_kto.py, test_grpo_trl.py, test_gkd.py and
test_reward_model.py)."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import ROOT, make_task

from recipes import losses
from recipes.losses import grpo as grpo_losses
from recipes.losses import preference


def _sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def _logsigmoid(x: float) -> float:
    return math.log(_sigmoid(x))


# ------------------------------------------------------------------------------- package


def test_the_package_imports_torch_and_itself_only():
    """No model, tokenizer, accelerator or task: the losses import torch and the standard
    library only (and each other)."""
    allowed = {"torch", "math", "dataclasses", "typing", "collections", "__future__", "recipes"}
    for path in sorted((ROOT / "recipes" / "losses").glob("*.py")):
        for node in ast.walk(ast.parse(Path(path).read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            for name in names:
                assert name.split(".")[0] in allowed, (path.name, name)
                assert not name.startswith("recipes.") or name.startswith("recipes.losses")


# ---------------------------------------------------------------------------- preference


def test_dpo_sigmoid_is_minus_logsigmoid_of_beta_times_the_log_ratio_margin():
    policy = torch.tensor([[-1.0, -3.0], [-4.0, -2.0]], requires_grad=True)
    reference = torch.tensor([[-2.0, -2.0], [-3.0, -3.0]])
    tokens = torch.tensor([[2.0, 4.0], [1.0, 1.0]])
    out = losses.dpo_loss(policy, reference, tokens, beta=0.1)
    # Margins of the log-ratios: (1 - (-1)) = 2 and (-1 - 1) = -2.
    expected = [-_logsigmoid(0.1 * 2), -_logsigmoid(0.1 * -2)]
    assert out.losses.tolist() == pytest.approx(expected, rel=1e-6)
    names = preference.stat_names("sigmoid")
    first = dict(zip(names, out.stats[0].tolist(), strict=True))
    assert first == pytest.approx(
        {
            "rewards/chosen": 0.1,
            "rewards/rejected": -0.1,
            "rewards/accuracies": 1.0,
            "rewards/margins": 0.2,
            "logps/chosen": -1.0,
            "logps/rejected": -3.0,
        }
    )
    assert out.stats[1, 2] == 0  # the second pair prefers its rejected side
    out.losses.sum().backward()
    # d/dx -logsigmoid(beta x) = -beta sigmoid(-beta x), and x rises with the chosen log-prob.
    assert policy.grad[0, 0] == pytest.approx(-0.1 * _sigmoid(-0.2), rel=1e-6)
    assert policy.grad[0, 1] == pytest.approx(0.1 * _sigmoid(-0.2), rel=1e-6)


def test_ipo_reads_log_ratios_per_token():
    policy = torch.tensor([[0.0, -8.0]])
    reference = torch.tensor([[-2.0, -4.0]])
    tokens = torch.tensor([[2.0, 4.0]])  # per-token log-ratios 1 and -1
    out = losses.dpo_loss(policy, reference, tokens, beta=0.5, loss_type="ipo")
    assert float(out.losses[0]) == pytest.approx((1 - (-1) - 1 / (2 * 0.5)) ** 2)


def test_robust_dpo_without_flips_is_dpo_and_with_them_the_unbiased_mix():
    policy, reference = torch.tensor([[-1.0, -3.0]]), torch.tensor([[-2.0, -2.0]])
    tokens = torch.ones(1, 2)
    dpo = losses.dpo_loss(policy, reference, tokens, beta=0.5).losses
    robust = losses.dpo_loss(policy, reference, tokens, beta=0.5, loss_type="robust").losses
    torch.testing.assert_close(robust, dpo)
    flip, z = 0.2, 0.5 * 2
    smoothed = losses.dpo_loss(
        policy, reference, tokens, beta=0.5, loss_type="robust", label_smoothing=flip
    )
    expected = (-(1 - flip) * _logsigmoid(z) + flip * _logsigmoid(-z)) / (1 - 2 * flip)
    assert float(smoothed.losses[0]) == pytest.approx(expected, rel=1e-6)


def test_orpo_is_the_nll_less_beta_times_logsigmoid_of_the_log_odds_ratio():
    policy = torch.tensor([[-2.0, -6.0]])  # averages -1 and -2 over 2 and 3 tokens
    tokens = torch.tensor([[2.0, 3.0]])
    nll = torch.tensor([0.7])
    out = losses.orpo_loss(policy, tokens, nll, beta=0.25)

    def odds(a: float) -> float:
        return a - math.log(1 - math.exp(a))

    log_odds = odds(-1.0) - odds(-2.0)
    assert float(out.losses[0]) == pytest.approx(0.7 - 0.25 * _logsigmoid(log_odds), rel=1e-6)
    named = dict(zip(preference.stat_names("orpo"), out.stats[0].tolist(), strict=True))
    assert named["nll_loss"] == pytest.approx(0.7)
    assert named["log_odds_chosen"] == pytest.approx(log_odds, rel=1e-6)
    assert named["log_odds_ratio"] == pytest.approx(_logsigmoid(log_odds), rel=1e-6)
    assert named["rewards/chosen"] == pytest.approx(-0.25)  # beta times the average


def test_log1mexp_is_accurate_near_zero_and_far_below():
    x = torch.tensor([-1e-7, -1e-3, -0.5, -math.log(2), -5.0, -40.0])
    # In double precision, each where it keeps its digits: log(1 - e^x) ~ log(-x) near 0,
    # ~ -e^x far below (where 1 - e^x rounds to 1).
    expected = [
        math.log(-math.expm1(v)) if v > -1 else math.log1p(-math.exp(v)) for v in x.tolist()
    ]
    assert preference.log1mexp(x).tolist() == pytest.approx(expected, rel=1e-6)
    assert float(preference.log1mexp(x)[-1]) == pytest.approx(-math.exp(-40), rel=1e-6)


def test_simpo_is_a_margin_on_average_log_probs_and_its_nll_term_is_optional():
    policy = torch.tensor([[-2.0, -6.0]])  # averages -1 and -2
    tokens = torch.tensor([[2.0, 3.0]])
    z = 2.0 * (-1.0 - -2.0) - 0.5
    plain = losses.simpo_loss(policy, tokens, beta=2.0, gamma=0.5)
    assert float(plain.losses[0]) == pytest.approx(-_logsigmoid(z), rel=1e-6)
    assert plain.stats.shape == (1, len(preference.stat_names("simpo")))
    smoothed = losses.simpo_loss(policy, tokens, beta=2.0, gamma=0.5, label_smoothing=0.1)
    expected = -0.9 * _logsigmoid(z) - 0.1 * _logsigmoid(-z)
    assert float(smoothed.losses[0]) == pytest.approx(expected, rel=1e-6)
    nll = torch.tensor([1.5])
    cpo = losses.simpo_loss(policy, tokens, nll, beta=2.0, gamma=0.5, nll_weight=0.4)
    assert float(cpo.losses[0]) == pytest.approx(-_logsigmoid(z) + 0.4 * 1.5, rel=1e-6)
    assert preference.stat_names("simpo", with_nll=True)[-1] == "nll_loss"
    assert float(cpo.stats[0, -1]) == 1.5


def test_preference_loss_dispatches_and_refuses_what_a_loss_lacks():
    policy, reference, tokens = torch.tensor([[-1.0, -3.0]]), torch.zeros(1, 2), torch.ones(1, 2)
    settings = {"beta": 0.1, "label_smoothing": 0.1, "simpo_gamma": 0.5, "nll_weight": 0.0}
    for loss_type in ("sigmoid", "ipo", "robust"):
        got = losses.preference_loss(
            policy, reference, tokens, None, loss_type=loss_type, **settings
        )
        want = losses.dpo_loss(
            policy, reference, tokens, loss_type=loss_type, beta=0.1, label_smoothing=0.1
        )
        torch.testing.assert_close(got.losses, want.losses, rtol=0, atol=0)
    with pytest.raises(ValueError, match="reference"):
        losses.preference_loss(policy, None, tokens, None, loss_type="sigmoid", **settings)
    with pytest.raises(ValueError, match="NLL"):
        losses.preference_loss(policy, None, tokens, None, loss_type="orpo", **settings)
    with pytest.raises(ValueError, match="loss_type='hinge'"):
        losses.dpo_loss(policy, reference, tokens, beta=0.1, loss_type="hinge")


# ----------------------------------------------------------------------------------- kto


def test_kto_losses_weights_and_statistics():
    policy = torch.tensor([-1.0, -2.0, -3.0])
    reference = torch.tensor([-2.0, -1.0, -3.5])  # log-ratios 1, -1, 0.5
    desirable = torch.tensor([True, False, False])
    kl = torch.tensor(0.2)
    out = losses.kto_loss(
        policy, reference, desirable, kl, beta=0.5, desirable_weight=2.0, undesirable_weight=0.5
    )
    expected = [
        2.0 * (1 - _sigmoid(0.5 * (1 - 0.2))),
        0.5 * (1 - _sigmoid(0.5 * (0.2 - -1))),
        0.5 * (1 - _sigmoid(0.5 * (0.2 - 0.5))),
    ]
    assert out.losses.tolist() == pytest.approx(expected, rel=1e-6)
    named = dict(zip(losses.kto.STATS, out.stats.sum(0).tolist(), strict=True))
    assert named == pytest.approx(
        {
            "kl": 0.6,  # each row carries its batch's estimate
            "rewards/chosen_sum": 0.5,
            "rewards/rejected_sum": -0.5 + 0.25,
            "logps/chosen_sum": -1.0,
            "logps/rejected_sum": -5.0,
            "count/chosen": 1.0,
            "count/rejected": 2.0,
        }
    )
    apo = losses.kto_loss(
        policy, reference, desirable, torch.zeros(()), beta=0.5, loss_type="apo_zero_unpaired"
    )
    expected = [1 - _sigmoid(0.5), _sigmoid(-0.5), _sigmoid(0.25)]
    assert apo.losses.tolist() == pytest.approx(expected, rel=1e-6)


def test_kl_estimate_is_the_mean_log_ratio_over_processes_clamped_at_zero():
    policy, reference = torch.tensor([-1.0, -2.0]), torch.tensor([-2.0, -2.0])
    assert float(losses.kl_estimate(policy, reference)) == pytest.approx(0.5)
    assert float(losses.kl_estimate(reference, policy)) == 0  # -0.5 clamped

    def with_other_process(kl: torch.Tensor) -> torch.Tensor:
        return torch.stack([kl, torch.tensor(-3.0)]).mean()

    assert float(losses.kl_estimate(policy, reference, with_other_process)) == 0
    policy = policy.requires_grad_()
    assert not losses.kl_estimate(policy, reference).requires_grad  # detached, as TRL's


# ---------------------------------------------------------------------------------- grpo


# TRL 1.16's GRPOConfig defaults (recipes.tasks.configs.grpo's too).
DEFAULTS = {
    "loss_type": "dapo",
    "importance_sampling_level": "token",
    "epsilon": 0.2,
    "epsilon_high": None,
    "delta": None,
    "off_policy_mask_threshold": None,
    "beta": 0.0,
    "use_bias_correction_kl": True,
    "max_completion_length": 512,
    "sapo_temperature_neg": 1.05,
    "sapo_temperature_pos": 1.0,
    "vespo_k_pos": 2.0,
    "vespo_lambda_pos": 3.0,
    "vespo_k_neg": 3.0,
    "vespo_lambda_neg": 2.0,
}


def _settings(**kwargs) -> grpo_losses.PolicyLossSettings:
    return grpo_losses.PolicyLossSettings(**(DEFAULTS | kwargs))


def test_group_advantages_normalise_within_each_group():
    rewards = torch.tensor([[1.0], [2.0], [3.0], [4.0], [5.0], [5.0], [float("nan")], [5.0]])
    out = losses.group_advantages(rewards, torch.ones(1), group=4)
    std = math.sqrt(5 / 3)  # Bessel's correction, as TRL's
    first = [(x - 2.5) / (std + 1e-4) for x in (1, 2, 3, 4)]
    assert out.advantages[:4].tolist() == pytest.approx(first, rel=1e-5)
    # A group of equal rewards: advantage 0; the unscored completion: 0, and out of the mean.
    assert out.advantages[4:].tolist() == [0.0, 0.0, 0.0, 0.0]
    names = grpo_losses.advantage_stat_names(["f"])
    stats = dict(zip(names, out.stats.tolist(), strict=True))
    assert stats["reward"] == pytest.approx(25 / 7)
    assert stats["frac_reward_zero_std"] == 0.5  # the second group's std is 0
    unscaled = losses.group_advantages(rewards, torch.ones(1), group=4, scale="none")
    assert unscaled.advantages[:4].tolist() == pytest.approx([-1.5, -0.5, 0.5, 1.5])
    weighted = losses.group_advantages(rewards.repeat(1, 2), torch.tensor([1.0, -0.5]), 4)
    assert weighted.advantages[:4].tolist() == pytest.approx(first, rel=2e-4)


def test_policy_loss_at_ratio_one_is_minus_the_advantage_per_token():
    logps = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    advantages = torch.tensor([2.0, -1.0])
    out = losses.policy_loss(logps, None, None, advantages, mask, _settings())
    assert float(out.count) == 5  # dapo: the micro-batch's completion tokens
    assert float(out.total.detach()) == pytest.approx(-(2 * 2) + 3)
    out.total.backward()
    expected = -advantages[:, None] * mask  # the ratio's gradient at 1 is the log-prob's
    torch.testing.assert_close(logps.grad, expected.float())
    for name in grpo_losses.CLIP_STATS:
        assert float(out.stats[name]) == 0


@pytest.mark.parametrize(
    "loss_type, total, count",
    [
        ("dapo", -1.0, 5.0),  # every token of the micro-batch: -2 * 2 + 1 * 3
        ("grpo", -2.0 + 1.0, 2.0),  # each completion's token mean
        # The gate at ratio 1: sigmoid(0) * 4 / t = 2 / t, t by the advantage's sign.
        ("sapo", -2 / 2.0 * 2 + 2 / 1.05, 2.0),
        ("bnpo", -1.0 / 5, 1.0),  # the micro-batch's token mean
        ("dr_grpo", -1.0 / 4, 2.0),  # the token sum over max_completion_length
        ("luspo", -1.0, 2.0),  # each completion's token sum, per completion
    ],
)
def test_policy_loss_normalisations(loss_type, total, count):
    logps = torch.zeros(2, 3)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    level = "sequence" if loss_type == "luspo" else "token"
    settings = _settings(
        loss_type=loss_type,
        importance_sampling_level=level,
        max_completion_length=4,
        sapo_temperature_pos=2.0,
    )
    out = losses.policy_loss(logps, None, None, torch.tensor([2.0, -1.0]), mask, settings)
    assert float(out.total) == pytest.approx(total, rel=1e-6)
    assert float(out.count) == count


def test_clipping_stops_the_gradient_where_the_ratio_left_the_trust_region():
    logps = torch.zeros(4, 1, requires_grad=True)
    old = torch.log(torch.tensor([[1 / 1.5], [1 / 0.5], [1 / 1.5], [1 / 0.5]]))  # ratios
    advantages = torch.tensor([1.0, -1.0, -1.0, 1.0])
    mask = torch.ones(4, 1)
    settings = _settings(loss_type="grpo")
    out = losses.policy_loss(logps, old, None, advantages, mask, settings)
    out.total.backward()
    # 1.5 with a positive advantage: clipped at 1.2; 0.5 with a negative one: clipped at 0.8;
    # the other two are pessimistic unclipped terms and keep their gradient -adv * ratio.
    assert logps.grad[:, 0].tolist() == pytest.approx([0.0, 0.0, 1.5, -0.5])
    # Per-token ratios (one token each): the shares of tokens clipped below / above.
    assert float(out.stats["clip_ratio/low_mean"]) == pytest.approx(0.25)
    assert float(out.stats["clip_ratio/high_mean"]) == pytest.approx(0.25)
    assert float(out.stats["clip_ratio/region_mean"]) == pytest.approx(0.5)
    # delta caps the unclipped ratio of the third (1.5, negative advantage) at 1.3.
    logps.grad = None
    capped = losses.policy_loss(
        logps, old, None, advantages, mask, _settings(loss_type="grpo", delta=1.3)
    )
    expected = float(out.total.detach()) - 1.5 + 1.3
    assert float(capped.total.detach()) == pytest.approx(expected, rel=1e-6)


def test_gspo_takes_one_ratio_per_completion_from_its_mean_log_ratio():
    logps = torch.zeros(1, 3)
    old = torch.tensor([[-0.3, 0.0, 0.9]])  # log-ratios 0.3, 0, (masked)
    mask = torch.tensor([[1, 1, 0]])
    settings = _settings(loss_type="grpo", importance_sampling_level="sequence", epsilon=0.5)
    out = losses.policy_loss(logps, old, None, torch.tensor([1.0]), mask, settings)
    assert float(out.total) == pytest.approx(-math.exp(0.15), rel=1e-6)


def test_cispo_caps_the_detached_ratio_and_weighs_the_log_prob():
    logps = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    old = logps.detach() - torch.tensor([[0.0, math.log(3.0)]])  # ratios 1 and 3
    settings = _settings(loss_type="cispo", epsilon_high=2.0)
    out = losses.policy_loss(logps, old, None, torch.tensor([1.0]), torch.ones(1, 2), settings)
    assert float(out.total.detach()) == pytest.approx(-(1 * -1.0 + 2.0 * -2.0), rel=1e-6)
    assert float(out.stats["cispo_clip_ratio"]) == 0.5
    out.total.backward()
    assert logps.grad[0].tolist() == pytest.approx([-1.0, -2.0], rel=1e-6)


def test_the_kl_term_is_the_k3_estimate_times_beta():
    logps = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -2.0]])
    settings = _settings(beta=0.1)
    out = losses.policy_loss(logps, None, ref, torch.zeros(1), torch.ones(1, 2), settings)
    k3 = math.exp(-0.5) + 0.5 - 1
    assert float(out.stats["kl"]) == pytest.approx(k3 / 2, rel=1e-6)
    assert float(out.total) == pytest.approx(0.1 * k3, rel=1e-6)
    with pytest.raises(ValueError, match="reference"):
        losses.policy_loss(logps, None, None, torch.zeros(1), torch.ones(1, 2), settings)


def test_the_off_policy_mask_drops_negative_completions_far_from_the_old_policy():
    logps = torch.zeros(3, 2)
    old = torch.tensor([[0.5, 0.5], [0.5, 0.5], [0.01, 0.01]])
    advantages = torch.tensor([1.0, -1.0, -1.0])
    mask = grpo_losses.off_policy_mask(advantages[:, None], logps, old, torch.ones(3, 2), 0.1)
    assert mask[:, 0].tolist() == [1.0, 0.0, 1.0]


def test_vespo_weights_a_completion_by_the_gamma_density_of_its_ratio():
    log_ratio = torch.zeros(2, 2)  # w = 1: phi = e^lambda * 1 * e^-lambda = 1
    settings = _settings(loss_type="vespo")
    phi = grpo_losses.gamma_weights(
        log_ratio, torch.tensor([[1.0], [-1.0]]), torch.ones(2, 2), settings
    )
    assert phi[:, 0].tolist() == pytest.approx([1.0, 1.0])
    w = math.exp(0.4)  # summed log-ratios 0.4: phi = e^lam w^k e^(-lam w), k=2, lam=3
    phi = grpo_losses.gamma_weights(
        torch.tensor([[0.1, 0.3]]), torch.tensor([[1.0]]), torch.ones(1, 2), settings
    )
    assert float(phi) == pytest.approx(math.exp(3) * w**2 * math.exp(-3 * w), rel=1e-5)


def test_settings_are_read_from_a_config_and_checked():
    config = make_task("grpo", epsilon=0.3).args
    settings = grpo_losses.PolicyLossSettings.of(config)
    assert settings == _settings(epsilon=0.3)  # the project's defaults are TRL's
    assert settings.high == settings.epsilon == 0.3  # epsilon_high unset: epsilon
    with pytest.raises(ValueError, match="loss_type='ppo'"):
        _settings(loss_type="ppo")


# ----------------------------------------------------------------------------------- gkd


def _kl(p_log: torch.Tensor, q_log: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per row, from log-probs."""
    return (p_log.exp() * (p_log - q_log)).sum(-1)


def test_jsd_at_beta_0_and_1_is_forward_and_reverse_kl_and_between_the_mixtures():
    generator = torch.Generator().manual_seed(0)
    student = torch.randn(4, 7, generator=generator, dtype=torch.float64)
    teacher = torch.randn(4, 7, generator=generator, dtype=torch.float64)
    s_log, t_log = F.log_softmax(student, -1), F.log_softmax(teacher, -1)
    forward = losses.generalized_jsd(student, teacher, 0.0).double()
    reverse = losses.generalized_jsd(student, teacher, 1.0).double()
    torch.testing.assert_close(forward, _kl(t_log, s_log), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(reverse, _kl(s_log, t_log), rtol=1e-5, atol=1e-6)
    beta = 0.3
    mixture = torch.log((1 - beta) * s_log.exp() + beta * t_log.exp())
    expected = beta * _kl(t_log, mixture) + (1 - beta) * _kl(s_log, mixture)
    between = losses.generalized_jsd(student, teacher, beta).double()
    torch.testing.assert_close(between, expected, rtol=1e-5, atol=1e-6)
    assert losses.generalized_jsd(student, student, 0.5).abs().max() < 1e-6
    precomputed = losses.generalized_jsd(student, t_log, 0.0, teacher_is_logps=True).double()
    torch.testing.assert_close(precomputed, forward, rtol=1e-5, atol=1e-6)


def test_distillation_loss_sums_labelled_positions_only():
    student = torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(1))
    mask = torch.tensor([[True, False, True], [False, False, False]])
    total, count = losses.distillation_loss(student, student.flip(-1), mask, 0.5)
    per_position = losses.generalized_jsd(student, student.flip(-1), 0.5)
    assert float(total[0]) == pytest.approx(float(per_position[0, 0] + per_position[0, 2]))
    assert float(total[1]) == 0 and count.tolist() == [2, 0]


# -------------------------------------------------------------------------------- reward


def test_bradley_terry_with_margin_and_centring():
    rewards = torch.tensor([[2.0, 0.5], [-1.0, 1.0]])
    margin = torch.tensor([0.5, 0.0])
    plain = losses.bradley_terry_loss(rewards, margin)
    assert plain.losses.tolist() == pytest.approx([-_logsigmoid(1.0), -_logsigmoid(-2.0)])
    centred = losses.bradley_terry_loss(rewards, margin, center_rewards_coefficient=0.1)
    expected = [-_logsigmoid(1.0) + 0.1 * 2.5**2, -_logsigmoid(-2.0) + 0.1 * 0.0**2]
    assert centred.losses.tolist() == pytest.approx(expected)
    named = dict(zip(losses.reward.STATS, plain.stats.T.tolist(), strict=True))
    assert named == {"accuracy": [1.0, 0.0], "margin": [1.5, -2.0], "mean_reward": [1.25, 0.0]}
