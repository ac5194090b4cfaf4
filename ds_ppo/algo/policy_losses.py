"""The policy losses, one registered function each (`ppo.policy_loss`; the registry reads
`algo/choices.POLICY_LOSSES` for everything but the math).

Each function takes a micro-batch's log-probs, old log-probs and advantages and returns the loss
and its statistics. The loss is, like `losses.policy_loss`, a weighted masked SUM of per-token
terms divided by `num_tokens` (None: this micro-batch's token mean), the weights being
`ppo.loss_aggregation`'s (`aggregation.loss_token_weights`) times the rollout-correction
importance weights, so micro-batches and data-parallel ranks add up to the global mini-batch.
A sequence-level loss puts its response's term on every counted token of the response; with
`seq_mean_token_mean` (weights 1 / |y|) the response then counts once, as in its paper.

Every row of a micro-batch is whole (packed, tiled and sequence-parallel forwards return each
row's (1, T) log-probs entire), so the per-response means here see the whole response.

Log-ratios are clamped to +-LOG_RATIO_CLAMP (20 nats) before any exp, as in `policy_loss`: a
clamped token's term is finite and carries no ratio gradient. Inputs outside the mask are
replaced by 0 first: they change neither the loss nor the gradients.

Shapes: (B, T) over response tokens (B = sequences, T = response tokens), `mask` True on tokens
that count. Imports only torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from .choices import POLICY_LOSSES
from .kl import LOG_RATIO_CLAMP, log_ratio_clamped
from .losses import _reduce, _zero_outside, policy_loss
from .stats import masked_mean, masked_sum


@dataclass(frozen=True)
class PolicyLossSettings:
    """The clip and gate settings of every policy loss (config ppo.*; each loss reads the ones
    its table row names)."""

    clip_eps: float  # ppo: the ratio's clip range
    clip_eps_high: float | None  # ppo: upper clip (DAPO's clip-higher); None = clip_eps
    dual_clip: float | None  # ppo: dual clip c > 1; None = off
    gspo_clip_eps: float  # gspo, gspo_token: the response ratio's lower clip, 1 - eps
    gspo_clip_eps_high: float  # gspo, gspo_token: its upper clip, 1 + eps_high
    cispo_eps_low: float | None  # cispo: the weight's lower bound 1 - eps_low; None = none
    cispo_eps_high: float  # cispo: the weight's upper bound 1 + eps_high
    gmpo_clip_eps: float  # gmpo: each token's log-ratio bound, +-eps nats
    sapo_tau_pos: float  # sapo: the gate's temperature where the advantage is > 0
    sapo_tau_neg: float  # sapo: and where it is <= 0


@dataclass(frozen=True)
class PolicyLossOut:
    """A policy loss on one micro-batch: the loss and detached statistics, each a mean over
    this rank's micro-batch (per-rank): over its counted tokens, or over its responses with a
    counted token (`seq_stats`, for the losses that clip responses)."""

    loss: torch.Tensor  # 0-dim, with grad
    token_stats: dict[str, torch.Tensor]
    seq_stats: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class PolicyLossInputs:
    """What a policy loss reads. B = sequences, T = response tokens."""

    logprobs: torch.Tensor  # (B, T) current policy log-probs (nats), with grad
    old_logprobs: torch.Tensor  # (B, T) log-probs of the ratio's old policy (nats)
    advantages: torch.Tensor  # (B, T)
    mask: torch.Tensor  # (B, T) bool/0-1
    num_tokens: float | None = None  # the divisor of the masked sum (None: token mean)
    token_weights: torch.Tensor | None = None  # (B, T) weight of each token's term; None = 1


Loss = Callable[[PolicyLossInputs, PolicyLossSettings], PolicyLossOut]
_FUNCTIONS: dict[str, Loss] = {}


def register_policy_loss(name: str) -> Callable[[Loss], Loss]:
    """Decorator: `fn` computes the policy loss of the table row `name` (algo/choices.py)."""
    if name not in POLICY_LOSSES:
        raise ValueError(f"{name!r} has no row in algo/choices.POLICY_LOSSES")

    def add(fn: Loss) -> Loss:
        _FUNCTIONS[name] = fn
        return fn
    return add


def policy_loss_for(name: str, x: PolicyLossInputs, s: PolicyLossSettings) -> PolicyLossOut:
    """The policy loss `name` (ppo.policy_loss) on micro-batch `x`."""
    if name not in _FUNCTIONS:
        raise ValueError(f"unknown policy loss {name!r}; valid: {', '.join(_FUNCTIONS)}")
    return _FUNCTIONS[name](x, s)


def registered() -> tuple[str, ...]:
    return tuple(_FUNCTIONS)


@register_policy_loss("ppo")
def _ppo(x: PolicyLossInputs, s: PolicyLossSettings) -> PolicyLossOut:
    # PPO's clip (Schulman et al. 2017, Eq. 7), with clip-higher and dual clip: losses.py
    loss, stats = policy_loss(x.logprobs, x.old_logprobs, x.advantages, x.mask,
                              clip_eps=s.clip_eps, num_tokens=x.num_tokens,
                              clip_eps_high=s.clip_eps_high, dual_clip=s.dual_clip,
                              token_weights=x.token_weights)
    return PolicyLossOut(loss, stats)


@dataclass(frozen=True)
class _Ratios:
    """The terms every loss below starts from (0 outside the mask)."""

    mask: torch.Tensor  # (B, T) bool
    log_ratio: torch.Tensor  # (B, T) log(pi / pi_old), clamped to +-LOG_RATIO_CLAMP, with grad
    advantages: torch.Tensor  # (B, T)
    counts: torch.Tensor  # (B,) counted tokens |y| of each response
    rows: torch.Tensor  # (B,) bool, responses with a counted token
    stats: dict[str, torch.Tensor]  # the token statistics every loss reports


def _ratios(x: PolicyLossInputs) -> _Ratios:
    mask = x.mask.bool()
    raw = _zero_outside(x.logprobs - x.old_logprobs, mask)
    log_ratio = raw.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    counts = mask.sum(dim=-1)
    with torch.no_grad():
        lr = log_ratio.detach()
        stats = {"approx_kl": masked_mean(torch.expm1(lr) - lr, mask),  # k3, Schulman 2020
                 "ratio_mean": masked_mean(torch.exp(lr), mask),
                 "ratio_clamped_frac": masked_mean(log_ratio_clamped(raw).float(), mask)}
    return _Ratios(mask, log_ratio, _zero_outside(x.advantages, mask), counts, counts > 0,
                   stats)


def _per_response(values: torch.Tensor, r: _Ratios) -> torch.Tensor:
    """(B,) each response's mean of (B, T) `values` over its counted tokens (0 if none)."""
    return masked_sum(values, r.mask, dim=-1) / r.counts.clamp(min=1)


