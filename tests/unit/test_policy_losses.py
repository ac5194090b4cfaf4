"""ppo.policy_loss: every registered loss (algo/policy_losses.py) against its paper's objective
written out here per response and per token in float64 (plain Python loops over scalars,
autograd through them for the gradient), on ragged masks with holes, log-ratios beyond the +-20
nat clamp and NaN garbage outside the mask, under every aggregation the loss allows; and
properties the papers state (GSPO-token equals GSPO with one advantage per response; SAPO's
gradient is PPO's on-policy; CISPO keeps the gradient of clipped tokens)."""
from __future__ import annotations

import math

import pytest
import torch

from ds_ppo.algo import loss_divisor, loss_token_weights
from ds_ppo.algo.choices import POLICY_LOSSES
from ds_ppo.algo.policy_losses import PolicyLossInputs, PolicyLossSettings, policy_loss_for

# clip ranges wide enough that some responses and tokens clip and others do not
SETTINGS = PolicyLossSettings(
    clip_eps=0.2, clip_eps_high=0.28, dual_clip=None, gspo_clip_eps=0.05,
    gspo_clip_eps_high=0.08, cispo_eps_low=0.3, cispo_eps_high=0.2, gmpo_clip_eps=0.15,
    sapo_tau_pos=1.0, sapo_tau_neg=1.05)
CLAMP = 20.0  # the trainer's guard on a log-ratio before exp (algo/kl.py), not the papers'
# counted tokens of each response: ragged, with holes (tokens a correction dropped), one empty
POSITIONS = [[0, 1, 2, 3, 4, 5], [0, 2, 3], [1, 2, 3, 4, 5, 6, 7], [], [0, 1]]
B, T, L_MAX = len(POSITIONS), 8, 8
CASES = [(name, mode) for name, spec in POLICY_LOSSES.items() for mode in spec.aggregations]


