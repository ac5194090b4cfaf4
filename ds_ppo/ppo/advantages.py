"""Stage 3: KL-shaped per-token rewards and the advantages of ppo.advantage_estimator, on an
Experience that scoring filled."""
from __future__ import annotations

from dataclasses import replace

from ds_ppo.algo import (broadcast_to_tokens, discounted_returns, gae, group_advantages,
                         group_score_stats, kl_estimate, masked_sum, masked_whiten, shape_rewards)
from ds_ppo.config import Config
from ds_ppo.containers import Experience


def add_advantages(exp: Experience, cfg: Config, kl_coef: float) -> Experience:
    """KL-shaped per-token rewards (score at the last valid token; the KL term only with
    ppo.kl_in_reward; an episode's turn rewards at each turn's last model token), then the
    advantages of ppo.advantage_estimator:

    - gae: GAE with the value model, whitened (over all ranks' valid tokens when
      ppo.whiten_across_ranks) if ppo.whiten_advantages;
    - grpo, dr_grpo, rloo: each response's summed reward against its group's
      (`group_advantages`), on every token of the response; never whitened;
    - reinforce_pp: discounted returns of the rewards, whitened over the global batch.
    Critic-free estimators set returns = None (no value target)."""
    p = cfg.ppo
    mask = exp.mask
    kl = kl_estimate(exp.old_logprobs, exp.ref_logprobs, p.kl_estimator).masked_fill(~mask, 0.0)
    rewards = shape_rewards(exp.scores, kl, mask, kl_coef if p.kl_in_reward else 0.0,
                            score_clip=cfg.reward.score_clip)
    if exp.rollout.turn_rewards is not None:  # an episode: each turn's reward at its last token
        rewards = rewards + exp.rollout.turn_rewards.masked_fill(~mask, 0.0)
    returns, train_rows = None, None
    if p.advantage_estimator == "gae":
        advantages, returns = gae(rewards, exp.old_values, mask, p.gamma, p.lam)
        if p.whiten_advantages:
            advantages = masked_whiten(advantages, mask, shift_mean=True,
                                       distributed=p.whiten_across_ranks)
    elif p.advantage_estimator == "reinforce_pp":
        # Hu 2025: global-batch normalisation of the returns (all ranks), the estimator itself
        advantages = masked_whiten(discounted_returns(rewards, mask, p.gamma), mask,
                                   shift_mean=True, distributed=True)
    else:  # a sequence-level group baseline; the group's rows sit next to each other
        seq_rewards = masked_sum(rewards, mask, dim=-1)
        advantages = broadcast_to_tokens(
            group_advantages(seq_rewards, p.samples_per_prompt, p.advantage_estimator), mask)
    if p.filter_zero_std_groups:
        _, constant = group_score_stats(exp.episode_scores, p.samples_per_prompt)
        train_rows = (~constant).repeat_interleave(p.samples_per_prompt).tolist()
    return replace(exp, rewards=rewards, kl=kl, advantages=advantages, returns=returns,
                   train_rows=train_rows)
