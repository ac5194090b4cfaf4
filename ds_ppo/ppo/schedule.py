"""ppo.schedule's rollouts (docs/ASYNC.md): with one_step_off and async, the next iteration's
rollout is generated, and its reward function called, in a background worker on a generation
replica of its own, while this iteration scores and trains on the engines.

What runs where (colocated placement, every rank alike):

- the training thread: everything with a collective, in one order on every rank: the ZeRO
  gathers that refresh the replica (`build_replica`) and their checksum agreement, the
  agreement on the reward call's outcome (`scoring._function_scores`), scoring, the update;
- the worker thread: `replica_rollout` on the replica (our decoding loop, no collective) from
  its own random stream (`generator`), then `call_reward` (reward.function / reward.url). A
  reward model's forwards are collective: they stay in scoring, on the training thread.

Which weights generate iteration j's rollout is fixed by `algo.choices.rollout_version`, never
by timing, and the worker is joined before each iteration ends, so at every iteration boundary
nothing is running: what is in flight is one finished rollout (with its version and its
reward call), the worker's random stream and, when the replica's weights are older than the
engines', the replica. `state_dict` is that; a checkpoint holds it (per rank), so a resumed
run generates and trains on exactly what the uninterrupted one would.
"""
from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Callable

import torch

from ds_ppo.algo.choices import rollout_version
from ds_ppo.containers import Rollout
from ds_ppo.engine import dist
from ds_ppo.engine.generation import Generated, build_replica, weight_checksum
from ds_ppo.errors import UserError
from ds_ppo.metrics import Accumulator
from ds_ppo.ppo.rollout import generation_metrics, replica_rollout
from ds_ppo.ppo.scoring import RewardCall, RewardScores, call_reward, timed_reward_scores

log = logging.getLogger("ds_ppo")


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
    seconds: float  # worker time to generate and score it


