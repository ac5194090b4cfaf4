"""What generates ppo.schedule's rollouts, with no collective (docs/ASYNC.md): `RolloutWorker`
decodes on a replica from a random stream it is handed and calls the reward function; the
colocated placement runs it in a background thread of every rank (ppo/schedule.py), the split
placement on the generation ranks (ppo/split.py). Also the containers of what it gives back and
the line a failed weight sync stops the run with."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import torch

from ds_ppo.containers import Rollout
from ds_ppo.engine.generation import Generated
from ds_ppo.errors import UserError
from ds_ppo.ppo.rollout import replica_rollout
from ds_ppo.ppo.scoring import RewardCall, call_reward


class WeightSyncError(UserError):
    """The generation replica's weights differ from the policy's after a weight sync."""


@dataclass
class Buffered:
    """One rollout generated ahead of the iteration that trains on it (this rank's rows)."""

    iteration: int  # the iteration (1-based) that trains on it
    version: int  # policy version (optimizer updates applied) of the weights that generated it
    rollout: Rollout
    generated: Generated  # the decoding loop's output (no replica)
    # the reward function's call on it (None: a reward model, or a failed call saved in a
    # checkpoint: scoring calls the reward)
    called: RewardCall | None
    seconds: float  # worker time to generate it plus its reward call's


@dataclass
class Batch:
    """What the worker gave back for one `rollout_batch`: its rollouts, in iteration order."""

    rollouts: list[Buffered]
    seconds: float  # the worker's wall-clock time for the whole batch


class RolloutWorker:
    """What generates rollouts, with no collective: decoding on a replica from a random stream
    it is handed, and the reward function's call on each rollout. The colocated placement's
    background thread runs it on every rank; under ppo.placement = split a generation rank's
    loop (`serve_generation`) does, for the training ranks it serves."""

    def __init__(self, cfg, prompts, tokenizer, eos_ids: list[int], device: torch.device,
                 reward_fn, lag: int) -> None:
        self.cfg, self.prompts, self.tokenizer, self.eos_ids = cfg, prompts, tokenizer, eos_ids
        self.device, self.reward_fn = device, reward_fn
        self.replica: torch.nn.Module | None = None
        # a batch's reward calls at once: at most max_staleness, bounded by reward.concurrency
        self.reward_pool = ThreadPoolExecutor(max(1, min(lag, cfg.reward.concurrency)),
                                              thread_name_prefix="ds_ppo-reward")

    def decode(self, indices: list[int], generator: torch.Generator
               ) -> tuple[Rollout, Generated, float]:
        """The rollout of the prompts `indices` on the replica from `generator`, and its
        seconds."""
        t0 = time.perf_counter()
        rollout, gen = replica_rollout(self.prompts, indices, self.replica, self.cfg,
                                       self.tokenizer, self.eos_ids, self.device, generator)
        return rollout, replace(gen, replica=None), time.perf_counter() - t0

    def call(self, rollout: Rollout) -> RewardCall | None:
        """The reward function's call on `rollout` (None: a reward model scores it later)."""
        fn = self.reward_fn
        return None if fn is None else call_reward(rollout, fn, self.cfg, in_worker=True)

    def produce(self, iteration: int, indices: list[int], version: int,
                generator: torch.Generator) -> Buffered:
        """The rollout of `iteration` (prompts `indices`) on the replica (weights of `version`),
        its reward function called, on the calling thread."""
        rollout, gen, seconds = self.decode(indices, generator)
        called = self.call(rollout)
        return Buffered(iteration, version, rollout, gen, called,
                        seconds + (called.seconds if called is not None else 0.0))

    def produce_batch(self, work: list[tuple[int, list[int]]], version: int,
                      generator: torch.Generator) -> Batch:
        """The rollouts of `work` ((iteration, prompt indices) pairs) decoded one after another
        from the replica (weights of `version`) and `generator`, so the tokens do not depend on
        timing; each one's reward call starts in the reward pool as its decoding ends."""
        t0 = time.perf_counter()
        decoded = []
        for j, indices in work:
            rollout, gen, seconds = self.decode(indices, generator)
            decoded.append((j, rollout, gen, seconds, self.reward_pool.submit(self.call, rollout)))
        rollouts = []
        for j, rollout, gen, seconds, call in decoded:
            called = call.result()
            rollouts.append(Buffered(j, version, rollout, gen, called,
                                     seconds + (called.seconds if called is not None else 0.0)))
        return Batch(rollouts, time.perf_counter() - t0)


def sync_error(version: int, bad: str | None, where: str = "the generation replica"
               ) -> WeightSyncError:
    """The one line a failed weight sync stops the run with."""
    return WeightSyncError(
        f"weight sync of policy version {version} into {where} failed its checksum "
        f"({bad or 'on another rank, or the ranks differ'}): stopped; the engines' weights are "
        "intact, run the same command again to resume")
