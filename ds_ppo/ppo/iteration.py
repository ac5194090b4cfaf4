"""One PPO iteration's stages, steps 1-4 of `train()`: generate, score, shape rewards and
estimate advantages, update. `train()` and `ds-ppo bench` both call `run_iteration`, so the
benchmark times the code a training run runs. Plus the reward model's input encoder both use."""
from __future__ import annotations

import logging
import time
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Literal

import torch

from ds_ppo import watchdog
from ds_ppo.config import Config
from ds_ppo.containers import Experience, Rollout
from ds_ppo.data.prompts import PromptSet
from ds_ppo.data.ptx import PtxStream
from ds_ppo.engine import dist
from ds_ppo.engine.batch_invariant import batch_invariant
from ds_ppo.engine.generation import Generated
from ds_ppo.metrics import Accumulator
from ds_ppo.ppo.episodes import add_episode_metrics, episode_settings, make_episodes
from ds_ppo.ppo.reward_stream import reward_stream
from ds_ppo.ppo.rollout import (generation_metrics, make_rollout, rollout_settings,
                                stamp_versions)
from ds_ppo.ppo.advantages import add_advantages, advantage_settings
from ds_ppo.ppo.correction import correction_settings, rollout_correction
from ds_ppo.ppo.dynamic import PromptDraw, refill, refill_settings
from ds_ppo.ppo.scoring import (RewardScores, reward_call_settings, reward_settings, score,
                                scoring_settings, timed_reward_scores)
from ds_ppo.ppo.update import ppo_update, update_settings

if TYPE_CHECKING:
    from ds_ppo.engine.roles import Engines

log = logging.getLogger("ds_ppo")

Phase = Literal["generation", "scoring", "advantages", "update"]
# phase -> a context manager around that phase (what the caller measures: metrics, bench records)
PhaseTimer = Callable[[Phase], AbstractContextManager]


@dataclass(frozen=True)
class IterationInputs:
    """What every iteration of a run reads, built once at start-up."""

    cfg: Config
    engines: Engines
    tokenizer: Any  # the policy's
    prompts: PromptSet  # the training prompts (every rank holds all of them)
    gen_mode: str  # generation mode (engine.generation.choose_mode)
    eos_ids: list[int]  # the ids that end a response (rollout.stop_token_ids)
    reward_encode: Callable | None  # rollout -> reward-model input (reward_encoder); None: no model
    ptx: PtxStream | None = None  # PPO-ptx rows per mini-batch (ppo.ptx_coef); None: off
    env: Any = None  # an envs.runner.EnvRunner: multi-turn episodes (None: one response each)
    # ppo.schedule other than sync: a ppo.schedule.RolloutSchedule (None: generate in step 1)
    schedule: Any = None


def run_iteration(run: IterationInputs, iteration: int, indices: list[int] | PromptDraw,
                  kl_coef: float, acc: Accumulator,
                  timed: PhaseTimer = lambda phase: nullcontext(),
                  entropy_coef: float | None = None) -> tuple[Experience, Generated]:
    """Steps 1-4 of iteration `iteration` (1-based) on this rank's prompts `indices` (or, with
    ppo.dynamic_sampling, the rounds `indices` draws): the scored `Experience` (B = this rank's
    sequences) with its advantages, after the PPO update of the engines; and what generation
    ran (decoding loop and its statistics). The update's statistics go into `acc`;
    `timed(phase)` wraps each stage. With `run.schedule` (ppo.schedule one_step_off, async) the
    rollout is the schedule's for this iteration and `indices` is not read. `entropy_coef`: the
    entropy bonus's coefficient of this update (the entropy controller's; None:
    ppo.entropy_coef)."""
    # generation.batch_invariant: the sampler's and the trainer's forwards give equal logits
    with batch_invariant(run.cfg.generation.batch_invariant):
        return _iteration(run, iteration, indices, kl_coef, acc, timed, entropy_coef)


