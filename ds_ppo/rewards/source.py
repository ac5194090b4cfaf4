"""The reward callable a run's config names: a `reward.url` service or a `reward.function`;
None where the reward is a model (an engine) or an env's turn rewards alone."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from ds_ppo.config import Config

def reward_function(cfg: Config, world: int) -> Callable[..., Any] | None:
    """The callable reward of reward.url (a RewardService) or reward.function; None for a
    reward model (an engine) or an env's turn rewards alone. A split placement's generation
    ranks build theirs with it too (`world`: the training ranks, whose calls share the
    deadline)."""
    if cfg.reward.model is not None:
        return None
    if cfg.reward.url is not None:
        from ds_ppo.http_deadline import call_deadline
        from ds_ppo.rewards.service import RewardService

        return RewardService.from_config(cfg.reward,
                                         call_deadline(cfg.dist_timeout_minutes, world))
    if cfg.reward.function is not None:  # else an env's turn rewards are the only ones
        from ds_ppo.rewards.call import load_reward_function

        return load_reward_function(cfg.reward.function, cfg.data.reward_keys)
    return None