class RolloutSchedule:
    """The rollouts of a run with ppo.schedule one_step_off or async, for `run_iteration`:
    `take` (step 1), `start_next` (right after it), `finish` (after the update)."""

    def __init__(self, run, prompts_of: Callable[[int], list[int]]) -> None:
        self.run, self.prompts_of = run, prompts_of
        cfg = run.cfg
        self.schedule, self.max_staleness = cfg.ppo.schedule, cfg.ppo.max_staleness
        # the most updates a used sample may lag (a buffered one beyond: regenerated)
        self.lag = 1 if self.schedule == "one_step_off" else self.max_staleness
        device = run.engines.device
        # the worker's sampling stream, seeded as the sync loop seeds its (ppo/job.py): with
        # max_staleness 0 the two sample the same tokens
        self.generator = torch.Generator(device=device).manual_seed(
            cfg.seed * 1000 + dist.dp_rank())
        self.replica: torch.nn.Module | None = None
        self.replica_version: int | None = None
        self.buffer: Buffered | None = None
        self.pending: Future | None = None
        self.deferred: int | None = None  # the next rollout is generated after the update
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="ds_ppo-rollout")
        self.busy_s = 0.0  # this iteration's worker time
        self.sync_s, self.sync_bytes = 0.0, 0
        self.t_start = 0.0
        self.completed = 0  # the last iteration finished

    # ------------------------------------------------------------------ the iteration's steps
    def take(self, iteration: int, acc: Accumulator
             ) -> tuple[Rollout, Generated, RewardScores | None]:
        """Step 1: the rollout of `iteration`: the one generated beside the previous iteration,
        or generated now (the first iteration, a resume without one, or one older than
        max_staleness after a resume with other settings: regenerated, counted); its reward
        scores when the reward function was called on it already (collective: agreed)."""
        self.t_start, self.busy_s, self.sync_s, self.sync_bytes = time.perf_counter(), 0.0, 0.0, 0
        current = iteration - 1
        got, self.buffer = self.buffer, None
        acc.add_mean("async/queue_depth", float(got is not None), 1)
        usable = (got is not None and got.iteration == iteration
                  and current - got.version <= self.lag)
        # regenerated: a buffered rollout too old for max_staleness, or none after a resume
        # (a checkpoint of a sync run, or of another world size, holds none); every rank alike
        # (the weight sync below is collective)
        missing = 0.0 if usable or (got is None and iteration == 1) else 1.0
        regenerate = float(dist.all_reduce_max(torch.tensor([missing], dtype=torch.float64)))
        acc.add_sum("async/regenerated", regenerate)
        if not usable or regenerate:
            self._sync(current)
            got = self._produce(iteration, current)
            self.busy_s += got.seconds
        staleness = float(current - got.version)
        tokens = float(got.rollout.mask.sum())
        acc.add_mean("async/staleness_mean", staleness * len(got.rollout), len(got.rollout))
        acc.add_max("async/staleness_max", staleness)
        acc.add_mean("async/off_policy_token_share", tokens if staleness > 0 else 0.0, tokens)
        acc.add_sum("async/dropped", 0.0)  # too-old samples are regenerated, never dropped
        generation_metrics(got.rollout, got.generated, acc)
        rewards = None
        if got.called is not None:
            rewards = timed_reward_scores(got.rollout, self.run.engines, self.run.cfg,
                                          self.run.reward_encode, got.called)
        return got.rollout, got.generated, rewards

    def start_next(self, iteration: int) -> None:
        """Right after `take`: start generating iteration + 1's rollout in the worker, from the
        weights `rollout_version` names (refreshing the replica first if they are the current
        ones); with max_staleness 0 they exist only after the update: `finish` generates it."""
        nxt = iteration + 1
        version = rollout_version(self.schedule, self.max_staleness, nxt)
        if version == iteration:  # after this iteration's update
            self.deferred = version
            return
        if version != self.replica_version:
            # the weights this iteration started from: `version` itself, except after a resume
            # with other settings whose replica does not hold that older version
            version = iteration - 1
            self._sync(version)
        self.pending = self.pool.submit(self._produce, nxt, version)

    def finish(self, iteration: int, acc: Accumulator) -> None:
        """After the update: the next iteration's rollout finished and buffered, so nothing is
        running at the iteration's end (what a checkpoint then holds: `state_dict`)."""
        t0 = time.perf_counter()
        if self.deferred is not None:
            self._sync(self.deferred)
            self.buffer, self.deferred = self._produce(iteration + 1, iteration), None
        else:
            self.buffer, self.pending = self.pending.result(), None
        waited = time.perf_counter() - t0
        self.completed = iteration
        total = max(time.perf_counter() - self.t_start, 1e-9)
        busy = self.buffer.seconds + self.busy_s
        acc.add_max("async/training_wait_s", waited)
        acc.add_mean("async/training_idle_frac", min(waited, total), total)
        acc.add_mean("async/generation_idle_frac", max(total - busy, 0.0), total)
        acc.add_max("async/weight_sync_s", self.sync_s)
        acc.add_max("async/weight_sync_bytes", float(self.sync_bytes))

    # ------------------------------------------------------------------ the parts
    def _produce(self, iteration: int, version: int) -> Buffered:
        """The rollout of `iteration` on the replica (weights of `version`), its reward function
        called: no collective (the worker runs this; so does the training thread when it
        generates now)."""
        run, t0 = self.run, time.perf_counter()
        rollout, gen = replica_rollout(run.prompts, self.prompts_of(iteration), self.replica,
                                       run.cfg, run.tokenizer, run.eos_ids, run.engines.device,
                                       self.generator)
        called = None
        if run.engines.reward_fn is not None:
            called = call_reward(rollout, run.engines.reward_fn, run.cfg, in_worker=True)
        return Buffered(iteration, version, rollout, replace(gen, replica=None), called,
                        time.perf_counter() - t0)

    def _sync(self, version: int) -> None:
        """Weight sync: the replica takes the policy's current weights (`version`), gathered
        bucket by bucket (collective, training thread only), each copied weight checked against
        the checksum of what was gathered and the whole agreed across ranks; a mismatch stops
        the run with one line."""
        engines, t0 = self.run.engines, time.perf_counter()
        sums: dict[str, int] = {}
        self.replica = build_replica(engines.policy.module, engines.dtype, engines.device,
                                     into=self.replica, own_config=True, sums=sums)
        _fault_point(self.replica, version)
        params = dict(self.replica.named_parameters())
        bad = [name for name, s in sums.items() if weight_checksum(params[name]) != s]
        total = sum(sums.values()) % 2**52
        spread = dist.all_reduce_max(torch.tensor([float(total), -float(total), float(len(bad))],
                                                  dtype=torch.float64))
        if bad or float(spread[2]) or float(spread[0]) != -float(spread[1]):
            raise WeightSyncError(
                f"weight sync of policy version {version} into the generation replica failed its "
                f"checksum ({bad[0] if bad else 'on another rank, or the ranks differ'}): stopped;"
                " the engines' weights are intact, run the same command again to resume")
        self.replica_version = version
        self.sync_s += time.perf_counter() - t0
        self.sync_bytes += sum(p.numel() * p.element_size() for p in params.values())

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """What a checkpoint after the last finished iteration holds for this rank: the
        buffered rollout, the worker's random stream, and the replica's weights when they are
        older than the engines' (async with max_staleness >= 2 generates from them again)."""
        buffer = self.buffer
        if buffer is not None and buffer.called is not None and buffer.called.error is not None:
            # a failed reward call is not kept: the resumed run calls the (fixed) reward again
            buffer = replace(buffer, called=None)
        keep_replica = (self.replica is not None and self.replica_version is not None
                        and self.replica_version < self.completed)
        return {"schedule": self.schedule, "max_staleness": self.max_staleness,
                "completed": self.completed,
                "buffer": buffer, "generator": self.generator.get_state(),
                "replica_version": self.replica_version if keep_replica else None,
                "replica": ({k: v.detach().cpu().clone()
                             for k, v in self.replica.state_dict().items()}
                            if keep_replica else None)}

    def load_state_dict(self, saved: dict | None) -> None:
        """Continue from `state_dict`'s (None: a checkpoint without one, e.g. of a sync run or
        another world size: the next rollout is regenerated from the current weights)."""
        if saved is None:
            return
        self.generator.set_state(saved["generator"])
        self.buffer = dist.moved(saved["buffer"], self.run.engines.device)
        self.completed = saved["completed"]
        if saved["replica"] is not None:
            self._sync(-1)  # allocate the replica (the checksum check runs as ever)
            self.replica.load_state_dict(saved["replica"])
            self.replica_version = saved["replica_version"]


def _fault_point(replica: torch.nn.Module, version: int) -> None:
    """Fault injection for the tests: DS_PPO_FAULT=corrupt_sync:N changes one element of the
    replica's first weight after the copy of policy version N (as a bad transfer would)."""
    if os.environ.get("DS_PPO_FAULT", "") == f"corrupt_sync:{version}":
        with torch.no_grad():
            p = next(replica.parameters())
            p.view(-1)[0] += 1.0
