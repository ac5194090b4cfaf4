"""How per-token losses become one loss: ``ppo.loss_aggregation``, and the KL loss term.

Every mode is a weighted SUM over the global mini-batch divided by one global count, so the
gradient accumulated over micro-batches and data-parallel ranks equals the gradient on the whole
mini-batch at once, whatever the split:

- ``token_mean``: loss = sum_{b,t} l_bt / N_tokens (weights 1; divisor: the mini-batch's valid
  tokens). Long responses weigh more (PPO as usually implemented).
- ``seq_mean_token_mean``: loss = sum_b (sum_t l_bt / |o_b|) / N_seqs (weights 1 / |o_b|; divisor:
  the mini-batch's sequences). GRPO's original form (Shao et al. 2024, Eq. 3).
- ``seq_mean_token_sum_norm``: loss = sum_b (sum_t l_bt / L_max) / N_seqs (weights 1 / L_max,
  L_max = generation.max_new_tokens). Dr. GRPO's (Liu et al. 2025, Sec. 3.2): no length bias.

The KL loss term and the entropy bonus are aggregated the same way, with the policy loss's weights
and divisor.

Shapes: (B, T) response tokens, ``mask`` True on tokens that count. Imports only torch.
"""

import torch

from .choices import LOSS_AGGREGATIONS, KLEstimator, LossAggregation
from .kl import kl_estimate
from .stats import masked_sum



def loss_token_weights(mask: torch.Tensor, mode: LossAggregation,
                       max_new_tokens: int | None = None) -> torch.Tensor:
    """(B, T) float32 weight of each token's loss in the weighted sum (0 outside the mask).

    Args:
        mask: (B, T) bool/0-1.
        mode: see the module docstring.
        max_new_tokens: L_max, needed by ``seq_mean_token_sum_norm``.
    """
    if mode not in LOSS_AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {mode!r}; valid: {', '.join(LOSS_AGGREGATIONS)}")
    m = mask.bool().float()
    if mode == "token_mean":
        return m
    if mode == "seq_mean_token_mean":
        return m / m.sum(dim=-1, keepdim=True).clamp(min=1.0)
    if not max_new_tokens or max_new_tokens <= 0:
        raise ValueError("seq_mean_token_sum_norm needs max_new_tokens > 0")
    return m / float(max_new_tokens)


def loss_divisor(lengths: list[int], mode: LossAggregation) -> float:
    """This rank's share of the divisor from its rows' valid-token counts (host values): the
    token count for ``token_mean``, the row count otherwise. Sum it over the rows of the global
    mini-batch (all micro-batches, all ranks)."""
    if mode not in LOSS_AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {mode!r}; valid: {', '.join(LOSS_AGGREGATIONS)}")
    return float(sum(lengths)) if mode == "token_mean" else float(len(lengths))


def kl_loss(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor,
            estimator: KLEstimator, divisor: float,
            token_weights: torch.Tensor | None = None, clip: float | None = None
            ) -> torch.Tensor:
    """KL(policy || reference) as a loss term (GRPO, Shao et al. 2024, Eq. 3-4, with the k3
    estimator), aggregated like the policy loss: sum(w * kl) / divisor.

    Args:
        logprobs: (B, T) current policy log-probs, with grad.
        ref_logprobs: (B, T) reference log-probs.
        mask: (B, T) bool/0-1; inputs outside it never reach the result or the gradient.
        estimator: "k1", "k2" or "k3" (``kl_estimate``).
        divisor: > 0, the global mini-batch's count (``loss_divisor`` summed over ranks).
        token_weights: (B, T) from ``loss_token_weights``; None = 1 on every valid token.
        clip: cap on each token's KL, +-clip nats (ppo.kl_clip; a capped token has no
            gradient); None = uncapped.

    Returns:
        0-dim loss tensor.
    """
    if divisor <= 0:
        raise ValueError(f"divisor must be > 0, got {divisor}")
    mask = mask.bool()
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    kl = kl_estimate(torch.where(mask, logprobs, zero), torch.where(mask, ref_logprobs, zero),
                     estimator, clip)
    if token_weights is not None:
        kl = kl * token_weights
    return masked_sum(kl, mask) / divisor


def entropy_bonus(entropy: torch.Tensor, mask: torch.Tensor, divisor: float,
                  token_weights: torch.Tensor | None = None,
                  floor: float | None = None) -> torch.Tensor:
    """The policy's entropy aggregated like the policy loss, sum(w * H) / divisor: the term that
    ppo.entropy_coef subtracts from the loss (the entropy bonus of PPO's Eq. 9, Schulman et al.
    2017; verl's ``entropy_coeff``), so that minimising the loss keeps the policy stochastic.

    With ``floor`` (ppo.entropy_target_scope=token) each token's entropy is weighted by
    clip(1 - H_t / floor, 0, 1), the weight held constant (detached): sum(w * f_t * H) / divisor.
    A token whose distribution has collapsed (H_t near 0) gets the whole bonus, one at or above
    the floor none, whatever the other tokens' entropy: a mean over the response can stay high
    on random filler tokens while the one token that decides the reward has collapsed.

    Args:
        entropy: (B, T) entropy of the policy at each response position (nats), with grad.
        mask: (B, T) bool/0-1; entries outside it never reach the result or the gradient.
        divisor: > 0, the global mini-batch's count (``loss_divisor`` summed over ranks).
        token_weights: (B, T) from ``loss_token_weights``; None = 1 on every valid token.
        floor: > 0 nats per token, or None (every token weighted 1).

    Returns:
        0-dim tensor (nats; larger = more random), differentiable w.r.t. entropy.
    """
    if divisor <= 0:
        raise ValueError(f"divisor must be > 0, got {divisor}")
    if floor is not None and floor <= 0:
        raise ValueError(f"floor must be > 0 (nats per token), got {floor}")
    mask = mask.bool()
    entropy = torch.where(mask, entropy, torch.zeros((), dtype=entropy.dtype,
                                                     device=entropy.device))
    if floor is not None:
        entropy = entropy * (1.0 - entropy.detach() / floor).clamp(0.0, 1.0)
    if token_weights is not None:
        entropy = entropy * token_weights
    return masked_sum(entropy, mask) / divisor
