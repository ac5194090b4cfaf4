"""Tests of ds_ppo.algo: hand-worked values, GAE vectorised vs loop, mask properties.

Shapes follow the package glossary: (B, T) over response tokens, mask True on
tokens that count.
"""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ds_ppo.algo import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    entropy_from_logits,
    explained_variance,
    gae,
    gae_blocked,
    gae_loop,
    gae_matmul,
    kl_estimate,
    last_valid_index,
    LOG_RATIO_CLAMP,
    logprobs_from_logits,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    policy_loss,
    response_mask,
    shape_rewards,
    value_loss,
)
from conftest import mask_from_lengths

REPO_ROOT = Path(__file__).resolve().parents[2]
GARBAGE = (float("nan"), float("inf"), -float("inf"), 1e30)


def fill_outside(x: torch.Tensor, mask: torch.Tensor, value: float) -> torch.Tensor:
    """x with every masked-out position replaced by value."""
    return torch.where(mask.bool(), x, torch.full_like(x, value))


def random_prefix_mask(B: int, T: int, generator: torch.Generator, min_len: int = 0) -> torch.Tensor:
    lengths = torch.randint(min_len, T + 1, (B,), generator=generator)
    return mask_from_lengths(lengths, T)


# --------------------------------------------------------------------------- masks


def test_response_mask_first_eos_inclusive_any_eos_id():
    eos_ids = [2, 7]
    tokens = torch.tensor(
        [
            [5, 6, 2, 9, 2],  # EOS (2) at t=2 -> keep 0..2
            [7, 1, 1, 1, 1],  # EOS (7) at t=0 -> keep only t=0
            [5, 6, 8, 9, 4],  # no EOS: truncated, all valid
            [5, 7, 2, 0, 0],  # first of either id wins: 7 at t=1
        ]
    )
    expected = torch.tensor(
        [
            [1, 1, 1, 0, 0],
            [1, 0, 0, 0, 0],
            [1, 1, 1, 1, 1],
            [1, 1, 0, 0, 0],
        ],
        dtype=torch.bool,
    )
    mask = response_mask(tokens, eos_ids)
    assert mask.dtype == torch.bool
    assert torch.equal(mask, expected)
    assert torch.equal(response_mask(tokens, 2)[0], expected[0])
    with pytest.raises(ValueError):
        response_mask(tokens, [])
    # the list form, for one response at a time: each row's tokens that the mask keeps
    from ds_ppo.algo.masks import counted_tokens

    assert [counted_tokens(row, set(eos_ids)) for row in tokens.tolist()] == [
        row[:int(m.sum())] for row, m in zip(tokens.tolist(), expected)]


def test_mask_from_lengths_and_last_valid_index():
    mask = mask_from_lengths(torch.tensor([0, 2, 4]), 4)
    assert torch.equal(mask, torch.tensor([[0, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool))
    # empty row -> -1; length 2 -> index 1; full row -> T-1
    assert last_valid_index(mask).tolist() == [-1, 1, 3]


# --------------------------------------------------------------------------- stats

X = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, -100.0]])
X_MASK = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
# valid values 1, 2, 3, 4: sum 10, mean 2.5, squared deviations 2.25+0.25+0.25+2.25 = 5


def test_masked_sum_mean_var_hand_worked():
    assert masked_sum(X, X_MASK).item() == pytest.approx(10.0)
    assert masked_mean(X, X_MASK).item() == pytest.approx(2.5)
    # per-row means: (1+2+3)/3 = 2, 4/1 = 4
    assert masked_mean(X, X_MASK, dim=-1).tolist() == pytest.approx([2.0, 4.0])
    assert masked_var(X, X_MASK).item() == pytest.approx(5.0 / 3.0)  # unbiased: 5 / (4-1)
    assert masked_var(X, X_MASK, unbiased=False).item() == pytest.approx(1.25)  # 5 / 4
    # float 0/1 masks behave as bool masks
    assert masked_mean(X, X_MASK.float()).item() == pytest.approx(2.5)


def test_masked_stats_empty_and_single():
    empty = torch.zeros_like(X_MASK)
    assert masked_mean(X, empty).item() == 0.0
    assert masked_mean(X, empty, dim=-1).tolist() == [0.0, 0.0]
    single = torch.zeros_like(X_MASK)
    single[0, 1] = True
    assert masked_var(X, single).item() == 0.0
    assert torch.equal(masked_whiten(X, single), torch.zeros_like(X))


