"""Losses of the supervised jobs: the policy's supervised fine-tuning (SFT) and the reward model's
preference loss. Sums, not means: the caller divides by one count of the whole global batch (all
micro-batches, all ranks), so a step's gradient does not depend on the world size or the
micro-batch split (as the PPO update does, ds_ppo/ppo/update.py).

Shapes: n = counted (completion) tokens, P = preference pairs. Imports only torch.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def nll_sum(logprobs: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood summed over the counted tokens: () float32 from (n,) log-probs of
    the tokens the loss covers (completion / assistant tokens, their EOS)."""
    return -logprobs.float().sum()


def bradley_terry(chosen: torch.Tensor, rejected: torch.Tensor,
                  margin: torch.Tensor | None = None) -> torch.Tensor:
    """(P,) float32 pairwise loss -log sigmoid(r_chosen - r_rejected - margin) (Bradley & Terry
    1952, as in Ouyang et al. 2022; the margin term as in Touvron et al. 2023, Llama 2).
    chosen, rejected: (P,) scalar rewards; margin: (P,) or None (0)."""
    diff = chosen.float() - rejected.float()
    if margin is not None:
        diff = diff - margin.float()
    return -F.logsigmoid(diff)


def reward_centering(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """(P,) float32 (r_chosen + r_rejected)^2: the auxiliary loss that keeps a reward model's
    scores centred on 0 for every prompt (Eisenstein et al. 2023, "Helping or herding?"; TRL's
    center_rewards_coefficient). Bradley-Terry fixes only differences, so a prompt-dependent
    offset is free; PPO then sees it as reward noise the critic has to learn away."""
    return (chosen.float() + rejected.float()).square()


def pair_stats(chosen: torch.Tensor, rejected: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-pair statistics, summed: `correct` (pairs whose chosen answer scores higher), `ties`
    (pairs scored exactly equal: neither right nor wrong) and `margin` (sum of r_chosen -
    r_rejected); () float64 each, for a global mean by pair count."""
    diff = (chosen.float() - rejected.float()).detach().double()
    return {"correct": (diff > 0).double().sum(), "ties": (diff == 0).double().sum(),
            "margin": diff.sum()}
