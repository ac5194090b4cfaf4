"""ppo.schedule's rollouts (docs/ASYNC.md): with one_step_off and async, the rollouts of the
next iterations are generated, and their reward function called, in a background worker on a
generation replica of its own, while this iteration scores and trains on the engines.

What runs where (ppo.placement = colocated, every rank alike; under split, ppo/split.py: a
generation rank runs the worker's part, `RolloutWorker`, for the training ranks it serves):

- the training thread: everything with a collective, in one order on every rank: the ZeRO
  gathers that refresh the replica (`build_replica`) and their checksum agreement, the
  agreement on the reward call's outcome (`scoring._function_scores`), scoring, the update;
- the worker thread: `replica_rollout` on the replica (our decoding loop, no collective) from
  its own random stream (`generator`), one rollout after another in iteration order, each
  response's reward call (reward.function / reward.url) started as the decoding loop finishes
  it (`reward_stream`; with reward.stream off, each rollout's one call handed to a small pool as
  its decoding ends), so the calls of a batch overlap one another. A reward model's forwards
  are collective: they stay in scoring, on the training thread.

Which iterations' rollouts are generated beside an iteration (`algo.choices.rollout_batch`) and
from which weights (`rollout_version`) are fixed by the schedule, never by timing: at a refresh
the replica takes the current weights and generates the next max_staleness rollouts in one go.
The worker is joined before each iteration ends, so at every iteration boundary nothing is
running: what is in flight is up to max_staleness finished rollouts (each with its version and
its reward call) and the worker's random stream. `state_dict` is that; a checkpoint holds it
(per rank), so a resumed run generates and trains on exactly what the uninterrupted one would.
The replica is always refreshed before it generates, so a checkpoint needs none of its weights.

With ppo.partial_rollouts (async, max_staleness N >= 2) every iteration refreshes the replica and
the worker decodes the next segment of each of the N rollouts in flight (`algo.choices.
partial_plan`, ppo/partial.py): a sequence keeps its tokens across a weight update and continues
with the new weights. A row's reward call starts in the segment its response ends (the calls of
rows that end early run on beside later iterations), so an iteration waits only for the calls of
the rows that ended in its last segment. What is in flight then also holds the rollouts decoded
in part (`Partial`: tokens, sampler log-probs and versions so far), saved with the rest; their
reward calls are not saved: a resumed run calls its ended rows again, as it does a failed call.
"""
from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Callable

import torch

from ds_ppo.algo.choices import partial_plan, rollout_batch, rollout_version
from ds_ppo.containers import Rollout
from ds_ppo.engine import dist
from ds_ppo.engine.generation import Generated, build_replica, weight_checksum
from ds_ppo.engine.lora import trained_bytes
from ds_ppo.engine.side_stream import SideStream
from ds_ppo.metrics import Accumulator
from ds_ppo.ppo.episodes import add_episode_metrics, agree_on_episodes
from ds_ppo.ppo.partial import Partial
from ds_ppo.ppo.rollout import generation_metrics, stamp_versions
# Buffered also by this name: checkpoints' in-flight files pickled it from here
from ds_ppo.ppo.rollout_worker import (  # noqa: F401
    Batch, Buffered, RolloutWorker, WeightSyncError, sync_error)
from ds_ppo.ppo.scoring import RewardScores, reward_settings, timed_reward_scores

log = logging.getLogger("ds_ppo")