def test_masked_whiten_hand_worked():
    std = math.sqrt(5.0 / 3.0 + 1e-8)
    expected = torch.tensor([[-1.5 / std, -0.5 / std, 0.5 / std], [1.5 / std, 0.0, 0.0]])
    out = masked_whiten(X, X_MASK)
    torch.testing.assert_close(out, expected)
    # shift_mean=False keeps the mean: (x - 2.5) / std + 2.5
    expected_keep = torch.where(X_MASK, expected + 2.5, torch.zeros_like(expected))
    torch.testing.assert_close(masked_whiten(X, X_MASK, shift_mean=False), expected_keep)
    # same as torch's unbiased std on the valid values
    valid = X[X_MASK]
    torch.testing.assert_close(out[X_MASK], (valid - valid.mean()) / torch.sqrt(valid.var() + 1e-8))


@pytest.mark.parametrize("garbage", GARBAGE)
def test_masked_stats_ignore_masked_values(garbage):
    Xg = fill_outside(X, X_MASK, garbage)
    assert masked_mean(Xg, X_MASK).item() == pytest.approx(2.5)
    assert masked_var(Xg, X_MASK).item() == pytest.approx(5.0 / 3.0)
    assert torch.equal(masked_whiten(Xg, X_MASK), masked_whiten(X, X_MASK))


def test_masked_whiten_large_mean_is_stable():
    # |mean| >> std: E[x^2] - E[x]^2 in float32 would lose every digit here.
    g = torch.Generator().manual_seed(0)
    x = 1e4 + torch.randn(4, 64, generator=g)
    mask = random_prefix_mask(4, 64, g, min_len=8)
    valid = x[mask].double()
    expected = ((valid - valid.mean()) / valid.std()).float()
    torch.testing.assert_close(masked_whiten(x, mask)[mask], expected, atol=1e-3, rtol=1e-3)


def test_explained_variance():
    returns = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    mask = torch.tensor([[1, 1, 1, 0]], dtype=torch.bool)
    # perfect critic -> 1
    assert explained_variance(returns, returns, mask).item() == pytest.approx(1.0)
    # constant critic at the mean: Var[R - V] = Var[R] -> 0
    assert explained_variance(torch.full_like(returns, 2.0), returns, mask).item() == pytest.approx(0.0, abs=1e-6)
    # V = R - [1, -1, 0]: error var (biased) = 2/3, returns var = 2/3 -> 0;
    # V = R + [0.5, 0, -0.5]: Var[R - V] = 1/6, Var[R] = 2/3 -> 1 - 1/4 = 0.75
    values = returns - torch.tensor([[-0.5, 0.0, 0.5, 99.0]])
    assert explained_variance(values, returns, mask).item() == pytest.approx(0.75)
    assert explained_variance(fill_outside(values, mask, float("nan")), returns, mask).item() == pytest.approx(0.75)
    assert math.isnan(explained_variance(returns, torch.ones_like(returns), mask).item())


def test_explained_variance_large_mean_small_variance_float32():
    # Returns near 1e4 that vary by 0.01, in float32 as the trainer holds them: E[x^2] - E[x]^2
    # (the formula the trainer's metric used) loses every digit; the two-pass one does not.
    g = torch.Generator().manual_seed(0)
    mask = random_prefix_mask(8, 64, g, min_len=8)
    returns = 1e4 + 0.01 * torch.randn(8, 64, generator=g)
    values = returns - 0.005 * torch.randn(8, 64, generator=g)  # error std 0.005: about 0.75
    r, v = returns[mask].double(), values[mask].double()
    expected = (1.0 - (r - v).var(unbiased=False) / r.var(unbiased=False)).item()
    assert 0.6 < expected < 0.9
    assert explained_variance(values, returns, mask).item() == pytest.approx(expected, abs=1e-6)

    m, n = mask.float(), float(mask.sum())

    def var_from_moments(x: torch.Tensor) -> float:  # float32 sums, then E[x^2] - E[x]^2
        return float((x * x * m).sum()) / n - (float((x * m).sum()) / n) ** 2

    assert abs(var_from_moments(returns) - r.var(unbiased=False).item()) > 1.0  # var ~ 1e-4
    naive = 1.0 - var_from_moments(returns - values) / var_from_moments(returns)
    assert not abs(naive - expected) < 0.2  # badly off (or NaN)


# --------------------------------------------------------------------------- KL


