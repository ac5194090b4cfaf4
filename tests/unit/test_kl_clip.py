"""The cap on the per-token KL value, ppo.kl_clip, worked by hand.

The log-ratio clamp (+-20 nats) alone lets one tail token's k3 reach e^20 - 21 = 4.85e8 nats:
at kl_coef 0.05 a reward of -2.4e7 on one token. With the cap (default 10, as OpenRLHF caps every
estimator and verl caps k3) that token's KL is 10 and its reward -0.5.
"""
from __future__ import annotations

import math

import pytest
import torch

from ds_ppo.algo import KL_CLIP, kl_clamped, kl_estimate, kl_loss
from ds_ppo.config import load_config
from ds_ppo.containers import Experience, Rollout
from ds_ppo.ppo.advantages import add_advantages, advantage_settings

# log-ratios log pi - log pi_ref of one token each: the tails, the clamp, the body
X = [-30.0, -12.0, -3.0, 0.5, 3.0, 12.0, 30.0]
E20 = math.exp(20)
# the estimators by hand (Schulman 2020), log-ratio clamped to +-20 for k2 and k3, uncapped
RAW = {
    "k1": X,
    "k2": [200.0, 72.0, 4.5, 0.125, 4.5, 72.0, 200.0],
    # k3 = e^-x - 1 + x with x clamped: e^20 - 21, e^12 - 13, e^3 - 4, e^-0.5 - 0.5, ...
    "k3": [E20 - 21, math.exp(12) - 13, math.exp(3) - 4, math.exp(-0.5) - 0.5,
           math.exp(-3) + 2, math.exp(-12) + 11, math.exp(-20) + 19],
}
CAPPED = {
    "k1": [-10.0, -10.0, -3.0, 0.5, 3.0, 10.0, 10.0],
    "k2": [10.0, 10.0, 4.5, 0.125, 4.5, 10.0, 10.0],
    "k3": [10.0, 10.0, 10.0, math.exp(-0.5) - 0.5, math.exp(-3) + 2, 10.0, 10.0],
}
# tokens whose value is not the estimator's own: beyond +-10 (or the +-20 log-ratio clamp)
CLAMPED = {
    "k1": [True, True, False, False, False, True, True],
    "k2": [True, True, False, False, False, True, True],
    "k3": [True, True, True, False, False, True, True],
}


def _pair(dtype=torch.float32):
    ref = torch.full((1, len(X)), -2.0, dtype=dtype)
    return ref + torch.tensor([X], dtype=dtype), ref


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_estimate_is_capped_at_plus_minus_clip(estimator):
    logp, ref = _pair(torch.float64)
    torch.testing.assert_close(kl_estimate(logp, ref, estimator)[0].tolist(), RAW[estimator],
                               rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(kl_estimate(logp, ref, estimator, clip=10.0)[0].tolist(),
                               CAPPED[estimator], rtol=1e-9, atol=1e-9)
    assert kl_clamped(logp, ref, estimator, 10.0)[0].tolist() == CLAMPED[estimator]
    # without a cap only the log-ratio clamp (k2, k3 beyond +-20) counts
    assert kl_clamped(logp, ref, estimator)[0].tolist() == [True] + [False] * 5 + [True]
    assert KL_CLIP == 10.0


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_loss_is_capped_and_capped_tokens_carry_no_gradient(estimator):
    logp, ref = _pair()
    logp.requires_grad_(True)
    mask = torch.ones_like(ref, dtype=torch.bool)
    loss = kl_loss(logp, ref, mask, estimator, divisor=7.0, clip=10.0)
    assert loss.item() == pytest.approx(sum(CAPPED[estimator]) / 7.0, rel=1e-6)
    loss.backward()
    grad = logp.grad[0]
    assert torch.isfinite(grad).all()
    for g, clamped in zip(grad.tolist(), CLAMPED[estimator]):
        assert (g == 0.0) == clamped  # d/dx of a clamp: 0 outside; the body keeps its gradient
    uncapped = kl_loss(logp.detach(), ref, mask, estimator, divisor=7.0)
    assert uncapped.item() == pytest.approx(sum(RAW[estimator]) / 7.0, rel=1e-5)


def _experience(x: float) -> Experience:
    """One response of 3 tokens; the middle token's log-ratio is x, the others' 0."""
    T = 3
    ids = torch.ones(1, T, dtype=torch.long)
    mask = torch.ones(1, T, dtype=torch.bool)
    rollout = Rollout(prompt_ids=ids[:, :2], prompt_mask=torch.ones(1, 2, dtype=torch.bool),
                      response_ids=ids, mask=mask, ended=torch.ones(1, dtype=torch.bool),
                      prompts=["p"], responses=["r"], prompt_lens=[2], response_lens=[T],
                      extras=[{}])
    ref = torch.full((1, T), -2.0)
    logp = ref + torch.tensor([[0.0, x, 0.0]])
    return Experience(rollout=rollout, old_logprobs=logp, ref_logprobs=ref, old_values=None,
                      scores=torch.tensor([1.0]), entropy=torch.zeros(1, T))


@pytest.mark.parametrize("estimator, x, capped_kl", [
    ("k3", -30.0, 10.0), ("k3", -3.0, 10.0), ("k2", 12.0, 10.0), ("k1", -12.0, -10.0),
    ("k1", 2.0, 2.0),  # inside the cap: unchanged
])
def test_reward_of_a_tail_token_is_bounded(estimator, x, capped_kl):
    """The KL-shaped reward of the pipeline (add_advantages): -kl_coef x KL on every token, the
    score on the last one; at kl_coef 0.05 the tail token's reward is -0.05 x 10, not -2.4e7."""
    base = ["ppo.advantage_estimator=reinforce_pp", f"ppo.kl_estimator={estimator}"]
    out = add_advantages(_experience(x), advantage_settings(load_config(None, base), 0.05))
    assert out.rewards[0].tolist() == pytest.approx([0.0, -0.05 * capped_kl, 1.0], abs=1e-6)
    assert torch.isfinite(out.advantages).all()
    raw = add_advantages(_experience(x), advantage_settings(
        load_config(None, base + ["ppo.kl_clip=null"]), 0.05))
    want_raw = -0.05 * kl_estimate(torch.tensor([x]), torch.tensor([0.0]), estimator).item()
    assert raw.rewards[0, 1].item() == pytest.approx(want_raw, rel=1e-5)
    if (estimator, x) == ("k3", -30.0):
        assert raw.rewards[0, 1].item() == pytest.approx(-0.05 * (E20 - 21), rel=1e-5)  # -2.4e7
