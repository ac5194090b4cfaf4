"""Critic-free estimators and loss aggregation (ds_ppo.algo.group, ds_ppo.algo.aggregation, the
extra clips of policy_loss), each against a plain Python loop written from the papers."""
from __future__ import annotations

import math

import pytest
import torch

from ds_ppo.algo import (discounted_returns, entropy_bonus, group_advantages, group_score_stats, kl_estimate,
                         kl_loss, loss_divisor, loss_token_weights, policy_loss)
from conftest import mask_from_lengths


def _loop_group_advantages(scores: list[float], n: int, method: str, eps: float = 1e-6):
    out = []
    for g in range(0, len(scores), n):
        s = scores[g:g + n]
        mean = sum(s) / n
        std = math.sqrt(sum((x - mean) ** 2 for x in s) / (n - 1)) if n > 1 else 0.0
        for x in s:
            if all(y == s[0] for y in s):
                out.append(0.0)
            elif method == "grpo":
                out.append((x - mean) / (std + eps))
            elif method == "dr_grpo":
                out.append(x - mean)
            else:  # rloo: minus the mean of the other n - 1
                out.append(x - (sum(s) - x) / (n - 1))
    return out


@pytest.mark.parametrize("method", ["grpo", "dr_grpo", "rloo"])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_group_advantages_match_a_loop(method, n):
    g = torch.Generator().manual_seed(n)
    scores = torch.randn(5 * n, generator=g, dtype=torch.float64)
    scores[:n] = 0.7  # one constant group
    got = group_advantages(scores, n, method)
    want = torch.tensor(_loop_group_advantages(scores.tolist(), n, method), dtype=torch.float64)
    torch.testing.assert_close(got, want)
    assert torch.equal(got[:n], torch.zeros(n, dtype=torch.float64))  # exact zeros, no NaN


def test_group_advantages_hand_worked():
    s = torch.tensor([1.0, 2.0, 3.0, 5.0, 5.0, 5.0])
    # group (1, 2, 3): mean 2, Bessel std 1; group (5, 5, 5): no signal
    torch.testing.assert_close(group_advantages(s, 3, "grpo"),
                               torch.tensor([-1 / (1 + 1e-6), 0.0, 1 / (1 + 1e-6), 0, 0, 0]))
    torch.testing.assert_close(group_advantages(s, 3, "dr_grpo"),
                               torch.tensor([-1.0, 0.0, 1.0, 0, 0, 0]))
    # rloo: 1 - mean(2, 3) = -1.5; 2 - mean(1, 3) = 0; 3 - mean(1, 2) = 1.5
    torch.testing.assert_close(group_advantages(s, 3, "rloo"),
                               torch.tensor([-1.5, 0.0, 1.5, 0, 0, 0]))


def test_group_advantages_errors_and_edge_cases():
    s = torch.arange(6.0)
    with pytest.raises(ValueError, match="group_size = 4"):
        group_advantages(s, 4, "grpo")
    with pytest.raises(ValueError, match="rloo needs group_size >= 2"):
        group_advantages(s, 1, "rloo")
    with pytest.raises(ValueError, match="unknown group method"):
        group_advantages(s, 2, "gae")
    assert torch.equal(group_advantages(s, 1, "grpo"), torch.zeros(6))  # a group of one
    assert torch.isfinite(group_advantages(torch.full((4,), 1e30), 2, "grpo")).all()


def test_group_score_stats():
    std, constant = group_score_stats(torch.tensor([1.0, 3.0, 2.0, 2.0]), 2)
    torch.testing.assert_close(std, torch.tensor([math.sqrt(2.0), 0.0], dtype=torch.float64))
    assert constant.tolist() == [False, True]


def _loop_returns(rewards, lengths, gamma):
    out = torch.zeros_like(rewards)
    for b, n in enumerate(lengths):
        running = 0.0
        for t in reversed(range(n)):
            running = float(rewards[b, t]) + gamma * running
            out[b, t] = running
    return out


@pytest.mark.parametrize("gamma", [1.0, 0.9, 0.0])
def test_discounted_returns_match_a_loop_and_ignore_masked_values(gamma):
    lengths = [7, 3, 0, 5]
    mask = mask_from_lengths(torch.tensor(lengths), 7)
    rewards = torch.randn(4, 7, generator=torch.Generator().manual_seed(0))
    garbage = torch.where(mask, rewards, torch.full_like(rewards, float("nan")))
    got = discounted_returns(garbage, mask, gamma)
    torch.testing.assert_close(got, _loop_returns(rewards, lengths, gamma))
    assert torch.equal(got[~mask], torch.zeros(int((~mask).sum())))