def _on_tokens(per_response: torch.Tensor, r: _Ratios) -> torch.Tensor:
    """A (B,) term of each response on each of its tokens: (B, T)."""
    return per_response[:, None].expand_as(r.mask)


def _row_mean(x: torch.Tensor, r: _Ratios) -> torch.Tensor:
    """Mean of (B,) `x` over the responses with a counted token (0 if none)."""
    return masked_sum(x, r.rows) / r.rows.sum().clamp(min=1)


def _gspo_bounds(s: PolicyLossSettings) -> tuple[float, float]:
    if not 0 < s.gspo_clip_eps < 1 or s.gspo_clip_eps_high <= 0:
        raise ValueError(f"gspo clips must be 0 < gspo_clip_eps < 1 and gspo_clip_eps_high > 0, "
                         f"got {s.gspo_clip_eps}, {s.gspo_clip_eps_high}")
    return 1.0 - s.gspo_clip_eps, 1.0 + s.gspo_clip_eps_high


@register_policy_loss("gspo")
def _gspo(x: PolicyLossInputs, s: PolicyLossSettings) -> PolicyLossOut:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"): per response i,
        s_i = exp(mean_t log(pi_t / pi_old_t)) = (pi(y_i) / pi_old(y_i))^(1 / |y_i|)
        loss_i = max(-A_i s_i, -A_i clip(s_i, 1 - gspo_clip_eps, 1 + gspo_clip_eps_high))
    A_i the response's advantage (the mean of its tokens'; one value per response with the
    estimators this loss allows), loss_i on each of its tokens: seq_mean_token_mean gives
    1/G sum_i loss_i. The gradient of s_i spreads over all the response's tokens."""
    low, high = _gspo_bounds(s)
    r = _ratios(x)
    ratio = torch.exp(_per_response(r.log_ratio, r))  # (B,)
    adv = _per_response(r.advantages, r)
    unclipped, clipped = -adv * ratio, -adv * ratio.clamp(low, high)
    per_response = torch.maximum(unclipped, clipped)
    loss = _reduce(_on_tokens(per_response, r), r.mask, x.num_tokens, x.token_weights)
    with torch.no_grad():
        seq = {"seq_clip_frac": _row_mean((clipped > unclipped).float(), r),
               "seq_ratio_mean": _row_mean(ratio, r)}
    return PolicyLossOut(loss, r.stats, seq)


