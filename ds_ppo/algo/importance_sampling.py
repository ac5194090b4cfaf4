"""Rollout correction: the gap between the distribution responses were sampled from (the
generation replica: another kernel, another dtype, another batch shape) and the one the
trainer computes for the same tokens, measured and corrected by importance sampling.

Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training"
(https://fengyao.notion.site/off-policy-rl): the PPO ratio pi_theta / pi_old uses the
trainer's pi_old, but the tokens come from pi_rollout != pi_old, so the update is off-policy.
Their truncated importance sampling (TIS) multiplies each token's policy loss by
w = min(pi_old / pi_rollout, C) (detached); masked importance sampling (MIS, the follow-up
"When Speed Kills Stability", Liu et al. 2025) instead drops the tokens whose ratio leaves
[1/C, C] from the loss and weights the rest by the ratio.

Shapes: (B, T) over response tokens (B = sequences, T = response tokens), `mask` True on
tokens that count. Imports only torch.
"""
import torch

from .choices import ROLLOUT_CORRECTIONS, RolloutCorrection
from .kl import LOG_RATIO_CLAMP, kl_estimate


def rollout_is_weights(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
                       mask: torch.Tensor, mode: RolloutCorrection, cap: float
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token importance weights of the policy loss, the tokens it keeps and the tokens the
    cap acted on.

    ratio = exp(old_logprobs - rollout_logprobs) = pi_old / pi_rollout (log-ratio clamped to
    +-LOG_RATIO_CLAMP first), then
      tis: weight = min(ratio, cap), every token kept (Yao et al. 2025, TIS);
      mis: weight = ratio where 1/cap <= ratio <= cap, else the token is dropped (weight 0,
           not kept: it leaves the loss and its normaliser; Liu et al. 2025, MIS);
      none: weight 1, every token kept.

    Args:
        old_logprobs: (B, T) float, the trainer's log-probs of the sampled tokens (nats).
        rollout_logprobs: (B, T) float, their log-probs where they were sampled (nats).
        mask: (B, T) bool, tokens that count.
        mode: "none", "tis" or "mis".
        cap: C > 1 (tis: the truncation; mis: the band [1/C, C]).

    Returns:
        (weights (B, T) float32, detached, 0 outside the kept tokens;
         kept (B, T) bool, mask minus the tokens mis drops;
         cut (B, T) bool, counted tokens whose ratio the cap truncated (tis) or dropped (mis)).
    """
    if mode not in ROLLOUT_CORRECTIONS:
        raise ValueError(f"unknown rollout correction {mode!r}; valid: "
                         f"{', '.join(ROLLOUT_CORRECTIONS)}")
    if cap <= 1:
        raise ValueError(f"cap must be > 1, got {cap}")
    mask = mask.bool()
    with torch.no_grad():
        log_ratio = (old_logprobs.float() - rollout_logprobs.float()).masked_fill(~mask, 0.0)
        ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
        if mode == "none":
            kept, weights, cut = mask, torch.ones_like(ratio), torch.zeros_like(mask)
        elif mode == "tis":
            kept, weights, cut = mask, ratio.clamp(max=cap), mask & (ratio > cap)
        else:
            kept = mask & (ratio >= 1.0 / cap) & (ratio <= cap)
            weights, cut = ratio, mask & ~kept
        return weights.masked_fill(~kept, 0.0), kept, cut


def rollout_mismatch(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
                     mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """How far the trainer's log-probs are from the sampler's, per token: (B, T) float32
    |old_logprobs - rollout_logprobs| and (B, T) float32 the k3 estimate (Schulman 2020) of
    KL(pi_rollout || pi_old), the tokens being samples of pi_rollout; both 0 outside `mask`
    (reduce them with the mask, per rank or across ranks)."""
    mask = mask.bool()
    with torch.no_grad():
        diff = (old_logprobs.float() - rollout_logprobs.float()).abs()
        kl = kl_estimate(rollout_logprobs.float(), old_logprobs.float(), "k3")
        return diff.masked_fill(~mask, 0.0), kl.masked_fill(~mask, 0.0)