class RolloutSchedule:
    """The rollouts of a run with ppo.schedule one_step_off or async, for `run_iteration`:
    `take` (step 1), `start_next` (right after it), `finish` (after the update)."""

    def __init__(self, run, prompts_of: Callable[[int], list[int]]) -> None:
        self.run, self.prompts_of = run, prompts_of
        cfg = run.cfg
        self.schedule, self.max_staleness = cfg.ppo.schedule, cfg.ppo.max_staleness
        # the most updates a used sample may lag (a buffered one beyond: regenerated)
        self.lag = cfg.ppo.max_lag
        device = run.engines.device
        # the worker's sampling stream, seeded as the sync loop seeds its (ppo/train_job.py): with
        # max_staleness 0 the two sample the same tokens
        self.generator = torch.Generator(device=device).manual_seed(
            cfg.seed * 1000 + dist.dp_rank())
        self.replica_version: int | None = None
        self.buffer: dict[int, Buffered] = {}  # by the iteration that trains on it
        # ppo.partial_rollouts: the rollouts decoded in part, by the iteration that trains on it
        self.partial_rollouts = cfg.ppo.partial_rollouts
        self.partial: dict[int, Partial] = {}
        self.pending: Future | None = None  # a Batch
        self.deferred: int | None = None  # the next rollout is generated after the update
        # colocated: a worker thread on this rank; split: a generation rank (`RemoteWorker`)
        self.remote = None
        if cfg.ppo.placement == "split":
            from ds_ppo.ppo.split import RemoteWorker

            self.remote = RemoteWorker(run)
        self.worker = None if self.remote is not None else RolloutWorker(
            cfg, run.prompts, run.tokenizer, run.eos_ids, device, run.engines.reward_fn,
            self.lag, run.env)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="ds_ppo-rollout")
        self.side = SideStream(device)  # the worker's CUDA stream (colocated, on a GPU)
        self.busy_s = 0.0  # this iteration's worker time
        self.sync_s, self.sync_bytes = 0.0, 0
        self.t_start = 0.0
        self.completed = 0  # the last iteration finished

    # ------------------------------------------------------------------ the iteration's steps
    def take(self, iteration: int, acc: Accumulator
             ) -> tuple[Rollout, Generated, RewardScores | None]:
        """Step 1: the rollout of `iteration`: the one generated ahead of it, or generated now
        (the first iteration, a resume without one, or one older than max_staleness after a
        resume with other settings: regenerated, counted); its reward scores when the reward
        function was called on it already (collective: agreed)."""
        self.t_start, self.busy_s, self.sync_s, self.sync_bytes = time.perf_counter(), 0.0, 0.0, 0
        current = iteration - 1
        acc.add_mean("async/queue_depth", float(len(self.buffer)), 1)
        got = self.buffer.pop(iteration, None)
        self.side.adopt(got)  # decoded on the worker's stream, used on this one from now on
        # a rollout for an earlier iteration is never used (only after a resume with a
        # checkpoint of other settings)
        self.buffer = {j: b for j, b in self.buffer.items() if j > iteration}
        self.partial = {j: p for j, p in self.partial.items() if j > iteration}
        usable = self._usable(got, iteration)
        # regenerated: a buffered rollout too old for max_staleness, or none after a resume
        # (a checkpoint of a sync run, or of another world size, holds none); every rank alike
        # (the weight sync below is collective)
        missing = 0.0 if usable or (got is None and iteration == 1) else 1.0
        regenerate = float(dist.all_reduce_max(torch.tensor([missing], dtype=torch.float64)))
        acc.add_sum("async/regenerated", regenerate)
        if regenerate and dist.is_main():
            log.info("iteration %d: no buffered rollout for it (a checkpoint of a sync run, of "
                     "another number of training ranks, or of a larger max_staleness): its "
                     "rollout is generated now from the current weights (async/regenerated)",
                     iteration)
        if not usable or regenerate:
            self._sync(current)
            got = self._produce(iteration, current)
            self.busy_s += got.seconds
        if self.run.env is not None:  # episodes: a failure on any rank stops all (collective)
            agree_on_episodes(got.env_error, self.run.engines.device)
            add_episode_metrics(acc, got.episodes)
        self._staleness_metrics(got, current, acc)
        generation_metrics(got.rollout, got.generated, acc)
        rewards = None
        if got.called is not None:
            rewards = timed_reward_scores(got.rollout, self.run.engines,
                                          reward_settings(self.run.cfg),
                                          self.run.reward_encode, got.called)
        return got.rollout, got.generated, rewards

    def start_next(self, iteration: int) -> None:
        """Right after `take`: when `rollout_batch` names rollouts to generate beside this
        iteration, refresh the replica with the current weights (version iteration - 1) and
        start the worker on them; with max_staleness 0 the next rollout's weights exist only
        after the update: `finish` generates it."""
        if rollout_version(self.schedule, self.max_staleness, iteration + 1) == iteration:
            self.deferred = iteration  # after this iteration's update
            return
        if self.partial_rollouts:
            self._start_segments(iteration)
            return
        todo = [j for j in rollout_batch(self.schedule, self.max_staleness, iteration)
                if not self._usable(self.buffer.get(j), j)]
        if not todo:
            return
        version = iteration - 1
        if version != self.replica_version:
            self._sync(version)
        work = [(j, self.prompts_of(j)) for j in todo]
        if self.remote is not None:
            self.pending = self.remote.submit_batch(work, version, self.generator)
        else:
            self.side.handoff()
            self.pending = self.pool.submit(self.side.run, self.worker.produce_batch, work,
                                            version, self.generator)

    def finish(self, iteration: int, acc: Accumulator) -> None:
        """After the update: the rollouts started beside this iteration finished and buffered,
        so nothing decodes at the iteration's end (what a checkpoint then holds: `state_dict`;
        with partial rollouts, reward calls of ended rows may run on, not saved)."""
        t0 = time.perf_counter()
        if self.deferred is not None:
            self._sync(self.deferred)
            got = self._produce(iteration + 1, self.deferred)
            self.buffer[got.iteration], self.deferred = got, None
            self.busy_s += got.seconds
        elif self.pending is not None:
            batch: Batch = self.pending.result()
            self.pending = None
            self.buffer.update((b.iteration, b) for b in batch.rollouts)
            self.partial.update((p.iteration, p) for p in batch.partial)
            self.busy_s += batch.seconds
        waited = time.perf_counter() - t0
        self.completed = iteration
        if self.remote is not None and iteration == self.run.cfg.iterations:
            self.remote.stop()
        total = max(time.perf_counter() - self.t_start, 1e-9)
        acc.add_max("async/training_wait_s", waited)
        acc.add_mean("async/training_idle_frac", min(waited, total), total)
        acc.add_mean("async/generation_idle_frac", max(total - self.busy_s, 0.0), total)
        acc.add_max("async/weight_sync_s", self.sync_s)
        acc.add_max("async/weight_sync_bytes", float(self.sync_bytes))

    # ------------------------------------------------------------------ the parts
    def _start_segments(self, iteration: int) -> None:
        """ppo.partial_rollouts: refresh the replica with the current weights (version
        iteration - 1) and start the worker on the next segments of the rollouts in flight
        (`partial_plan`): the last of the next iteration's, the first of iteration + N's."""
        work = []
        for j, segments in partial_plan(self.max_staleness, iteration):
            if self._usable(self.buffer.get(j), j):  # buffered already (from a checkpoint)
                continue
            part = self.partial.pop(j, None)
            if part is not None and part.segments >= segments:
                self.partial[j] = part
                continue
            work.append((j, self.prompts_of(j), part, segments))
        # collective, so on every rank alike, whatever a rank has left to decode
        version = iteration - 1
        if version != self.replica_version:
            self._sync(version)
        if self.remote is not None:  # every served rank answers in each round, work or none
            self.pending = self.remote.submit_segments(work, version, self.max_staleness,
                                                       self.generator)
            return
        if not work:
            return
        self.side.handoff()
        self.pending = self.pool.submit(self.side.run, self.worker.advance, work, version,
                                        self.max_staleness, self.generator)

    def _usable(self, buffered: Buffered | None, iteration: int) -> bool:
        """Whether `buffered` can train `iteration`: at most max_staleness updates old then
        (older only after a resume with a smaller max_staleness)."""
        return buffered is not None and (iteration - 1) - buffered.version <= self.lag

    @staticmethod
    def _staleness_metrics(got: Buffered, current: int, acc: Accumulator) -> None:
        """async/staleness_* of the rollout's samples and of its tokens (by the version that
        sampled each, `Rollout.token_versions`), off-policy token share and dropped."""
        staleness = float(current - got.version)
        acc.add_mean("async/staleness_mean", staleness * len(got.rollout), len(got.rollout))
        acc.add_max("async/staleness_max", staleness)
        rollout = got.rollout
        if rollout.token_versions is None:  # a checkpoint saved before versions were recorded
            stamp_versions(rollout, got.version)
        lag = (current - rollout.token_versions)[rollout.mask].float()
        tokens = float(lag.numel())
        acc.add_mean("async/token_staleness_mean", float(lag.sum()), tokens)
        acc.add_max("async/token_staleness_max", float(lag.max()) if tokens else 0.0)
        acc.add_mean("async/off_policy_token_share", float((lag > 0).sum()), tokens)
        # tokens sampled after a weight update their sequence had begun under (partial rollouts)
        later = (rollout.token_versions != got.version)[rollout.mask]
        acc.add_mean("async/continued_token_share", float(later.sum()), tokens)
        acc.add_sum("async/dropped", 0.0)  # too-old samples are regenerated, never dropped

    def _produce(self, iteration: int, version: int) -> Buffered:
        """The rollout of `iteration` from the weights of `version`, generated now (the worker's
        code on the training thread, or a generation rank while this rank waits)."""
        if self.remote is not None:
            return self.remote.produce(iteration, self.prompts_of(iteration), version,
                                       self.generator)
        return self.worker.produce(iteration, self.prompts_of(iteration), version,
                                   self.generator)

    def _sync(self, version: int) -> None:
        """Weight sync: the replica takes the policy's current weights (`version`), gathered
        bucket by bucket (collective, training thread only), each copied weight checked against
        the checksum of what was gathered and the whole agreed across ranks; a mismatch stops
        the run with one line. A LoRA policy's syncs after the first gather the adapters only
        and merge them into the replica's copy of the frozen base (`build_replica`'s bases)."""
        engines, t0 = self.run.engines, time.perf_counter()
        if self.remote is not None:
            self.sync_bytes += self.remote.sync(version)
            self.replica_version = version
            self.sync_s += time.perf_counter() - t0
            return
        sums: dict[str, int] = {}
        w = self.worker
        adapters_only = bool(w.bases)  # a LoRA policy after the first sync
        w.replica = build_replica(engines.policy.module, engines.dtype, engines.device,
                                  into=w.replica, own_config=True, sums=sums, bases=w.bases)
        params = dict(w.replica.named_parameters())
        _fault_point(params, sums, version)
        bad = [name for name, s in sums.items() if weight_checksum(params[name]) != s]
        total = sum(sums.values()) % 2**52
        spread = dist.all_reduce_max(torch.tensor([float(total), -float(total), float(len(bad))],
                                                  dtype=torch.float64))
        if bad or float(spread[2]) or float(spread[0]) != -float(spread[1]):
            raise sync_error(version, bad[0] if bad else None)
        self.replica_version = version
        self.sync_s += time.perf_counter() - t0
        self.sync_bytes += (trained_bytes(engines.policy.module) if adapters_only else
                            sum(p.numel() * p.element_size() for p in params.values()))

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """What a checkpoint after the last finished iteration holds for this rank: every
        buffered rollout (with its version and reward call), the rollouts decoded in part
        (ppo.partial_rollouts) and the worker's random stream. No replica weights (nor KV
        cache): the replica is refreshed before it generates again."""
        return {"schedule": self.schedule, "max_staleness": self.max_staleness,
                "placement": self.run.cfg.ppo.placement, "completed": self.completed,
                "buffer": [k for b in self.buffer.values() if (k := _kept(b)) is not None],
                "partial": list(self.partial.values()),
                "generator": self.generator.get_state()}

    def load_state_dict(self, saved: dict | None) -> None:
        """Continue from `state_dict`'s (None: a checkpoint without one, e.g. of a sync run or
        another world size: the next rollout is regenerated from the current weights)."""
        if saved is None:
            return
        self.generator.set_state(saved["generator"])
        buffered = saved["buffer"]
        if isinstance(buffered, Buffered) or buffered is None:  # saved with one rollout ahead
            buffered = [] if buffered is None else [buffered]
        moved = dist.moved(buffered, self.run.engines.device)
        self.buffer = {b.iteration: b for b in moved}
        self.completed = saved["completed"]
        partial = saved.get("partial") or []
        # a sequence's segments end where max_staleness puts them: another one starts them over
        if partial and self.partial_rollouts and saved["max_staleness"] == self.max_staleness:
            self.partial = {p.iteration: p for p in dist.moved(partial, self.run.engines.device)}
        elif partial and dist.is_main():
            log.info("resumed a checkpoint with partial rollouts in flight (iterations %s) %s: "
                     "they are decoded again from the start", sorted(p.iteration for p in partial),
                     f"with ppo.max_staleness = {self.max_staleness}, not the checkpoint's "
                     f"{saved['max_staleness']} (their segments end elsewhere)"
                     if self.partial_rollouts else "with ppo.partial_rollouts off")
        placement, now = saved.get("placement", "colocated"), self.run.cfg.ppo.placement
        if placement != now and dist.is_main():  # the same training ranks: nothing is redone
            log.info("resumed a checkpoint of ppo.placement = %s with ppo.placement = %s on the "
                     "same %d training rank(s): its buffered rollouts (iterations %s) and random "
                     "streams carry over, nothing is regenerated", placement, now,
                     dist.world_size(), sorted(self.buffer) or "none")


def _kept(buffered: Buffered) -> Buffered | None:
    """`buffered` as a checkpoint keeps it: a failed reward call is not kept (the resumed run
    calls the fixed reward again), nor episodes whose environment failed (generated again)."""
    if buffered.env_error is not None:
        return None
    if buffered.called is not None and buffered.called.error is not None:
        return replace(buffered, called=None)
    return buffered


def _fault_point(params: dict[str, torch.Tensor], sums: dict[str, int], version: int) -> None:
    """Fault injection for the tests: DS_PPO_FAULT=corrupt_sync:N changes one element of the
    first weight the sync of policy version N copied into the replica (`params`; a LoRA
    policy's first merged layer after the first sync), as a bad transfer would."""
    if os.environ.get("DS_PPO_FAULT", "") == f"corrupt_sync:{version}":
        with torch.no_grad():
            params[next(iter(sums))].view(-1)[0] += 1.0