@register_policy_loss("gspo_token")
def _gspo_token(x: PolicyLossInputs, s: PolicyLossSettings) -> PolicyLossOut:
    """GSPO-token (Zheng et al. 2025, Sec. 4.3): per token,
        s_it = sg[s_i] * pi_t / sg[pi_t]   (the value of s_i; the gradient s_i grad log pi_t)
        loss_t = max(-A_t s_it, -A_t clip(s_it, 1 - gspo_clip_eps, 1 + gspo_clip_eps_high))
    sg = stop-gradient. With one advantage per response and seq_mean_token_mean it equals gspo
    in value and gradient; token advantages (gae, reinforce_pp) each reach their own token."""
    low, high = _gspo_bounds(s)
    r = _ratios(x)
    seq_ratio = torch.exp(_per_response(r.log_ratio, r)).detach()  # sg[s_i], (B,)
    ratio = _on_tokens(seq_ratio, r) * torch.exp(r.log_ratio - r.log_ratio.detach())
    unclipped, clipped = -r.advantages * ratio, -r.advantages * ratio.clamp(low, high)
    per_token = torch.maximum(unclipped, clipped)
    loss = _reduce(per_token, r.mask, x.num_tokens, x.token_weights)
    with torch.no_grad():
        stats = {**r.stats, "clip_frac": masked_mean((clipped > unclipped).float(), r.mask)}
        seq = {"seq_ratio_mean": _row_mean(seq_ratio, r)}
    return PolicyLossOut(loss, stats, seq)


@register_policy_loss("cispo")
def _cispo(x: PolicyLossInputs, s: PolicyLossSettings) -> PolicyLossOut:
    """CISPO (MiniMax 2025, "MiniMax-M1", Sec. 3.1): REINFORCE with a clipped importance
    weight held constant, per token:
        w_t = sg[clip(r_t, 1 - cispo_eps_low, 1 + cispo_eps_high)],  r_t = pi_t / pi_old_t
        loss_t = -w_t A_t log pi_t
    (the paper's token mask M = 1). No lower bound when cispo_eps_low is None, as MiniMax-M1
    runs it. A clipped token keeps its gradient, only its weight is capped."""
    if s.cispo_eps_high <= 0 or (s.cispo_eps_low is not None and not 0 < s.cispo_eps_low < 1):
        raise ValueError(f"cispo bounds must be cispo_eps_high > 0 and 0 < cispo_eps_low < 1 "
                         f"(or None), got {s.cispo_eps_high}, {s.cispo_eps_low}")
    r = _ratios(x)
    ratio = torch.exp(r.log_ratio.detach())
    low = None if s.cispo_eps_low is None else 1.0 - s.cispo_eps_low
    weight = ratio.clamp(min=low, max=1.0 + s.cispo_eps_high)
    per_token = -weight * r.advantages * _zero_outside(x.logprobs, r.mask)
    loss = _reduce(per_token, r.mask, x.num_tokens, x.token_weights)
    with torch.no_grad():
        stats = {**r.stats, "clip_frac": masked_mean((weight != ratio).float(), r.mask)}
    return PolicyLossOut(loss, stats)