def test_discounted_returns_carry_across_a_gap_in_the_mask():
    """A gap is a multi-turn episode's observation: no step, the sum runs on after it."""
    mask = torch.tensor([[True, True, False, True, True], [True, False, False, False, False]])
    rewards = torch.arange(1.0, 11.0).reshape(2, 5)
    want = torch.zeros(2, 5)
    for b in range(2):  # the recursion over the row's masked tokens only
        running = 0.0
        for t in reversed(range(5)):
            if mask[b, t]:
                running = float(rewards[b, t]) + 0.5 * running
                want[b, t] = running
    torch.testing.assert_close(discounted_returns(rewards, mask, 0.5), want)
    assert want[0, 1] == 2 + 0.5 * (4 + 0.5 * 5)  # across the gap at column 2


def _loop_policy_loss(logp, old, adv, lengths, eps, eps_high, dual):
    total, count = 0.0, 0
    for b, n in enumerate(lengths):
        for t in range(n):
            r = math.exp(float(logp[b, t] - old[b, t]))
            a = float(adv[b, t])
            loss = max(-a * r, -a * min(max(r, 1 - eps), 1 + eps_high))
            if dual is not None and a < 0:
                loss = min(loss, -a * dual)
            total, count = total + loss, count + 1
    return total / count


@pytest.mark.parametrize("eps_high,dual", [(None, None), (0.28, None), (None, 3.0), (0.28, 1.5)])
def test_policy_loss_clip_higher_and_dual_clip_match_a_loop(eps_high, dual):
    g = torch.Generator().manual_seed(1)
    lengths = [6, 2, 4]
    mask = mask_from_lengths(torch.tensor(lengths), 6)
    old = torch.randn(3, 6, generator=g)
    logp = old + 1.5 * torch.randn(3, 6, generator=g)  # ratios far outside the clip range
    adv = 2 * torch.randn(3, 6, generator=g)
    loss, _ = policy_loss(logp, old, adv, mask, clip_eps=0.2, clip_eps_high=eps_high,
                          dual_clip=dual)
    want = _loop_policy_loss(logp, old, adv, lengths, 0.2, eps_high or 0.2, dual)
    assert abs(float(loss) - want) < 1e-5
    if eps_high is None and dual is None:  # today's call is unchanged
        assert torch.equal(loss, policy_loss(logp, old, adv, mask, clip_eps=0.2)[0])
    else:  # and the option really changes the loss on these ratios
        assert abs(float(loss) - _loop_policy_loss(logp, old, adv, lengths, 0.2, 0.2, None)) > 1e-3


def test_policy_loss_rejects_bad_clips():
    x, m = torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        policy_loss(x, x, x, m, dual_clip=1.0)
    with pytest.raises(ValueError, match="clip_eps_high must be > 0"):
        policy_loss(x, x, x, m, clip_eps_high=0.0)


def _loop_aggregate(per_token, lengths, mode, max_new):
    if mode == "token_mean":
        return sum(float(per_token[b, t]) for b, n in enumerate(lengths) for t in range(n)) \
            / sum(lengths)
    per_seq = []
    for b, n in enumerate(lengths):
        s = sum(float(per_token[b, t]) for t in range(n))
        per_seq.append(s / max(n, 1) if mode == "seq_mean_token_mean" else s / max_new)
    return sum(per_seq) / len(per_seq)


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_loss_aggregation_matches_a_loop_and_any_split(mode):
    """The aggregated loss equals the loop's on the whole batch, and summing the losses of any
    split into micro-batches (each divided by the global divisor) gives the same loss and
    gradient: what makes the update independent of world size and micro-batch split."""
    g = torch.Generator().manual_seed(2)
    lengths = [8, 1, 5, 0, 3, 8]
    T = 8
    mask = mask_from_lengths(torch.tensor(lengths), T)
    old = torch.randn(6, T, generator=g)
    logp0 = old + 0.3 * torch.randn(6, T, generator=g)
    adv = torch.randn(6, T, generator=g)
    divisor = loss_divisor(lengths, mode)

    def loss_of(rows, logp):
        w = loss_token_weights(mask[rows], mode, T)
        return policy_loss(logp[rows], old[rows], adv[rows], mask[rows], num_tokens=divisor,
                           token_weights=w)[0]

    whole_logp = logp0.clone().requires_grad_(True)
    whole = loss_of(list(range(6)), whole_logp)
    whole.backward()
    r = torch.exp(logp0 - old)
    per_token = torch.maximum(-adv * r, -adv * r.clamp(0.8, 1.2))
    assert abs(float(whole.detach()) - _loop_aggregate(per_token, lengths, mode, T)) < 1e-6
    split_logp = logp0.clone().requires_grad_(True)
    split = sum(loss_of(rows, split_logp) for rows in ([0, 5], [3], [1, 2, 4]))
    split.backward()
    torch.testing.assert_close(split, whole)
    torch.testing.assert_close(split_logp.grad, whole_logp.grad)