def test_kl_estimate_hand_worked():
    # p = 0.5 under the policy, q = 0.25 under the reference.
    logprobs = torch.tensor([[math.log(0.5)]])
    ref = torch.tensor([[math.log(0.25)]])
    log2 = math.log(2.0)
    assert kl_estimate(logprobs, ref, "k1").item() == pytest.approx(log2)  # log p - log q
    assert kl_estimate(logprobs, ref, "k2").item() == pytest.approx(0.5 * log2**2)  # 0.2402
    # k3: r = q/p = 0.5; (r - 1) - log r = -0.5 + log 2 = 0.1931
    assert kl_estimate(logprobs, ref, "k3").item() == pytest.approx(-0.5 + log2)
    assert kl_estimate(logprobs, ref).item() == pytest.approx(log2)  # default k1


def test_kl_estimate_unknown_estimator_names_valid_ones():
    with pytest.raises(ValueError, match="k1, k2, k3"):
        kl_estimate(torch.zeros(1, 1), torch.zeros(1, 1), "k4")
    assert KL_ESTIMATORS == ("k1", "k2", "k3")


def test_kl_estimators_nonnegative_and_zero_at_equality():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)
    for est in ("k2", "k3"):
        assert (kl_estimate(a, b, est) >= 0).all()
    for est in KL_ESTIMATORS:
        assert torch.equal(kl_estimate(a, a, est), torch.zeros_like(a))


def test_fixed_kl_controller():
    ctl = FixedKLController(0.1)
    ctl.update(100.0, 1000)
    assert ctl.value == 0.1
    other = FixedKLController(0.5)
    other.load_state_dict(ctl.state_dict())
    assert other.value == 0.1


def test_adaptive_kl_controller_hand_worked():
    ctl = AdaptiveKLController(init_kl_coef=0.1, target=6.0, horizon=10000)
    # KL 9 is 50% over target: error clipped to +0.2; coef *= 1 + 0.2 * 256/10000 = 1.00512
    ctl.update(9.0, n_steps=256)
    assert ctl.value == pytest.approx(0.1 * 1.00512)
    # KL 6.6: error 0.1 (unclipped); coef *= 1 + 0.1 * 256/10000 = 1.00256
    ctl.update(torch.tensor(6.6), n_steps=256)
    assert ctl.value == pytest.approx(0.1 * 1.00512 * 1.00256)
    # KL 0: error clipped to -0.2; coef *= 1 - 0.2 * 1000/10000 = 0.98
    ctl.update(0.0, n_steps=1000)
    assert ctl.value == pytest.approx(0.1 * 1.00512 * 1.00256 * 0.98)
    state = ctl.state_dict()
    assert all(type(v) is float for v in state.values())
    restored = AdaptiveKLController(init_kl_coef=1.0, target=6.0, horizon=10000)
    restored.load_state_dict(state)
    assert restored.value == ctl.value
    with pytest.raises(ValueError):
        AdaptiveKLController(0.1, target=0.0, horizon=10000)


# --------------------------------------------------------------------------- rewards


def test_shape_rewards_hand_worked():
    g = 123.0  # garbage at masked positions
    logprobs = torch.tensor([[-1.0, -2.0, g, g], [-1.0, -1.0, -1.0, -1.0], [g, g, g, g]])
    ref = torch.tensor([[-1.5, -1.0, g, g], [-1.0, -1.0, -1.0, -2.0], [g, g, g, g]])
    mask = mask_from_lengths(torch.tensor([2, 4, 0]), 4)
    scores = torch.tensor([1.0, -2.0, 5.0])
    rewards = shape_rewards(scores, kl_estimate(logprobs, ref, "k1"), mask, kl_coef=0.1, score_clip=1.5)
    expected = torch.tensor(
        [
            # k1 = [0.5, -1.0] -> -0.1 * k1 = [-0.05, 0.1]; score 1.0 at t=1 -> 1.1
            [-0.05, 1.1, 0.0, 0.0],
            # k1 = [0, 0, 0, 1] -> [0, 0, 0, -0.1]; score -2 clipped to -1.5 at t=3 -> -1.6
            [0.0, 0.0, 0.0, -1.6],
            # empty mask: the score (5, clipped to 1.5) has no token and is dropped
            [0.0, 0.0, 0.0, 0.0],
        ]
    )
    torch.testing.assert_close(rewards, expected)


def test_shape_rewards_score_on_last_valid_token_for_every_length():
    T = 6
    for length in range(1, T + 1):
        mask = mask_from_lengths(torch.tensor([length]), T)
        rewards = shape_rewards(torch.tensor([3.0]), kl_estimate(torch.zeros(1, T), torch.zeros(1, T)), mask, kl_coef=0.1)
        expected = torch.zeros(1, T)
        expected[0, length - 1] = 3.0  # never at T-1 unless the row fills T
        assert torch.equal(rewards, expected), length


