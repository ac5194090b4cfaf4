"""PPO clipped policy loss and clipped value loss.

Shapes: every tensor argument is (B, T) over response tokens (B = sequences,
T = response tokens); ``mask`` True on tokens that count. Inputs at masked positions
are replaced by 0 before any arithmetic, so they change neither the loss nor the
gradients, and the gradient at masked positions is exactly 0.

Normalisation (both losses):
  * num_tokens=None: token mean over this micro-batch's valid tokens (per-rank).
  * num_tokens=N: masked SUM / N. Pass the number of valid tokens in the whole
    mini-batch (all micro-batches on all data-parallel ranks) so that accumulating
    the micro-batch gradients gives the gradient of one token mean over the
    mini-batch, however unevenly tokens fall across micro-batches. This function
    divides by N only: if the engine also scales (DeepSpeed's ``engine.backward``
    divides by gradient_accumulation_steps, and the gradient all-reduce averages over
    the world size), pass N = global_tokens / (gradient_accumulation_steps * world_size)
    to cancel it.

Stats are detached 0-dim tensors (no host sync; call ``.item()`` when logging), each
a masked mean over this rank's micro-batch only (per-rank, per-micro-batch).

Imports only torch.
"""

import torch

from .kl import LOG_RATIO_CLAMP, log_ratio_clamped
from .stats import masked_mean, masked_sum


def _zero_outside(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))


