"""The PPO stages called as `ppo/iteration.py` calls them, from the whole config: for tests
that drive one stage at a time."""
from __future__ import annotations

from ds_ppo.config import Config
from ds_ppo.containers import Experience, Rollout
from ds_ppo.ppo.scoring import reward_settings, score, scoring_settings, timed_reward_scores


def score_rollout(rollout: Rollout, engines, cfg: Config, reward_encode=None) -> Experience:
    """Step 2: `score` with `cfg`'s settings, the reward scores after the model forwards."""
    return score(rollout, engines, scoring_settings(cfg),
                 lambda: timed_reward_scores(rollout, engines, reward_settings(cfg),
                                             reward_encode))