def test_loss_token_weights_and_divisor():
    mask = mask_from_lengths(torch.tensor([4, 2, 0]), 4)
    torch.testing.assert_close(loss_token_weights(mask, "seq_mean_token_mean")[1],
                               torch.tensor([0.5, 0.5, 0, 0]))
    torch.testing.assert_close(loss_token_weights(mask, "seq_mean_token_sum_norm", 8)[0],
                               torch.full((4,), 0.125))
    assert loss_divisor([4, 2, 0], "token_mean") == 6
    assert loss_divisor([4, 2, 0], "seq_mean_token_mean") == 3
    with pytest.raises(ValueError):
        loss_token_weights(mask, "seq_mean_token_sum_norm")


def test_kl_loss_is_the_aggregated_estimator_with_its_gradient():
    g = torch.Generator().manual_seed(3)
    mask = mask_from_lengths(torch.tensor([3, 1]), 3)
    ref = torch.randn(2, 3, generator=g)
    logp = (ref + torch.randn(2, 3, generator=g)).requires_grad_(True)
    garbage_ref = torch.where(mask, ref, torch.full_like(ref, float("nan")))
    loss = kl_loss(logp, garbage_ref, mask, "k3", divisor=4.0)
    want = kl_estimate(logp.detach(), ref, "k3")[mask].sum() / 4.0
    torch.testing.assert_close(loss.detach(), want)
    loss.backward()
    assert torch.isfinite(logp.grad).all() and torch.equal(logp.grad[~mask], torch.zeros(2))


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_entropy_bonus_is_aggregated_like_the_policy_loss(mode):
    """ppo.entropy_coef's term: the loop's aggregate of the entropy over the whole batch; any
    split into micro-batches (each divided by the global divisor) sums to it, gradient too; the
    entries outside the mask change nothing (NaN there)."""
    g = torch.Generator().manual_seed(4)
    lengths = [5, 1, 0, 3]
    T = 5
    mask = mask_from_lengths(torch.tensor(lengths), T)
    ent0 = torch.rand(4, T, generator=g) * 3
    divisor = loss_divisor(lengths, mode)
    garbage = torch.where(mask, ent0, torch.full_like(ent0, float("nan")))

    def term(rows, ent):
        return entropy_bonus(ent[rows], mask[rows], divisor,
                             loss_token_weights(mask[rows], mode, T))

    whole_ent = garbage.clone().requires_grad_(True)
    whole = term([0, 1, 2, 3], whole_ent)
    assert abs(float(whole.detach()) - _loop_aggregate(ent0, lengths, mode, T)) < 1e-6
    whole.backward()
    assert torch.equal(whole_ent.grad[~mask], torch.zeros(int((~mask).sum())))
    split_ent = garbage.clone().requires_grad_(True)
    split = term([0, 3], split_ent) + term([1, 2], split_ent)
    split.backward()
    torch.testing.assert_close(split, whole)
    torch.testing.assert_close(split_ent.grad, whole_ent.grad)
    with pytest.raises(ValueError, match="divisor"):
        entropy_bonus(ent0, mask, 0.0)


def test_entropy_bonus_floor_weights_each_token_by_how_far_it_is_below_the_floor():
    """ppo.entropy_target_scope=token: each token's entropy counts with the constant weight
    clip(1 - H_t / floor, 0, 1), so a collapsed token gets the whole bonus's gradient and a token
    at or above the floor none, whatever the mean; masked entries (NaN) change nothing."""
    floor = 2.0
    ent = torch.tensor([[0.0, 0.5, 2.0, 3.0], [1.0, float("nan"), 0.2, 4.0]])
    mask = torch.tensor([[True, True, True, True], [True, False, True, True]])
    ent.requires_grad_(True)
    # the mean over the valid tokens is 1.53 nats: below the floor, and so is most of the
    # bonus's weight; the tokens above 2 nats get none
    bonus = entropy_bonus(ent, mask, divisor=7.0, floor=floor)
    # by hand: 0 x 1 + 0.5 x 0.75 + 2 x 0 + 3 x 0 + 1 x 0.5 + 0.2 x 0.9 + 4 x 0
    want = (0.5 * 0.75 + 1.0 * 0.5 + 0.2 * 0.9) / 7.0
    assert abs(float(bonus.detach()) - want) < 1e-6
    bonus.backward()
    torch.testing.assert_close(ent.grad, torch.tensor([[1.0, 0.75, 0.0, 0.0],
                                                      [0.5, 0.0, 0.9, 0.0]]) / 7.0)
    # without a floor every valid token counts the same
    assert abs(float(entropy_bonus(ent.detach(), mask, 7.0)) - 10.7 / 7.0) < 1e-6
    with pytest.raises(ValueError, match="floor"):
        entropy_bonus(ent.detach(), mask, 7.0, floor=0.0)
