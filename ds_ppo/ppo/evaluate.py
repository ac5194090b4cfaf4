"""Evaluation: greedy responses to held-out prompts, scored by the reward, reduced across ranks."""
from __future__ import annotations

import logging

from ds_ppo import watchdog
from ds_ppo.config import Config
from ds_ppo.data.prompts import PromptSet
from ds_ppo.engine import dist
from ds_ppo.errors import RewardError
from ds_ppo.metrics import Accumulator, std_from_moments
from ds_ppo.ppo.rollout import make_rollout
from ds_ppo.ppo.scoring import reward_scores
from ds_ppo.rewards.encode import readable_responses

log = logging.getLogger("ds_ppo")


def eval_indices(num_prompts: int, cfg: Config) -> list[int]:
    """This data-parallel rank's share of the first eval_size prompts (the ranks of a
    sequence-parallel group take the same), rounded down to a multiple of the data-parallel
    world size so every rank generates (and calls the engines) equally often."""
    world, rank = dist.dp_world_size(), dist.dp_rank()
    n = (min(num_prompts, cfg.data.eval_size) // world) * world
    per = n // world
    return list(range(rank * per, (rank + 1) * per))


def evaluate(prompts: PromptSet, engines, cfg: Config, tokenizer, mode: str,
             eos_ids: list[int], reward_encode
             ) -> tuple[dict[str, float], list[tuple[str, str, float, dict]]]:
    """Collective. Metrics `eval/score_mean`, `eval/score_std`, `eval/length_mean`,
    `eval/eos_rate` over every rank's greedy responses; and this rank's first
    tracking.num_samples (prompt, response, score, data.reward_keys values) for the eval
    samples table."""
    indices = eval_indices(len(prompts.input_ids), cfg)
    if not indices:
        return {}, []
    watchdog.at("evaluation")
    # greedy, one response per prompt (n greedy samples of a prompt would all be the same)
    greedy = cfg.model_copy(update={
        "generation": cfg.generation.model_copy(update={"temperature": 0.0}),
        "ppo": cfg.ppo.model_copy(update={"samples_per_prompt": 1})})
    rollout, _ = make_rollout(prompts, indices, engines, greedy, tokenizer, mode, eos_ids)
    try:
        scores, _ = reward_scores(rollout, engines, cfg, reward_encode)
    except RewardError as e:  # the iteration's update already ran: not its checkpoint
        e.after_update = True
        raise
    acc = Accumulator()
    n = float(len(rollout))
    acc.add_mean("eval/score_mean", float(scores.sum()), n)
    acc.add_mean("eval/_score_sq", float((scores ** 2).sum()), n)
    acc.add_mean("eval/length_mean", float(rollout.mask.sum()), n)
    acc.add_mean("eval/eos_rate", float(rollout.ended.sum()), n)
    m = acc.reduce()
    m["eval/score_std"] = std_from_moments(m["eval/score_mean"], m.pop("eval/_score_sq"))
    k = cfg.tracking.num_samples
    return m, list(zip(rollout.prompts[:k], readable_responses(tokenizer, rollout, k),
                       scores[:k].tolist(), rollout.extras[:k]))