def _reduce(per_token: torch.Tensor, mask: torch.Tensor, num_tokens: float | None,
            token_weights: torch.Tensor | None = None) -> torch.Tensor:
    if token_weights is not None:  # ppo.loss_aggregation (ds_ppo.algo.aggregation)
        per_token = per_token * token_weights
    if num_tokens is None:
        return masked_mean(per_token, mask)
    if num_tokens <= 0:
        raise ValueError(f"num_tokens must be > 0 (valid tokens in the mini-batch), got {num_tokens}")
    return masked_sum(per_token, mask) / num_tokens


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float = 0.2,
    num_tokens: float | None = None,
    clip_eps_high: float | None = None,
    dual_clip: float | None = None,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate (Schulman et al. 2017, "Proximal Policy Optimization
    Algorithms", Eq. 7), negated to be minimised, per token:

        r = exp(clamp(logprobs - old_logprobs, -20, 20))   (LOG_RATIO_CLAMP, see kl.py)
        loss_t = max(-A_t * r, -A_t * clip(r, 1 - clip_eps, 1 + clip_eps_high))
        loss_t = min(loss_t, -A_t * dual_clip)      where A_t < 0, with dual_clip

    clip_eps_high is DAPO's asymmetric "clip-higher" (Yu et al. 2025, Sec. 3.1; None = clip_eps):
    a larger upper bound lets unlikely tokens with positive advantage gain more. dual_clip > 1
    is the dual clip of Ye et al. 2020 ("Mastering Complex Control in MOBA Games with Deep RL",
    Eq. 5): for a negative advantage the loss is capped at -A_t * dual_clip, so a huge ratio on
    a bad token cannot blow the step up.

    Args:
        logprobs: (B, T) float, current policy log-probs of the sampled tokens (nats), with grad.
        old_logprobs: (B, T) float, log-probs at rollout time (nats).
        advantages: (B, T) float, e.g. whitened GAE advantages.
        mask: (B, T) bool/0-1.
        clip_eps: ratio clip range, > 0.
        num_tokens: None for the token mean of this micro-batch, else the divisor of
            the masked sum (see module docstring).
        clip_eps_high: upper ratio clip 1 + clip_eps_high (> 0); None = clip_eps.
        dual_clip: the dual-clip constant c > 1; None = off.
        token_weights: (B, T) weight of each token's loss in the masked sum
            (``ds_ppo.algo.aggregation.loss_token_weights``); None = 1.

    Returns:
        (loss, stats): loss a 0-dim tensor; stats (detached, per-rank micro-batch masked means):
          "clip_frac": fraction of tokens where the clipped term is the larger one
              (their gradient is cut), as in TRL's ``pg_clipfrac``;
          "approx_kl": (r - 1) - log r, the k3 estimate of KL(old || new) (Schulman 2020);
          "ratio_mean": mean of r;
          "ratio_clamped_frac": fraction of tokens whose log-ratio was clamped (there the
              ratio, and so the loss, is finite but carries no gradient).
    """
    if clip_eps <= 0:
        raise ValueError(f"clip_eps must be > 0, got {clip_eps}")
    if clip_eps_high is not None and clip_eps_high <= 0:
        raise ValueError(f"clip_eps_high must be > 0 or None, got {clip_eps_high}")
    if dual_clip is not None and dual_clip <= 1:
        raise ValueError(f"dual_clip must be > 1 or None, got {dual_clip}")
    mask = mask.bool()
    # 0 log-ratio (r = 1) and 0 advantage outside the mask: no loss, no gradient there.
    raw_log_ratio = _zero_outside(logprobs - old_logprobs, mask)
    # bounded before exp: an e^100 ratio would make the loss and its gradient inf
    log_ratio = raw_log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    advantages = _zero_outside(advantages, mask)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    high = clip_eps if clip_eps_high is None else clip_eps_high
    clipped = -advantages * ratio.clamp(1.0 - clip_eps, 1.0 + high)
    per_token = torch.maximum(unclipped, clipped)
    if dual_clip is not None:
        per_token = torch.where(advantages < 0, torch.minimum(per_token, -advantages * dual_clip),
                                per_token)
    loss = _reduce(per_token, mask, num_tokens, token_weights)
    with torch.no_grad():
        stats = {
            "clip_frac": masked_mean((clipped > unclipped).float(), mask),
            "approx_kl": masked_mean(torch.expm1(log_ratio) - log_ratio, mask),
            "ratio_mean": masked_mean(ratio, mask),
            "ratio_clamped_frac": masked_mean(log_ratio_clamped(raw_log_ratio).float(), mask),
        }
    return loss, stats


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float | None = 0.2,
    num_tokens: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss (PPO2 of OpenAI baselines, ``ppo2/model.py``), per token:

        v_clip = old_values + clip(values - old_values, -clip_eps, clip_eps)
        loss_t = 0.5 * max((values - returns)^2, (v_clip - returns)^2)

    clip_eps=None gives the unclipped 0.5 * (values - returns)^2. clip_eps is in the
    units of the values (reward units), not a ratio.

    Args:
        values: (B, T) float, current critic values, with grad.
        old_values: (B, T) float, critic values at rollout time.
        returns: (B, T) float, value targets (GAE returns).
        mask: (B, T) bool/0-1.
        clip_eps: value clip range (> 0) or None.
        num_tokens: None for the token mean of this micro-batch, else the divisor of
            the masked sum (see module docstring).

    Returns:
        (loss, stats): loss a 0-dim tensor; stats (detached, per-rank micro-batch masked means):
          "vf_clip_frac": fraction of tokens where the clipped term is the larger one;
          "values_mean": mean of values.
    """
    if clip_eps is not None and clip_eps <= 0:
        raise ValueError(f"clip_eps must be > 0 or None, got {clip_eps}")
    mask = mask.bool()
    # Zero inputs before squaring so garbage outside the mask cannot produce NaN grads.
    values = _zero_outside(values, mask)
    old_values = _zero_outside(old_values, mask)
    returns = _zero_outside(returns, mask)
    unclipped = (values - returns).square()
    if clip_eps is None:
        per_token = unclipped
        clip_frac = torch.zeros((), device=values.device)
    else:
        values_clipped = old_values + (values - old_values).clamp(-clip_eps, clip_eps)
        clipped = (values_clipped - returns).square()
        per_token = torch.maximum(unclipped, clipped)
        with torch.no_grad():
            clip_frac = masked_mean((clipped > unclipped).float(), mask)
    loss = 0.5 * _reduce(per_token, mask, num_tokens)
    with torch.no_grad():
        stats = {"vf_clip_frac": clip_frac, "values_mean": masked_mean(values, mask)}
    return loss, stats


def lm_loss(logprobs: torch.Tensor, mask: torch.Tensor,
            num_tokens: float | None = None) -> torch.Tensor:
    """Language-modelling loss of PPO-ptx (Ouyang et al. 2022, "Training language models to
    follow instructions with human feedback", eq. 2: the objective adds
    gamma x E_{x ~ D_pretrain}[log pi(x)]), negated to be minimised: the negative log-likelihood
    of the masked tokens, -sum(logprobs) / num_tokens (`_reduce`'s normalisation: None = this
    micro-batch's token mean; the global mini-batch's ptx token count makes accumulated
    micro-batch gradients one token mean over all ranks). `logprobs` (B, T) of the target
    tokens at temperature 1."""
    return _reduce(-_zero_outside(logprobs, mask), mask, num_tokens)