@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
@pytest.mark.parametrize("garbage", GARBAGE)
def test_shape_rewards_ignores_masked_positions(estimator, garbage):
    gen = torch.Generator().manual_seed(1)
    B, T = 5, 7
    mask = random_prefix_mask(B, T, gen)
    scores = torch.randn(B, generator=gen)
    lp, ref = -torch.rand(B, T, generator=gen), -torch.rand(B, T, generator=gen)
    clean = shape_rewards(scores, kl_estimate(lp, ref, estimator), mask, kl_coef=0.2)
    dirty = shape_rewards(scores, kl_estimate(fill_outside(lp, mask, garbage), fill_outside(ref, mask, -garbage), estimator), mask, 0.2)
    assert torch.equal(clean, dirty)
    assert torch.equal(clean[~mask], torch.zeros_like(clean[~mask]))


# --------------------------------------------------------------------------- GAE

GAE_IMPLS = [gae, gae_loop, gae_matmul, lambda *a, **k: gae_blocked(*a, **k, block=2)]


@pytest.mark.parametrize("impl", GAE_IMPLS)
def test_gae_hand_worked(impl):
    g = 50.0  # garbage outside the mask
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.2, 1.0, g]])
    values = torch.tensor([[0.5, 0.6, 0.7], [0.5, 0.4, g]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    adv, ret = impl(rewards, values, mask, gamma=0.9, lam=0.8)
    # gamma*lam = 0.9*0.8 = 0.72; V after the last valid token = 0.
    # row 0: delta2 = 1 + 0.9*0 - 0.7 = 0.3
    #        delta1 = 0 + 0.9*0.7 - 0.6 = 0.03
    #        delta0 = 0 + 0.9*0.6 - 0.5 = 0.04
    #        A2 = 0.3; A1 = 0.03 + 0.72*0.3 = 0.246; A0 = 0.04 + 0.72*0.246 = 0.21712
    # row 1: delta1 = 1 + 0.9*0 - 0.4 = 0.6; delta0 = 0.2 + 0.9*0.4 - 0.5 = 0.06
    #        A1 = 0.6; A0 = 0.06 + 0.72*0.6 = 0.492
    expected_adv = torch.tensor([[0.21712, 0.246, 0.3], [0.492, 0.6, 0.0]])
    expected_ret = torch.tensor([[0.21712 + 0.5, 0.246 + 0.6, 0.3 + 0.7], [0.492 + 0.5, 0.6 + 0.4, 0.0]])
    torch.testing.assert_close(adv, expected_adv)
    torch.testing.assert_close(ret, expected_ret)


@pytest.mark.parametrize("impl", GAE_IMPLS)
def test_gae_hand_worked_default_gamma_lam(impl):
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.6, 0.7]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    adv, ret = impl(rewards, values, mask)  # gamma 1.0, lam 0.95 -> gamma*lam = 0.95
    # deltas: [0.6-0.5, 0.7-0.6, 1-0.7] = [0.1, 0.1, 0.3]
    # A2 = 0.3; A1 = 0.1 + 0.95*0.3 = 0.385; A0 = 0.1 + 0.95*0.385 = 0.46575
    torch.testing.assert_close(adv, torch.tensor([[0.46575, 0.385, 0.3]]))
    torch.testing.assert_close(ret, torch.tensor([[0.96575, 0.985, 1.0]]))


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.99, 0.95), (1.0, 1.0), (0.5, 0.1), (1.0, 0.0), (0.0, 0.95), (0.9, 0.01)])
def test_gae_vectorised_matches_loop(gamma, lam):
    gen = torch.Generator().manual_seed(2)
    B, T = 8, 37
    mask = random_prefix_mask(B, T, gen)
    rewards, values = torch.randn(B, T, generator=gen), torch.randn(B, T, generator=gen)
    adv_loop, ret_loop = gae_loop(rewards, values, mask, gamma, lam)
    adv_vec, ret_vec = gae_matmul(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(adv_vec, adv_loop, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ret_vec, ret_loop, atol=1e-5, rtol=1e-5)
    adv, _ = gae(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(adv, adv_loop, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", GAE_IMPLS)
@pytest.mark.parametrize("garbage", GARBAGE)
def test_gae_ignores_masked_positions(impl, garbage):
    gen = torch.Generator().manual_seed(3)
    B, T = 6, 9
    mask = random_prefix_mask(B, T, gen)
    rewards, values = torch.randn(B, T, generator=gen), torch.randn(B, T, generator=gen)
    clean = impl(rewards, values, mask, 0.99, 0.95)
    dirty = impl(fill_outside(rewards, mask, garbage), fill_outside(values, mask, garbage), mask, 0.99, 0.95)
    for c, d in zip(clean, dirty):
        assert torch.equal(c, d)
        assert torch.equal(c[~mask], torch.zeros_like(c[~mask]))


@pytest.mark.parametrize("T,block", [(1, 4), (5, 2), (37, 4), (37, 37), (37, 100), (700, 256)])
@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.99, 0.95), (0.5, 0.1), (1.0, 1.0)])
def test_gae_blocked_matches_loop(T, block, gamma, lam):
    """The blocked scan against the textbook loop: blocks that divide T, a short first block,
    one block longer than T."""
    gen = torch.Generator().manual_seed(T)
    mask = random_prefix_mask(4, T, gen)
    rewards, values = torch.randn(4, T, generator=gen), torch.randn(4, T, generator=gen)
    for got, want in zip(gae_blocked(rewards, values, mask, gamma, lam, block=block),
                         gae_loop(rewards, values, mask, gamma, lam)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_gae_above_threshold_is_blocked_and_equal():
    import importlib

    gae_module = importlib.import_module("ds_ppo.algo.returns")
    T = gae_module.BLOCKED_ABOVE + 77
    gen = torch.Generator().manual_seed(5)
    mask = random_prefix_mask(3, T, gen)
    rewards, values = torch.randn(3, T, generator=gen), torch.randn(3, T, generator=gen)
    for got, want in zip(gae(rewards, values, mask), gae_matmul(rewards, values, mask)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


GAE_MEMORY = """
import resource, sys, torch
from ds_ppo.algo import gae
B, T = 2, 32768
rewards, values = torch.randn(B, T), torch.randn(B, T)
mask = torch.ones(B, T, dtype=torch.bool)
vm = int(next(l for l in open("/proc/self/status") if l.startswith("VmSize")).split()[1]) * 1024
limit = vm + 512 * 2**20  # half a GiB more address space; one (T, T) float64 matrix is 8 GiB
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
adv, ret = gae(rewards, values, mask)
print(bool(torch.isfinite(adv).all()), adv.shape[1])
"""


def test_gae_at_32k_tokens_fits_in_half_a_gib():
    """Long-reasoning lengths: GAE at T = 32768 under an address-space limit of +512 MiB (a
    (T, T) float64 matrix would need 8 GiB)."""
    proc = subprocess.run([sys.executable, "-c", GAE_MEMORY], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(REPO_ROOT),
                                            "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["True", "32768"]


# --------------------------------------------------------------------------- policy loss


def _policy_case():
    mask = torch.tensor([[1, 1, 1, 0]], dtype=torch.bool)
    old = torch.tensor([[-1.0, -1.0, -1.0, -1.0]])
    ratios = torch.tensor([[1.5, 0.5, 1.1, 1.0]])
    logprobs = (old + ratios.log()).requires_grad_(True)
    advantages = torch.tensor([[1.0, 1.0, -2.0, 7.0]])
    return logprobs, old, advantages, mask


def test_policy_loss_hand_worked():
    logprobs, old, adv, mask = _policy_case()
    loss, stats = policy_loss(logprobs, old, adv, mask, clip_eps=0.2)
    # t0: r=1.5, A=1:  max(-1.5, -1.2) = -1.2  (clipped term wins)
    # t1: r=0.5, A=1:  max(-0.5, -0.8) = -0.5
    # t2: r=1.1, A=-2: max(2.2, 2.2)  = 2.2
    # mean over 3 valid tokens: (-1.2 - 0.5 + 2.2) / 3 = 0.5 / 3
    assert loss.item() == pytest.approx(0.5 / 3)
    assert stats["clip_frac"].item() == pytest.approx(1 / 3)
    assert stats["ratio_mean"].item() == pytest.approx((1.5 + 0.5 + 1.1) / 3)
    # (r-1) - log r: (0.5 - log 1.5) + (-0.5 - log 0.5) + (0.1 - log 1.1)
    approx_kl = (0.5 - math.log(1.5) - 0.5 - math.log(0.5) + 0.1 - math.log(1.1)) / 3
    assert stats["approx_kl"].item() == pytest.approx(approx_kl, rel=1e-5)
    assert all(not v.requires_grad and v.dim() == 0 for v in stats.values())
    loss.backward()
    # d/dlogp of -A*r = -A*r (r = exp(logp - old)); t0 clipped -> 0; each / 3
    expected_grad = torch.tensor([[0.0, -0.5 / 3, 2.2 / 3, 0.0]])
    torch.testing.assert_close(logprobs.grad, expected_grad)
    # num_tokens divides the masked sum instead: 0.5 / 10
    loss10, _ = policy_loss(logprobs, old, adv, mask, clip_eps=0.2, num_tokens=10)
    assert loss10.item() == pytest.approx(0.05)


@pytest.mark.parametrize("garbage", GARBAGE)
def test_policy_loss_masked_positions(garbage):
    gen = torch.Generator().manual_seed(4)
    B, T = 4, 6
    mask = random_prefix_mask(B, T, gen, min_len=1)
    old = -torch.rand(B, T, generator=gen)
    # |log r| < 0.05 keeps every ratio inside the clip range, so every valid token has a gradient
    delta = 0.05 * (2 * torch.rand(B, T, generator=gen) - 1)
    adv = torch.randn(B, T, generator=gen).sign()  # |A| = 1, nonzero
    lp_clean = (old + delta).requires_grad_(True)
    loss_clean, stats_clean = policy_loss(lp_clean, old, adv, mask)
    loss_clean.backward()
    lp_dirty = fill_outside(old + delta, mask, garbage).requires_grad_(True)
    loss_dirty, stats_dirty = policy_loss(
        lp_dirty, fill_outside(old, mask, -garbage), fill_outside(adv, mask, garbage), mask
    )
    loss_dirty.backward()
    assert torch.equal(loss_clean, loss_dirty)
    for k in stats_clean:
        assert torch.equal(stats_clean[k], stats_dirty[k]), k
    assert torch.equal(lp_clean.grad, lp_dirty.grad)
    assert (lp_dirty.grad[~mask] == 0).all()
    assert (lp_dirty.grad[mask] != 0).all()


def test_policy_loss_num_tokens_micro_batches_sum_to_full_batch_mean():
    gen = torch.Generator().manual_seed(5)
    B, T = 6, 8
    lengths = torch.tensor([1, 8, 3, 5, 2, 7])  # uneven tokens per micro-batch
    mask = mask_from_lengths(lengths, T)
    old = -torch.rand(B, T, generator=gen)
    adv = torch.randn(B, T, generator=gen)
    lp = (old + 0.3 * torch.randn(B, T, generator=gen)).requires_grad_(True)
    full, _ = policy_loss(lp, old, adv, mask)
    (full_grad,) = torch.autograd.grad(full, lp)
    total_tokens = float(mask.sum())
    parts = [policy_loss(lp[i : i + 2], old[i : i + 2], adv[i : i + 2], mask[i : i + 2], num_tokens=total_tokens)[0] for i in range(0, B, 2)]
    accumulated = sum(parts)
    (acc_grad,) = torch.autograd.grad(accumulated, lp)
    torch.testing.assert_close(accumulated, full)
    torch.testing.assert_close(acc_grad, full_grad)
    # whereas averaging per-micro-batch means does not (sanity check of the test)
    naive = sum(policy_loss(lp[i : i + 2], old[i : i + 2], adv[i : i + 2], mask[i : i + 2])[0] for i in range(0, B, 2)) / 3
    assert not torch.allclose(naive, full)
    with pytest.raises(ValueError):
        policy_loss(lp, old, adv, mask, num_tokens=0)


def test_adversarial_log_probs_keep_kl_loss_and_gradients_finite():
    """A tail token 100 nats apart (e^100 overflows float32): the k2/k3 KL, the shaped reward,
    the policy loss and its gradient stay finite, and the clamped tokens are counted."""
    from ds_ppo.algo import log_ratio_clamped

    logp = torch.tensor([[-0.5, -100.0, 0.0, -1.0]])
    ref = torch.tensor([[-0.6, 0.0, -100.0, -1.0]])
    mask = torch.ones(1, 4, dtype=torch.bool)
    for estimator in ("k2", "k3"):
        kl = kl_estimate(logp, ref, estimator)
        assert torch.isfinite(kl).all(), (estimator, kl)
        bound = LOG_RATIO_CLAMP
        expected = 0.5 * bound ** 2 if estimator == "k2" else math.expm1(bound) - bound
        assert kl[0, 1].item() == pytest.approx(expected, rel=1e-5)
        assert torch.isfinite(shape_rewards(torch.ones(1), kl, mask, 0.1)).all()
    assert log_ratio_clamped(logp - ref).tolist() == [[False, True, True, False]]
    old = torch.tensor([[-0.5, -200.0, 0.0, -1.0]])
    for adv in (torch.tensor([[1.0, -1.0, 1.0, 1.0]]), torch.tensor([[-1.0, 1.0, -1.0, 1.0]])):
        logprobs = torch.tensor([[-0.4, 0.0, -150.0, -1.0]], requires_grad=True)
        loss, stats = policy_loss(logprobs, old, adv, mask, clip_eps=0.2)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(logprobs.grad).all(), (loss, logprobs.grad)
        assert all(torch.isfinite(v) for v in stats.values())
        assert stats["ratio_clamped_frac"].item() == pytest.approx(0.5)


def test_policy_loss_empty_mask_is_zero():
    lp = torch.zeros(2, 3, requires_grad=True)
    loss, stats = policy_loss(lp, torch.zeros(2, 3), torch.ones(2, 3), torch.zeros(2, 3, dtype=torch.bool))
    loss.backward()
    assert loss.item() == 0.0 and (lp.grad == 0).all()
    assert all(torch.isfinite(v) for v in stats.values())


# --------------------------------------------------------------------------- value loss


def test_value_loss_hand_worked():
    g = 9.0
    mask = torch.tensor([[1, 1, 1, 0]], dtype=torch.bool)
    values = torch.tensor([[1.0, 2.0, 0.0, g]], requires_grad=True)
    old = torch.tensor([[0.5, 1.9, 0.0, g]])
    returns = torch.tensor([[2.0, 1.0, 1.0, g]])
    loss, stats = value_loss(values, old, returns, mask, clip_eps=0.2)
    # t0: (1-2)^2 = 1; v_clip = 0.5 + clip(0.5, +-0.2) = 0.7 -> (0.7-2)^2 = 1.69; max 1.69 (clipped)
    # t1: (2-1)^2 = 1; v_clip = 1.9 + 0.1 = 2.0 -> 1; max 1
    # t2: (0-1)^2 = 1; v_clip = 0 -> 1; max 1
    # 0.5 * (1.69 + 1 + 1) / 3 = 0.615
    assert loss.item() == pytest.approx(0.615)
    assert stats["vf_clip_frac"].item() == pytest.approx(1 / 3)
    assert stats["values_mean"].item() == pytest.approx(1.0)  # (1 + 2 + 0) / 3
    loss.backward()
    # t0: clipped term wins and is flat in v -> 0; t1: both terms tie, d/dv = 0.5*2*(2-1)/3 = 1/3;
    # t2: 0.5*2*(0-1)/3 = -1/3
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, 1 / 3, -1 / 3, 0.0]]))
    unclipped, stats_u = value_loss(values, old, returns, mask, clip_eps=None)
    assert unclipped.item() == pytest.approx(0.5)  # 0.5 * (1 + 1 + 1) / 3
    assert stats_u["vf_clip_frac"].item() == 0.0
    # num_tokens: 0.5 * 3.69 / 9 = 0.205
    assert value_loss(values, old, returns, mask, num_tokens=9)[0].item() == pytest.approx(0.205)


