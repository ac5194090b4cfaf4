"""Evaluation: greedy responses to held-out prompts, scored by the reward, reduced across ranks."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch

from ds_ppo import watchdog
from ds_ppo.config import Config
from ds_ppo.containers import Rollout
from ds_ppo.engine import dist
from ds_ppo.errors import RewardError
from ds_ppo.metrics import Accumulator, std_from_moments
from ds_ppo.rewards.encode import readable_responses

log = logging.getLogger("ds_ppo")


@dataclass(frozen=True)
class EvalSettings:
    """Everything the evaluation reads from the config."""

    eval_size: int  # data.eval_size: prompts evaluated (at most)
    num_samples: int  # tracking.num_samples: rows of the eval samples table


def eval_settings(cfg: Config) -> EvalSettings:
    """The evaluation's settings from the config."""
    return EvalSettings(cfg.data.eval_size, cfg.tracking.num_samples)


def greedy_config(cfg: Config) -> Config:
    """The config the evaluation generates with: greedy, one response per prompt (n greedy
    samples of a prompt would all be the same)."""
    return cfg.model_copy(update={
        "generation": cfg.generation.model_copy(update={"temperature": 0.0}),
        "ppo": cfg.ppo.model_copy(update={"samples_per_prompt": 1})})


def eval_indices(num_prompts: int, eval_size: int) -> list[int]:
    """This data-parallel rank's share of the first `eval_size` prompts (the ranks of a
    sequence-parallel group take the same), rounded down to a multiple of the data-parallel
    world size so every rank generates (and calls the engines) equally often."""
    world, rank = dist.dp_world_size(), dist.dp_rank()
    n = (min(num_prompts, eval_size) // world) * world
    per = n // world
    return list(range(rank * per, (rank + 1) * per))


def evaluate(num_prompts: int, s: EvalSettings, generate: Callable[[list[int]], Rollout],
             reward: Callable[[Rollout], torch.Tensor], tokenizer
             ) -> tuple[dict[str, float], list[tuple[str, str, float, dict]]]:
    """Collective. Metrics `eval/score_mean`, `eval/score_std`, `eval/length_mean`,
    `eval/eos_rate` over every rank's greedy responses (`generate(indices)`: the rollout of the
    evaluation prompts `indices` with `greedy_config`; `reward(rollout)`: its (B,) scores,
    `scoring.reward_scores`); and this rank's first tracking.num_samples (prompt, response,
    score, data.reward_keys values, chat messages or None) for the eval samples table."""
    indices = eval_indices(num_prompts, s.eval_size)
    if not indices:
        return {}, []
    watchdog.at("evaluation")
    rollout = generate(indices)
    try:
        scores = reward(rollout)
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
    k = s.num_samples
    chats = rollout.messages[:k] if rollout.messages is not None else [None] * k
    return m, list(zip(rollout.prompts[:k], readable_responses(tokenizer, rollout, k),
                       scores[:k].tolist(), rollout.extras[:k], chats))