def _inputs(per_response: bool, seed: int = 0):
    """float64 (B, T) log-probs (with grad), old log-probs and advantages, and the mask; NaN
    outside the mask, two log-ratios beyond the clamp (+30 and -30 nats)."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(B, T, dtype=torch.bool)
    for i, pos in enumerate(POSITIONS):
        mask[i, pos] = True
    old = -1.0 - torch.rand(B, T, generator=g, dtype=torch.float64)
    lp = old + 0.25 * torch.randn(B, T, generator=g, dtype=torch.float64)
    lp[1, 1] = 5.0  # a hole: its ratio would dominate everything if it were read
    lp[0, 0], lp[2, 4] = old[0, 0] + 30.0, old[2, 4] - 30.0
    lp[4] = old[4] + 0.001  # one response near on-policy: inside every clip
    adv = (torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, T).clone()
           if per_response else torch.randn(B, T, generator=g, dtype=torch.float64))
    for x in (lp, old, adv):
        x[~mask] = float("nan")
    return lp.requires_grad_(), old, adv, mask


def _clip(x, low, high):
    return torch.clamp(x, min=low, max=high)


def _paper(name: str, lp, old, adv, s: PolicyLossSettings):
    """Per response i the list of its per-token loss terms (the objective negated, the sequence
    losses' term repeated on each token) and the loss's clip statistic as (hits, count)."""
    terms, hits, count = [], 0.0, 0
    for i, pos in enumerate(POSITIONS):
        lr = [torch.clamp(lp[i, t] - old[i, t], -CLAMP, CLAMP) for t in pos]
        a = [adv[i, t] for t in pos]
        n = len(pos)
        row = []
        if name == "ppo":  # Schulman et al. 2017, Eq. 7
            for lr_t, a_t in zip(lr, a):
                r = torch.exp(lr_t)
                un, cl = -a_t * r, -a_t * _clip(r, 1 - s.clip_eps, 1 + s.clip_eps_high)
                row.append(torch.maximum(un, cl))
                hits, count = hits + float(cl > un), count + 1
        elif name == "gspo" and n:  # Zheng et al. 2025: s_i = (pi / pi_old)^(1 / |y_i|)
            s_i = torch.exp(sum(lr) / n)
            a_i = sum(a) / n
            un = -a_i * s_i
            cl = -a_i * _clip(s_i, 1 - s.gspo_clip_eps, 1 + s.gspo_clip_eps_high)
            row = [torch.maximum(un, cl)] * n
            hits, count = hits + float(cl > un), count + 1
        elif name == "gspo_token" and n:  # s_it = sg[s_i] pi_t / sg[pi_t]
            s_i = torch.exp(sum(lr) / n).detach()
            for lr_t, a_t in zip(lr, a):
                s_it = s_i * torch.exp(lr_t - lr_t.detach())
                un = -a_t * s_it
                cl = -a_t * _clip(s_it, 1 - s.gspo_clip_eps, 1 + s.gspo_clip_eps_high)
                row.append(torch.maximum(un, cl))
                hits, count = hits + float(cl > un), count + 1
        elif name == "cispo":  # MiniMax-M1: -sg[clip(r, 1 - eps_low, 1 + eps_high)] A log pi
            for t, lr_t, a_t in zip(pos, lr, a):
                r = torch.exp(lr_t).detach()
                w = _clip(r, 1 - s.cispo_eps_low, 1 + s.cispo_eps_high)
                row.append(-w * a_t * lp[i, t])
                hits, count = hits + float(w != r), count + 1
        elif name == "gmpo" and n:  # Zhao et al. 2025: geometric mean, clipped in log space
            a_i = sum(a) / n
            sgn = torch.sign(a_i)
            eps = s.gmpo_clip_eps
            c = [sgn * torch.minimum(sgn * x, sgn * _clip(x, -eps, eps)) for x in lr]
            row = [-a_i * torch.exp(sum(c) / n)] * n
            hits = hits + sum(float(c_t != x and a_i != 0) for c_t, x in zip(c, lr))
            count += n
        elif name == "sapo":  # Gao et al. 2025: f(r) = sigmoid(tau (r - 1)) 4 / tau
            for lr_t, a_t in zip(lr, a):
                tau = s.sapo_tau_pos if a_t > 0 else s.sapo_tau_neg
                gate = torch.sigmoid(tau * (torch.exp(lr_t) - 1))
                row.append(-a_t * gate * 4 / tau)
                hits, count = hits + float((4 * gate * (1 - gate)).detach()), count + 1
        terms.append(row)
    return terms, (hits, count)


def _aggregate(terms, mode: str):
    """The loop form of each ppo.loss_aggregation mode (aggregation.py's module docstring)."""
    seqs = [row for row in terms if row]
    if mode == "token_mean":
        return sum(sum(row) for row in seqs) / sum(len(row) for row in seqs)
    if mode == "seq_mean_token_mean":
        return sum(sum(row) / len(row) for row in seqs) / len(seqs)
    return sum(sum(row) / L_MAX for row in seqs) / len(seqs)


CLIP_STAT = {"ppo": "clip_frac", "gspo": "seq_clip_frac", "gspo_token": "clip_frac",
             "cispo": "clip_frac", "gmpo": "clip_frac", "sapo": "gate_weight_mean"}


def _weights(mask, mode: str) -> torch.Tensor:
    """aggregation.loss_token_weights in float64 (it returns float32): 1, 1 / |y| or 1 / L."""
    m = mask.double()
    if mode == "token_mean":
        return m
    return m / (m.sum(-1, keepdim=True).clamp(min=1) if mode == "seq_mean_token_mean" else L_MAX)


def _ours(name, lp, old, adv, mask, mode, rows=None):
    rows = list(range(B)) if rows is None else rows
    lengths = [len(POSITIONS[i]) for i in range(B)]
    x = PolicyLossInputs(lp[rows], old[rows], adv[rows], mask[rows],
                         num_tokens=loss_divisor([n for n in lengths if n], mode),
                         token_weights=_weights(mask[rows], mode))
    return policy_loss_for(name, x, SETTINGS)


@pytest.mark.parametrize("name, mode", CASES)
def test_each_loss_equals_its_paper_formula_loss_gradient_and_clip_statistic(name, mode):
    per_response = POLICY_LOSSES[name].per_response
    lp, old, adv, mask = _inputs(per_response)
    out = _ours(name, lp, old, adv, mask, mode)
    (grad,) = torch.autograd.grad(out.loss, lp)
    lp2 = lp.detach().clone().requires_grad_()
    terms, (hits, count) = _paper(name, lp2, old, adv, SETTINGS)
    want = _aggregate(terms, mode)
    (want_grad,) = torch.autograd.grad(want, lp2, allow_unused=True)
    assert out.loss.dtype == torch.float64
    torch.testing.assert_close(out.loss, want.detach(), rtol=1e-12, atol=1e-14)
    want_grad = torch.nan_to_num(want_grad, nan=0.0) if want_grad is not None else 0 * grad
    torch.testing.assert_close(grad, want_grad, rtol=1e-10, atol=1e-14)
    assert torch.isfinite(out.loss) and torch.isfinite(grad).all()
    assert (grad[~mask] == 0).all()  # masked positions: no gradient
    stats = {**out.token_stats, **out.seq_stats}
    # the indicators are float32 (as in policy_loss)
    assert float(stats[CLIP_STAT[name]]) == pytest.approx(hits / count, rel=1e-6)
    if name != "sapo":  # the clip acted on some responses or tokens, not all
        assert 0 < hits < count, (name, hits, count)
    assert float(out.token_stats["ratio_clamped_frac"]) == pytest.approx(2 / 18)


@pytest.mark.parametrize("name, mode", CASES)
def test_micro_batches_add_up_to_the_whole_batch(name, mode):
    """Each micro-batch normalised by the whole batch's divisor: the micro-batch losses and
    gradients sum to the whole batch's, for the sequence-level losses too."""
    lp, old, adv, mask = _inputs(POLICY_LOSSES[name].per_response, seed=1)
    whole = _ours(name, lp, old, adv, mask, mode).loss
    (want,) = torch.autograd.grad(whole, lp)
    parts = [_ours(name, lp, old, adv, mask, mode, rows).loss for rows in ([0, 3], [1], [2, 4])]
    (got,) = torch.autograd.grad(sum(parts), lp)
    torch.testing.assert_close(sum(parts), whole, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-14)


def test_gspo_token_equals_gspo_with_one_advantage_per_response_and_differs_without():
    """GSPO's Sec. 4.3: with A_it = A_i, GSPO-token and GSPO are equal in value and gradient."""
    mode = "seq_mean_token_mean"
    results = {}
    for per_response in (True, False):
        lp, old, adv, mask = _inputs(per_response, seed=2)
        for name in ("gspo", "gspo_token"):
            loss = _ours(name, lp, old, adv, mask, mode).loss
            results[name, per_response] = (loss, torch.autograd.grad(loss, lp)[0])
    for a, b in zip(results["gspo", True], results["gspo_token", True]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    assert (results["gspo", False][1] - results["gspo_token", False][1]).abs().max() > 1e-3


def test_sapo_on_policy_gradient_is_ppos_and_cispo_keeps_clipped_tokens_gradient():
    mask = torch.ones(1, 3, dtype=torch.bool)
    adv = torch.tensor([[1.5, -0.5, 2.0]], dtype=torch.float64)
    old = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64)
    grads = {}
    for name in ("ppo", "sapo"):  # r = 1: SAPO's gate weight is 1, PPO's clip inactive
        lp = old.clone().requires_grad_()
        out = policy_loss_for(name, PolicyLossInputs(lp, old, adv, mask), SETTINGS)
        grads[name] = torch.autograd.grad(out.loss, lp)[0]
    torch.testing.assert_close(grads["sapo"], grads["ppo"], rtol=1e-12, atol=0)
    torch.testing.assert_close(grads["ppo"], -adv / 3, rtol=1e-12, atol=0)
    # far off-policy (r = e^1 on every token): PPO's clip cuts the positive tokens' gradient,
    # CISPO only caps their weight at 1 + eps_high: -w A / 3 on every token
    lp = (old + 1.0).requires_grad_()
    ppo = policy_loss_for("ppo", PolicyLossInputs(lp, old, adv, mask), SETTINGS)
    assert torch.autograd.grad(ppo.loss, lp)[0][0, 0] == 0
    cispo = policy_loss_for("cispo", PolicyLossInputs(lp, old, adv, mask), SETTINGS)
    got = torch.autograd.grad(cispo.loss, lp)[0]
    torch.testing.assert_close(got, -(1 + SETTINGS.cispo_eps_high) * adv / 3, rtol=1e-12, atol=0)
    assert float(cispo.token_stats["clip_frac"]) == 1.0


def test_the_ppo_row_is_policy_loss_bit_for_bit():
    from ds_ppo.algo import policy_loss

    lp, old, adv, mask = _inputs(False, seed=3)
    w = loss_token_weights(mask, "seq_mean_token_mean").double()
    s = PolicyLossSettings(**{**SETTINGS.__dict__, "dual_clip": 3.0})
    out = policy_loss_for("ppo", PolicyLossInputs(lp, old, adv, mask, 4.0, w), s)
    loss, stats = policy_loss(lp, old, adv, mask, clip_eps=0.2, num_tokens=4.0,
                              clip_eps_high=0.28, dual_clip=3.0, token_weights=w)
    assert torch.equal(out.loss, loss) and out.token_stats.keys() == stats.keys()
    assert all(torch.equal(out.token_stats[k], v) for k, v in stats.items())
    assert not out.seq_stats


@pytest.mark.parametrize("name, bad, message", [
    ("gspo", {"gspo_clip_eps": 1.0}, "gspo clips"),
    ("cispo", {"cispo_eps_high": 0.0}, "cispo bounds"),
    ("gmpo", {"gmpo_clip_eps": 0.0}, "gmpo_clip_eps must be > 0"),
    ("sapo", {"sapo_tau_neg": -1.0}, "sapo temperatures"),
])
def test_bad_settings_are_refused(name, bad, message):
    x = torch.zeros(1, 2, dtype=torch.float64)
    s = PolicyLossSettings(**{**SETTINGS.__dict__, **bad})
    with pytest.raises(ValueError, match=message):
        policy_loss_for(name, PolicyLossInputs(x, x, x, torch.ones(1, 2, dtype=torch.bool)), s)


def test_extreme_ratios_stay_finite_in_float32():
    """Log-ratios of +-60 nats (e^60 overflows nothing after the clamp): every loss finite."""
    lp = torch.tensor([[60.0, -60.0, 0.0]], requires_grad=True)
    old = torch.zeros(1, 3)
    adv = torch.tensor([[1.0, 1.0, 1.0]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    for name in POLICY_LOSSES:
        out = policy_loss_for(name, PolicyLossInputs(lp, old, adv, mask), SETTINGS)
        grad = torch.autograd.grad(out.loss, lp)[0]
        assert math.isfinite(out.loss.item()) and torch.isfinite(grad).all(), name


def test_gmpo_counts_no_clipped_token_in_a_response_of_zero_advantage():
    """sign(0) = 0 makes every clipped log-ratio 0 there: no term, so no clip (an equal-score
    group's responses would otherwise count as clipped whatever their ratios)."""
    lp = torch.tensor([[0.05, -0.5, 0.3], [0.5, 0.05, -0.5]], dtype=torch.float64)
    adv = torch.tensor([[0.0] * 3, [1.0] * 3], dtype=torch.float64)
    mask = torch.ones(2, 3, dtype=torch.bool)
    out = policy_loss_for("gmpo", PolicyLossInputs(lp, torch.zeros_like(lp), adv, mask),
                          SETTINGS)
    assert float(out.token_stats["clip_frac"]) == pytest.approx(1 / 6)  # only 0.5 with A > 0