@pytest.mark.parametrize("clip_eps", [0.2, None])
@pytest.mark.parametrize("garbage", GARBAGE)
def test_value_loss_masked_positions(clip_eps, garbage):
    gen = torch.Generator().manual_seed(6)
    B, T = 4, 6
    mask = random_prefix_mask(B, T, gen, min_len=1)
    old = torch.randn(B, T, generator=gen)
    returns = old + 1.0 + torch.rand(B, T, generator=gen)  # |R - V| >= 1: nonzero gradient
    v0 = old + 0.05 * torch.randn(B, T, generator=gen)  # inside the clip range
    v_clean = v0.clone().requires_grad_(True)
    loss_clean, stats_clean = value_loss(v_clean, old, returns, mask, clip_eps)
    loss_clean.backward()
    v_dirty = fill_outside(v0, mask, garbage).requires_grad_(True)
    loss_dirty, stats_dirty = value_loss(
        v_dirty, fill_outside(old, mask, garbage), fill_outside(returns, mask, -garbage), mask, clip_eps
    )
    loss_dirty.backward()
    assert torch.equal(loss_clean, loss_dirty)
    for k in stats_clean:
        assert torch.equal(stats_clean[k], stats_dirty[k]), k
    assert torch.equal(v_clean.grad, v_dirty.grad)
    assert (v_dirty.grad[~mask] == 0).all()
    assert (v_dirty.grad[mask] != 0).all()


