"""Per-token rewards from sequence scores and a KL penalty.

Imports only torch.
"""

import torch

from .masks import last_valid_index


def shape_rewards(
    scores: torch.Tensor,
    kl: torch.Tensor,
    mask: torch.Tensor,
    kl_coef: float = 0.1,
    score_clip: float | None = None,
) -> torch.Tensor:
    """Token-level rewards: a KL penalty on every valid token, the score on the last.

        rewards[b, t] = -kl_coef * kl[b, t]                 for valid t
        rewards[b, last_b] += clip(scores[b], -score_clip, +score_clip)
        rewards[b, t] = 0                                   outside the mask

    where kl is the per-token KL estimate (``kl_estimate(logprobs, ref_logprobs, estimator)``,
    computed once by the caller, which also reports it) and last_b is the last valid token of
    row b (its EOS, or position T-1 only if the row fills T).
    This is the per-token KL-penalised reward of Ziegler et al. 2019 (Eq. 2) /
    Stiennon et al. 2020, with the sequence-level reward model score given at the end.
    A row whose mask is empty has no token to carry its score: the score is dropped
    and the row is all 0. Per-row; no reduction.

    Args:
        scores: (B,) float, reward model score per sequence.
        kl: (B, T) float, per-token KL(policy || reference) estimate in nats (``kl_estimate``
            of the rollout-time policy log-probs and the reference log-probs).
        mask: (B, T) bool/0-1, True on response tokens that count.
        kl_coef: KL penalty coefficient (e.g. ``controller.value``), >= 0.
        score_clip: clip scores to [-score_clip, score_clip] before adding; None = no clip.

    Returns:
        (B, T) rewards in kl's dtype. Values at masked positions of the inputs
        never influence the result.
    """
    mask = mask.bool()
    if scores.shape != mask.shape[:1]:
        raise ValueError(f"scores must have shape (B,) = {tuple(mask.shape[:1])}, got {tuple(scores.shape)}")
    if score_clip is not None:
        if score_clip <= 0:
            raise ValueError(f"score_clip must be > 0 or None, got {score_clip}")
        scores = scores.clamp(-score_clip, score_clip)
    zero = torch.zeros((), dtype=kl.dtype, device=kl.device)
    rewards = torch.where(mask, -kl_coef * kl, zero)
    # One-hot of the last valid position; empty rows have index -1 and match nothing.
    last = last_valid_index(mask)
    positions = torch.arange(mask.shape[-1], device=mask.device)
    at_last = positions.unsqueeze(0) == last.unsqueeze(-1)
    return rewards + torch.where(at_last, scores.to(rewards.dtype).unsqueeze(-1), zero)
