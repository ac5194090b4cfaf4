"""On-policy distillation's per-token advantage (algo/distill.py, the `distill` estimator)
against the formulas written out here, in float64 on ragged masks: A_t = sum_{j >= t}
discount^(j - t) (log pi_teacher(y_j) - log pi_student(y_j)) over the row's counted tokens, plus
reward_coef x the group advantage of the response's reward."""
from __future__ import annotations

import math

import pytest
import torch

from ds_ppo.algo.distill import distill_advantages, distill_rewards
from ds_ppo.algo.estimators import AdvantageInputs, advantages_for


def _batch(lengths, T=6, seed=0, holes=()):
    g = torch.Generator().manual_seed(seed)
    B = len(lengths)
    mask = torch.arange(T).expand(B, T) < torch.tensor(lengths).unsqueeze(1)
    for b, t in holes:  # an episode's observation tokens: not the model's
        mask[b, t] = False
    student = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    teacher = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    # garbage outside the mask: it must never reach a result
    student = torch.where(mask, student, torch.full_like(student, 1e6))
    teacher = torch.where(mask, teacher, torch.full_like(teacher, -1e6))
    return teacher, student, mask


def _oracle(teacher, student, mask, discount):
    """The formula, one token at a time."""
    B, T = mask.shape
    out = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        counted = [t for t in range(T) if mask[b, t]]
        for i, t in enumerate(counted):
            out[b, t] = sum(discount ** (k - i) * (float(teacher[b, j]) - float(student[b, j]))
                            for k, j in enumerate(counted) if k >= i)
    return out


@pytest.mark.parametrize("discount", [0.0, 0.5, 1.0])
def test_advantage_is_the_discounted_teacher_minus_student_log_prob(discount):
    teacher, student, mask = _batch([6, 3, 1, 0, 4])
    got = distill_advantages(teacher, student, mask, discount)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, _oracle(teacher, student, mask, discount), rtol=0,
                               atol=1e-9)


def test_discount_zero_is_each_tokens_own_log_ratio():
    teacher, student, mask = _batch([5, 2, 6])
    got = distill_advantages(teacher, student, mask)  # default: no discount
    for b, t in mask.nonzero().tolist():
        assert float(got[b, t]) == pytest.approx(float(teacher[b, t] - student[b, t]), abs=0)
    assert (got[~mask] == 0).all()


def test_an_episodes_observations_are_not_distilled_and_take_no_step():
    """Multi-turn: holes in the mask (the environment's tokens) get 0 and the discount runs over
    the model's tokens only."""
    teacher, student, mask = _batch([6, 6], holes=[(0, 2), (0, 3), (1, 1)])
    for discount in (0.0, 0.9):
        got = distill_advantages(teacher, student, mask, discount)
        torch.testing.assert_close(got, _oracle(teacher, student, mask, discount), rtol=0,
                                   atol=1e-9)
        assert (got[~mask] == 0).all()


def test_the_mean_reward_is_minus_the_sampled_reverse_kl():
    teacher, student, mask = _batch([4, 6, 2])
    r = distill_rewards(teacher, student, mask)
    reverse_kl = sum(float(student[b, t] - teacher[b, t]) for b, t in mask.nonzero().tolist())
    assert float(r.sum()) == pytest.approx(-reverse_kl, rel=1e-12)


def test_masked_values_never_change_the_advantage():
    teacher, student, mask = _batch([3, 5, 0, 6])
    a = distill_advantages(teacher, student, mask, 0.7)
    noise = torch.randn(mask.shape, dtype=torch.float64) * 100
    b = distill_advantages(teacher + noise * ~mask, student - noise * ~mask, mask, 0.7)
    assert torch.equal(a, b)


@pytest.mark.parametrize("method", ["grpo", "dr_grpo", "rloo"])
def test_the_estimator_adds_reward_coef_times_the_group_advantage_of_the_reward(method):
    """advantage = distill advantage + reward_coef x the group estimator's advantage of the
    summed reward, on every counted token."""
    n, coef = 3, 0.25
    lengths = [6, 3, 1, 5, 2, 4]
    teacher, student, mask = _batch(lengths, seed=3)
    scores = [1.0, 0.0, 0.5, 2.0, -1.0, 2.0]
    rewards = torch.zeros(mask.shape, dtype=torch.float64)
    for b, L in enumerate(lengths):
        rewards[b, L - 1] = scores[b]  # the score at the last counted token
    adv, returns = advantages_for("distill", AdvantageInputs(
        rewards, mask, None, group_size=n, teacher_logprobs=teacher, logprobs=student,
        discount=0.0, reward_coef=coef, reward_estimator=method))
    assert returns is None
    expected = _oracle(teacher, student, mask, 0.0)
    for g in range(0, len(scores), n):
        s = scores[g:g + n]
        mean = sum(s) / n
        std = math.sqrt(sum((x - mean) ** 2 for x in s) / (n - 1))
        for i in range(n):
            if method == "grpo":
                a = (s[i] - mean) / (std + 1e-6)
            elif method == "dr_grpo":
                a = s[i] - mean
            else:
                a = s[i] - (sum(s) - s[i]) / (n - 1)
            expected[g + i] += coef * a * mask[g + i].double()
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-9)


def test_without_reward_coef_the_reward_is_not_read():
    teacher, student, mask = _batch([4, 2])
    rewards = torch.full(mask.shape, float("nan"), dtype=torch.float64)
    adv, _ = advantages_for("distill", AdvantageInputs(
        rewards, mask, None, teacher_logprobs=teacher, logprobs=student))
    torch.testing.assert_close(adv, _oracle(teacher, student, mask, 0.0), rtol=0, atol=1e-12)