def test_value_loss_num_tokens_micro_batches_sum_to_full_batch_mean():
    gen = torch.Generator().manual_seed(7)
    B, T = 4, 5
    mask = mask_from_lengths(torch.tensor([5, 1, 2, 4]), T)
    old, returns = torch.randn(B, T, generator=gen), torch.randn(B, T, generator=gen)
    values = (old + 0.3 * torch.randn(B, T, generator=gen)).requires_grad_(True)
    full, _ = value_loss(values, old, returns, mask)
    n = float(mask.sum())
    accumulated = value_loss(values[:1], old[:1], returns[:1], mask[:1], num_tokens=n)[0] + value_loss(
        values[1:], old[1:], returns[1:], mask[1:], num_tokens=n
    )[0]
    torch.testing.assert_close(accumulated, full)
    torch.testing.assert_close(torch.autograd.grad(accumulated, values)[0], torch.autograd.grad(full, values)[0])


# --------------------------------------------------------------------------- logits


def _reference_logprobs(logits, labels):
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def _reference_entropy(logits):
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("chunk_size", [1, 3, 5, 1024])  # T=5: multi-token blocks, whole rows, many rows
def test_logprobs_and_entropy_match_reference(dtype, tol, chunk_size):
    gen = torch.Generator().manual_seed(8)
    B, L, V = 3, 7, 11
    full = (3 * torch.randn(B, L, V, generator=gen)).to(dtype)
    logits = full[:, 1:-1]  # non-contiguous slice, as when stripping the prompt: (B, 5, V)
    labels = torch.randint(0, V, (B, L - 2), generator=gen)
    for fn, ref_fn, args in [
        (logprobs_from_logits, _reference_logprobs, (labels,)),
        (entropy_from_logits, _reference_entropy, ()),
    ]:
        x = logits.detach().clone().requires_grad_(True)
        x_ref = logits.detach().clone().requires_grad_(True)
        out = fn(x, *args, chunk_size=chunk_size)
        ref = ref_fn(x_ref, *args)
        assert out.dtype == torch.float32 and out.shape == (B, L - 2)
        torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
        upstream = torch.randn(B, L - 2, generator=gen)
        (out * upstream).sum().backward()
        (ref * upstream).sum().backward()
        assert x.grad.dtype == dtype
        torch.testing.assert_close(x.grad.float(), x_ref.grad.float(), atol=tol, rtol=tol)