def _iteration(run: IterationInputs, iteration: int, indices: list[int] | PromptDraw,
               kl_coef: float,
               acc: Accumulator, timed: PhaseTimer,
               entropy_coef: float | None) -> tuple[Experience, Generated]:
    cfg, engines = run.cfg, run.engines
    reward = _reward_scorer(run)
    rewards = None  # known before scoring with dynamic sampling, or from ppo.schedule's worker
    stream = None  # reward.stream: the reward calls started as responses finish
    # step 1. generate the trajectory (this rank's shard of the global batch)
    with _stage(timed, "generation", iteration):
        if run.schedule is not None:  # ppo.schedule: generated beside an earlier update
            rollout, generated, rewards = run.schedule.take(iteration, acc)
            # step 1b. at a refresh, the next iterations' rollouts start in the background
            run.schedule.start_next(iteration)
        elif isinstance(indices, PromptDraw):  # rounds until enough groups carry signal
            rollout, generated, rewards = refill(
                refill_settings(cfg), indices, lambda idx: _generate(run, idx, acc), reward,
                run.tokenizer.pad_token_id, acc)
        else:
            stream = None if run.env is not None else reward_stream(
                reward_call_settings(cfg), engines.reward_fn)
            rollout, generated = _generate(run, indices, acc, stream)
            generation_metrics(rollout, generated, acc)
        if rollout.token_versions is None:  # generated now, by the current weights
            stamp_versions(rollout, iteration - 1)
    # step 2. score it: log-probs, reference log-probs, values, reward scores
    with _stage(timed, "scoring", iteration):
        exp = score(rollout, engines, scoring_settings(cfg),
                    (lambda: reward(rollout, stream)) if rewards is None else (lambda: rewards))
    # step 2b. the sampler's log-probs against the trainer's: metrics, importance weights
    exp = rollout_correction(exp, correction_settings(cfg), acc)
    # step 3. KL-shaped rewards, advantages (GAE, or a critic-free estimator)
    with _stage(timed, "advantages", iteration):
        exp = add_advantages(exp, advantage_settings(cfg, kl_coef))
    # step 4. PPO epochs over mini-batches: policy (and value) updates
    with _stage(timed, "update", iteration):
        ppo_update(exp, engines, update_settings(cfg), iteration, acc, run.ptx, entropy_coef)
    if run.schedule is not None:  # step 4b. the next rollouts buffered: nothing left running
        with watchdog.phase("waiting for the next rollouts", iteration):
            run.schedule.finish(iteration, acc)
    return exp, generated


def _reward_scorer(run: IterationInputs) -> Callable[..., RewardScores]:
    """(a rollout, the `RewardStream` whose calls started as its responses finished, or None)
    -> its reward scores, timed (`scoring.timed_reward_scores`)."""
    settings = reward_settings(run.cfg)

    def reward(rollout: Rollout, stream=None) -> RewardScores:
        called = None if stream is None else stream.result(rollout)
        return timed_reward_scores(rollout, run.engines, settings, run.reward_encode, called)
    return reward


def _generate(run: IterationInputs, indices: list[int], acc: Accumulator, stream=None
              ) -> tuple[Rollout, Generated]:
    """This rank's rollout of the prompts `indices`: one response per sample (each handed to
    the reward's `stream` as it finishes), or multi-turn episodes with the environment (their
    metrics into `acc`)."""
    if run.env is None:
        return make_rollout(run.prompts, indices, run.engines, rollout_settings(run.cfg),
                            run.tokenizer, run.gen_mode, run.eos_ids, stream)
    rollout, generated, stats = make_episodes(run.prompts, indices, run.engines,
                                              episode_settings(run.cfg), run.tokenizer,
                                              run.gen_mode, run.eos_ids, run.env)
    add_episode_metrics(acc, stats)
    # the ranks of a sequence-parallel group played the same episodes from the same stream: its
    # first rank's on all of them (as make_rollout does)
    return dist.broadcast_in_sp_group(rollout, run.engines.device), generated


@contextmanager
def _stage(timed: PhaseTimer, phase: Phase, iteration: int):
    """A stage: timed by the caller, and the rank's phase for the watchdog."""
    with watchdog.phase(phase, iteration), timed(phase):
        yield


# the phases with a time/<phase>_s metric (the advantages take no measurable time)
TIMED_PHASES = ("generation", "scoring", "update")


def metric_timer(acc: Accumulator) -> PhaseTimer:
    """Times TIMED_PHASES into `acc` as time/<phase>_s (seconds, the max across ranks)."""
    return lambda phase: _timed(acc, f"time/{phase}_s") if phase in TIMED_PHASES else nullcontext()


@contextmanager
def _timed(acc: Accumulator, name: str):
    t0 = time.perf_counter()
    yield
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    acc.add_max(name, time.perf_counter() - t0)
