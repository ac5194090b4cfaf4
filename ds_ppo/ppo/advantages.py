"""Stage 3: KL-shaped per-token rewards and the advantages of ppo.advantage_estimator, on an
Experience that scoring filled."""
from __future__ import annotations

from dataclasses import dataclass, replace

from ds_ppo.algo import group_score_stats, kl_estimate, shape_rewards
from ds_ppo.algo.estimators import AdvantageInputs, advantages_for
from ds_ppo.config import Config
from ds_ppo.containers import Experience
from ds_ppo.engine import dist


@dataclass(frozen=True)
class AdvantageSettings:
    """Everything stage 3 reads: the config's keys and the live KL coefficient (the KL
    controller's value this iteration; `ppo.kl_coef` is only its starting value)."""

    kl_coef: float
    kl_estimator: str
    kl_clip: float | None
    kl_in_reward: bool
    score_clip: float | None
    estimator: str
    group_size: int
    gamma: float
    lam: float
    whiten: bool
    whiten_across_ranks: bool
    filter_zero_std_groups: bool
    zero_std_advantage: float
    # on-policy distillation (the distill section)
    distill_discount: float = 0.0
    distill_reward_coef: float = 0.0
    distill_reward_estimator: str = "grpo"


def advantage_settings(cfg: Config, kl_coef: float) -> AdvantageSettings:
    """Stage 3's settings from the config, with the controller's current `kl_coef`."""
    p = cfg.ppo
    return AdvantageSettings(kl_coef, p.kl_estimator, p.kl_clip, p.kl_in_reward,
                             cfg.reward.score_clip,
                             p.advantage_estimator, p.samples_per_prompt, p.gamma, p.lam,
                             p.whiten_advantages, p.whiten_across_ranks, p.filter_zero_std_groups,
                             p.zero_std_advantage, cfg.distill.discount, cfg.distill.reward_coef,
                             cfg.distill.reward_estimator)


def add_advantages(exp: Experience, s: AdvantageSettings) -> Experience:
    """KL-shaped per-token rewards (score at the last valid token; the KL term only with
    ppo.kl_in_reward; an episode's turn rewards at each turn's last model token), then the advantages of ppo.advantage_estimator (`algo/estimators.py`:
    gae whitened if ppo.whiten_advantages; grpo, dr_grpo, rloo a group baseline on every token
    of the response, never whitened; reinforce_pp discounted returns whitened over the global
    batch; distill the teacher's minus the student's log-prob of each sampled token, plus
    distill.reward_coef x a group advantage of the reward). Critic-free estimators set returns =
    None (no value target)."""
    mask = exp.mask
    kl = kl_estimate(exp.old_logprobs, exp.ref_logprobs, s.kl_estimator,
                     s.kl_clip).masked_fill(~mask, 0.0)
    rewards = shape_rewards(exp.scores, kl, mask, s.kl_coef if s.kl_in_reward else 0.0,
                            score_clip=s.score_clip)
    if exp.rollout.turn_rewards is not None:  # an episode: each turn's reward at its last token
        rewards = rewards + exp.rollout.turn_rewards.masked_fill(~mask, 0.0)
    advantages, returns = advantages_for(s.estimator, AdvantageInputs(
        rewards, mask, exp.old_values, group_size=s.group_size, gamma=s.gamma, lam=s.lam,
        whiten=s.whiten, whiten_across_ranks=s.whiten_across_ranks, group=dist.dp_group(),
        zero_std_advantage=s.zero_std_advantage, teacher_logprobs=exp.teacher_logprobs,
        logprobs=exp.old_logprobs, discount=s.distill_discount,
        reward_coef=s.distill_reward_coef, reward_estimator=s.distill_reward_estimator))
    train_rows = None
    if s.filter_zero_std_groups:
        _, constant = group_score_stats(exp.episode_scores, s.group_size)
        train_rows = (~constant).repeat_interleave(s.group_size).tolist()
    return replace(exp, rewards=rewards, kl=kl, advantages=advantages, returns=returns,
                   train_rows=train_rows)
