"""The advantage estimators, one registered function each (the registry reads
`algo/choices.ESTIMATORS` for everything but the math).

Each function takes the KL-shaped per-token rewards of a batch and returns
``(advantages, returns)``: (B, T) advantages, and (B, T) value targets or None for a critic-free
estimator. Whitening over ranks is an all-reduce (``masked_whiten(distributed=True)``); group
baselines are per-rank (a prompt's group never spans ranks).

Imports only torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .choices import ESTIMATORS
from .distill import distill_advantages
from .group import (broadcast_to_tokens, discounted_returns, group_advantages,
                    group_score_stats)
from .returns import gae
from .stats import masked_sum, masked_whiten


@dataclass(frozen=True)
class AdvantageInputs:
    """What an estimator may read. B = sequences, T = response tokens."""

    rewards: torch.Tensor  # (B, T) KL-shaped per-token rewards, 0 outside the mask
    mask: torch.Tensor  # (B, T) bool, True on response tokens that count
    values: torch.Tensor | None  # (B, T) the value model's old values (critic estimators)
    group_size: int = 1  # ppo.samples_per_prompt: a group's rows sit next to each other
    gamma: float = 1.0
    lam: float = 0.95
    whiten: bool = True  # ppo.whiten_advantages (gae)
    whiten_across_ranks: bool = True  # whitening statistics over all ranks' tokens
    # the data-parallel process group of those statistics (None: the world); with sequence
    # parallelism the ranks of a group hold the same rows, counted once
    group: object = None
    # ppo.zero_std_advantage (group estimators): the weight of the batch baseline that a group
    # whose scores are all equal gets instead of its own (0: none, the published estimators)
    zero_std_advantage: float = 0.0
    # on-policy distillation (distill): (B, T) the teacher's and the student's (the sampling
    # distribution's) log-probs of the sampled tokens; distill.discount; distill.reward_coef
    # and distill.reward_estimator (the group method of the reward's advantage)
    teacher_logprobs: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    discount: float = 0.0
    reward_coef: float = 0.0
    reward_estimator: str = "grpo"


Estimate = Callable[[AdvantageInputs], "tuple[torch.Tensor, torch.Tensor | None]"]
_FUNCTIONS: dict[str, Estimate] = {}


def register_estimator(name: str) -> Callable[[Estimate], Estimate]:
    """Decorator: `fn` computes the advantages of the table row `name` (algo/choices.py)."""
    if name not in ESTIMATORS:
        raise ValueError(f"{name!r} has no row in algo/choices.ESTIMATORS")

    def add(fn: Estimate) -> Estimate:
        _FUNCTIONS[name] = fn
        return fn
    return add


def advantages_for(name: str, x: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(advantages, returns) of estimator `name`; returns is None when it has no critic."""
    if name not in _FUNCTIONS:
        raise ValueError(f"unknown advantage estimator {name!r}; valid: {', '.join(_FUNCTIONS)}")
    return _FUNCTIONS[name](x)


def registered() -> tuple[str, ...]:
    return tuple(_FUNCTIONS)


@register_estimator("gae")
def _gae(x: AdvantageInputs):
    # GAE with the value model (Schulman et al. 2016); whitened over the valid tokens
    advantages, returns = gae(x.rewards, x.values, x.mask, x.gamma, x.lam)
    if x.whiten:
        advantages = masked_whiten(advantages, x.mask, shift_mean=True,
                                   distributed=x.whiten_across_ranks, group=x.group)
    return advantages, returns


@register_estimator("reinforce_pp")
def _reinforce_pp(x: AdvantageInputs):
    # Hu 2025: global-batch normalisation of the returns (all ranks) is the estimator itself
    return masked_whiten(discounted_returns(x.rewards, x.mask, x.gamma), x.mask,
                         shift_mean=True, distributed=True, group=x.group), None


def _group(method: str) -> Estimate:
    def estimate(x: AdvantageInputs):
        # a sequence-level baseline over the group's summed rewards, on every token of the row
        seq_rewards = masked_sum(x.rewards, x.mask, dim=-1)
        adv = group_advantages(seq_rewards, x.group_size, method)
        if x.zero_std_advantage > 0:
            adv = with_batch_baseline(adv, seq_rewards, x.group_size, x.zero_std_advantage,
                                      x.group)
        return broadcast_to_tokens(adv, x.mask), None
    estimate.__name__ = f"_{method}"
    return estimate


def with_batch_baseline(adv: torch.Tensor, seq_rewards: torch.Tensor, group_size: int,
                        weight: float, group: object = None) -> torch.Tensor:
    """(B,) group advantages where each row of a group whose scores are all equal (advantage 0:
    its own baseline is its score) gets weight x its score whitened over the batch of every rank
    (the batch's mean as the baseline, Williams 1992, divided by the batch's std). An answer the
    policy always gives and is always wrong with is pushed down, its probability going to the
    other answers, the right one among them; one it always gets right is kept up."""
    _, constant = group_score_stats(seq_rewards, group_size)
    rows = constant.repeat_interleave(group_size)
    ones = torch.ones_like(seq_rewards, dtype=torch.bool).unsqueeze(-1)
    batch = masked_whiten(seq_rewards.unsqueeze(-1), ones, shift_mean=True, distributed=True,
                          group=group).squeeze(-1)
    return torch.where(rows, weight * batch, adv)


for _method in ("grpo", "dr_grpo", "rloo"):  # group.group_advantages holds the three formulas
    register_estimator(_method)(_group(_method))


@register_estimator("distill")
def _distill(x: AdvantageInputs):
    # on-policy distillation (algo/distill.py): A_t = the discounted sum of teacher - student
    # log-probs from t on, plus reward_coef x the group advantage of the response's reward on
    # every token ("distil, then RL" in one run); never whitened
    if x.teacher_logprobs is None or x.logprobs is None:
        raise ValueError("the distill estimator needs the teacher's and the student's log-probs")
    adv = distill_advantages(x.teacher_logprobs, x.logprobs, x.mask, x.discount)
    if x.reward_coef:
        seq_rewards = masked_sum(x.rewards, x.mask, dim=-1)
        group = group_advantages(seq_rewards, x.group_size, x.reward_estimator)
        adv = adv + x.reward_coef * broadcast_to_tokens(group, x.mask).to(adv.dtype)
    return adv, None
