"""Rollout correction math (ds_ppo.algo.importance_sampling) against hand computations."""
from __future__ import annotations

import math

import pytest
import torch

from ds_ppo.algo import policy_loss, rollout_is_weights, rollout_mismatch

OLD = [[-1.0, -2.0, -0.5, -3.0], [-0.2, -4.0, -1.0, -1.0]]
ROLL = [[-1.5, -0.5, -0.5, -0.1], [-0.2, -5.0, -9.0, -1.0]]
MASK = [[True, True, True, False], [True, True, True, True]]


def _tensors():
    return torch.tensor(OLD), torch.tensor(ROLL), torch.tensor(MASK)


def _ratios():
    return [[math.exp(o - r) for o, r in zip(ro, rr)] for ro, rr in zip(OLD, ROLL)]


@pytest.mark.parametrize("mode", ["tis", "mis", "none"])
def test_weights_by_hand(mode):
    old, roll, mask = _tensors()
    cap = 2.0
    weights, kept, cut = rollout_is_weights(old, roll, mask, mode, cap)
    for b, row in enumerate(_ratios()):
        for t, r in enumerate(row):
            if not MASK[b][t]:
                assert weights[b, t] == 0 and not kept[b, t] and not cut[b, t]
                continue
            if mode == "tis":
                want, want_kept, want_cut = min(r, cap), True, r > cap
            elif mode == "mis":
                inside = 1 / cap <= r <= cap
                want, want_kept, want_cut = (r if inside else 0.0), inside, not inside
            else:
                want, want_kept, want_cut = 1.0, True, False
            assert weights[b, t].item() == pytest.approx(want, rel=1e-6), (b, t)
            assert bool(kept[b, t]) == want_kept and bool(cut[b, t]) == want_cut
    if mode != "none":  # the example has tokens on both sides of the band and inside it
        assert cut.any() and (kept & ~cut).any()
    assert not weights.requires_grad


def test_mismatch_by_hand():
    old, roll, mask = _tensors()
    diff, kl = rollout_mismatch(old, roll, mask)
    for b in range(2):
        for t in range(4):
            if not MASK[b][t]:
                assert diff[b, t] == 0 and kl[b, t] == 0
                continue
            d = OLD[b][t] - ROLL[b][t]  # log pi_old - log pi_rollout
            assert diff[b, t].item() == pytest.approx(abs(d), rel=1e-6)
            # k3 of KL(rollout || old): r = pi_old / pi_rollout, (r - 1) - log r
            assert kl[b, t].item() == pytest.approx(math.exp(d) - 1 - d, rel=1e-5, abs=1e-7)


def test_weights_scale_each_tokens_policy_loss():
    """TIS weights multiply each token's policy loss (token_weights), so the gradient of a
    token is its unweighted gradient times its weight."""
    old, roll, mask = _tensors()
    weights, _, _ = rollout_is_weights(old, roll, mask, "tis", 2.0)
    adv = torch.tensor([[1.0, -0.5, 2.0, 1.0], [0.3, 1.0, -1.0, 0.7]])
    grads = []
    for w in (None, weights):
        logp = old.clone().requires_grad_(True)
        loss, _ = policy_loss(logp, old, adv, mask, num_tokens=7.0, token_weights=w)
        loss.backward()
        grads.append(logp.grad)
    torch.testing.assert_close(grads[1], grads[0] * weights)


def test_bad_arguments():
    old, roll, mask = _tensors()
    with pytest.raises(ValueError, match="cap"):
        rollout_is_weights(old, roll, mask, "tis", 1.0)
    with pytest.raises(ValueError, match="unknown"):
        rollout_is_weights(old, roll, mask, "clip", 2.0)