def test_logits_functions_gradcheck_float64():
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(2, 3, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    labels = torch.randint(0, 5, (2, 3), generator=gen)
    assert torch.autograd.gradcheck(lambda z: logprobs_from_logits(z, labels, chunk_size=2), (x,))
    assert torch.autograd.gradcheck(lambda z: entropy_from_logits(z, chunk_size=2), (x,))


def test_logits_functions_never_materialise_full_float32_copy():
    from torch.utils._python_dispatch import TorchDispatchMode

    class LargestFloat32(TorchDispatchMode):
        """Records the largest float32 tensor any op produces."""

        def __init__(self):
            super().__init__()
            self.largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                    self.largest = max(self.largest, t.numel())
            return out

    B, T, V, chunk = 4, 6, 32, 4
    logits = torch.randn(B, T, V).to(torch.bfloat16).requires_grad_(True)
    labels = torch.randint(0, V, (B, T))
    with LargestFloat32() as probe:
        loss = logprobs_from_logits(logits, labels, chunk_size=chunk).sum() + entropy_from_logits(logits, chunk_size=chunk).sum()
        loss.backward()
    assert 0 < probe.largest <= chunk * V < B * T * V
    with LargestFloat32() as probe_ref:  # the probe does see the naive upcast
        _reference_logprobs(logits, labels).sum().backward()
    assert probe_ref.largest >= B * T * V


# --------------------------------------------------------------------------- imports


def test_import_pulls_no_deepspeed_or_transformers():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    code = (
        "import ds_ppo.algo, sys; "
        "assert 'deepspeed' not in sys.modules and 'transformers' not in sys.modules, "
        "[m for m in sys.modules if m.split('.')[0] in ('deepspeed', 'transformers')]"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=REPO_ROOT)


def test_lm_loss_is_the_masked_nll_over_the_given_token_count():
    from ds_ppo.algo import lm_loss

    logprobs = torch.tensor([[-1.0, -2.0, -9.0], [-0.5, float("nan"), 0.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    assert float(lm_loss(logprobs, mask)) == pytest.approx(3.5 / 3)  # this batch's tokens
    assert float(lm_loss(logprobs, mask, num_tokens=7.0)) == pytest.approx(3.5 / 7)
    lp = logprobs.clone().requires_grad_()
    lm_loss(lp, mask, num_tokens=7.0).backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-1 / 7, -1 / 7, 0.0], [-1 / 7, 0.0, 0.0]]))
    assert (lp.grad[~mask] == 0).all()  # masked positions (NaN included): exactly 0