@register_policy_loss("gmpo")
def _gmpo(x: PolicyLossInputs, s: PolicyLossSettings) -> PolicyLossOut:
    """GMPO (Zhao et al. 2025, "Geometric-Mean Policy Optimization"): per response i, with
    sgn = sign(A_i) and each token's log-ratio l_t clipped in log space on the side the
    advantage pushes it (PPO's min trick, in logs),
        c_t = sgn * min(sgn * l_t, sgn * clip(l_t, -gmpo_clip_eps, gmpo_clip_eps))
        loss_i = -A_i exp(mean_t c_t)   (the geometric mean of the clipped token ratios)
    A_i the response's advantage (the mean of its tokens'), loss_i on each of its tokens:
    seq_mean_token_mean gives 1/G sum_i loss_i. A clipped token carries no gradient."""
    if s.gmpo_clip_eps <= 0:
        raise ValueError(f"gmpo_clip_eps must be > 0, got {s.gmpo_clip_eps}")
    r = _ratios(x)
    adv = _per_response(r.advantages, r)
    sgn = _on_tokens(torch.sign(adv), r)
    eps = s.gmpo_clip_eps
    clipped = sgn * torch.minimum(sgn * r.log_ratio, sgn * r.log_ratio.clamp(-eps, eps))
    ratio = torch.exp(_per_response(clipped, r))  # (B,)
    loss = _reduce(_on_tokens(-adv * ratio, r), r.mask, x.num_tokens, x.token_weights)
    with torch.no_grad():
        cut = ((clipped != r.log_ratio) & (sgn != 0)).float()  # A = 0: no term to clip
        stats = {**r.stats, "clip_frac": masked_mean(cut, r.mask)}
        seq = {"seq_ratio_mean": _row_mean(ratio, r)}
    return PolicyLossOut(loss, stats, seq)


@register_policy_loss("sapo")
def _sapo(x: PolicyLossInputs, s: PolicyLossSettings) -> PolicyLossOut:
    """SAPO (Gao et al. 2025, Qwen, "Soft Adaptive Policy Optimization"): a soft gate instead
    of the clip, per token:
        f(r) = sigmoid(tau (r - 1)) * 4 / tau,   tau = sapo_tau_pos if A_t > 0 else sapo_tau_neg
        loss_t = -A_t f(r_t)
    The gradient is A_t w_t grad r_t, w_t = 4 sigmoid(tau (r - 1)) (1 - sigmoid(tau (r - 1))):
    1 on-policy (r = 1, PPO's gradient there), fading smoothly as r leaves 1, faster for
    tokens of negative advantage (sapo_tau_neg > sapo_tau_pos). Statistic gate_weight_mean:
    the mean w_t."""
    if s.sapo_tau_pos <= 0 or s.sapo_tau_neg <= 0:
        raise ValueError(f"sapo temperatures must be > 0, got {s.sapo_tau_pos}, "
                         f"{s.sapo_tau_neg}")
    r = _ratios(x)
    ratio = torch.exp(r.log_ratio)
    tau = torch.where(r.advantages > 0, torch.full_like(ratio, s.sapo_tau_pos),
                      torch.full_like(ratio, s.sapo_tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1.0))
    per_token = -r.advantages * gate * (4.0 / tau)
    loss = _reduce(per_token, r.mask, x.num_tokens, x.token_weights)
    with torch.no_grad():
        g = gate.detach()
        stats = {**r.stats, "gate_weight_mean": masked_mean(4.0 * g * (1.0 - g), r.mask)}
    return PolicyLossOut(loss, stats)
