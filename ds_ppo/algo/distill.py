"""On-policy distillation: a dense per-token signal from a teacher on the student's own samples.

The student samples a response; the teacher scores each sampled token. The per-token reward is
the sampled estimate of the negative reverse KL, r_t = log pi_teacher(y_t | y_<t) -
log pi_student(y_t | y_<t) (Agarwal et al. 2024, "On-Policy Distillation of Language Models:
Learning from Self-Generated Mistakes" (GKD), with the reverse KL as its divergence; Lu and
Thinking Machines Lab 2025, "On-Policy Distillation", which takes it as the advantage of each
token with discount 0). Its expectation over the student's samples is -KL(pi_student ||
pi_teacher) per token, so maximising it with a policy gradient minimises the reverse KL.

pi_student is the distribution the token was sampled from (the shaped one: temperature,
blocked tokens, top-k, top-p; `algo/distribution.py`), which is what the policy's scoring
log-probs are of.

Imports only torch. Every reduction here is per-rank.
"""
from __future__ import annotations

import torch

from .group import discounted_returns


def distill_rewards(teacher_logprobs: torch.Tensor, logprobs: torch.Tensor,
                    mask: torch.Tensor) -> torch.Tensor:
    """(B, T) per-token distillation reward r_t = teacher log-prob - student log-prob of the
    sampled token (nats; the negative sampled reverse KL), 0 outside the mask.

    Args:
        teacher_logprobs: (B, T) float, log pi_teacher of each sampled response token.
        logprobs: (B, T) float, log pi_student of the same tokens (the sampling distribution).
        mask: (B, T) bool, True on the model's tokens that count (an episode's observations are
            holes: not the model's, not distilled).
    """
    mask = mask.bool()
    r = teacher_logprobs - logprobs
    return torch.where(mask, r, torch.zeros((), dtype=r.dtype, device=r.device))


def distill_advantages(teacher_logprobs: torch.Tensor, logprobs: torch.Tensor,
                       mask: torch.Tensor, discount: float = 0.0) -> torch.Tensor:
    """(B, T) distillation advantages: A_t = sum_{j >= t} discount^(j - t) r_j over the row's
    counted tokens, r = `distill_rewards`. discount 0 (the default, Lu 2025): A_t = r_t, each
    token pushed toward the teacher on its own; discount 1: the reverse KL of the rest of the
    response (GKD's sequence-level objective). An episode's observations take no step
    (`discounted_returns`). 0 outside the mask."""
    r = distill_rewards(teacher_logprobs, logprobs, mask)
    if discount == 0.0:
        return r
    return discounted_returns(r, mask, discount)

