"""What generates ppo.schedule's rollouts, with no collective (docs/ASYNC.md): `RolloutWorker`
decodes on a replica from a random stream it is handed and calls the reward function; the
colocated placement runs it in a background thread of every rank (ppo/schedule.py), the split
placement on the generation ranks (ppo/split.py). Also the containers of what it gives back and
the line a failed weight sync stops the run with."""
from __future__ import annotations

import time
from types import SimpleNamespace
from concurrent.futures import Future
from dataclasses import dataclass, field, replace

import torch

from ds_ppo.containers import Rollout
from ds_ppo.engine.generation import Generated
from ds_ppo.envs.base import EnvFailed
from ds_ppo.errors import UserError
from ds_ppo.ppo.episodes import EpisodeStats, episode_settings, make_episodes
from ds_ppo.ppo.partial import Partial, continue_partial, partial_rollout, start_partial
from ds_ppo.ppo.reward_stream import RewardStream, reward_stream
from ds_ppo.ppo.rollout import (replica_rollout, rollout_settings, stamp_versions,
                                watch_responses)
from ds_ppo.ppo.scoring import RewardCall, call_reward, reward_call_settings
from ds_ppo.thread_pools import shared_pool


class WeightSyncError(UserError):
    """The generation replica's weights differ from the policy's after a weight sync."""


@dataclass
class Buffered:
    """One rollout generated ahead of the iteration that trains on it (this rank's rows)."""

    iteration: int  # the iteration (1-based) that trains on it
    version: int  # policy version (optimizer updates applied) of the weights that generated it
    rollout: Rollout | None  # None: its episodes' environment failed (env_error)
    generated: Generated | None  # the decoding loop's output (no replica)
    # the reward function's call on it (None: a reward model, or a failed call saved in a
    # checkpoint: scoring calls the reward)
    called: RewardCall | None
    seconds: float  # worker time to generate it plus its reward call's
    episodes: EpisodeStats | None = None  # env: its episodes' statistics (metrics env/*)
    env_error: EnvFailed | None = None  # env: this rank's environment failure (agreed on take)


@dataclass
class Batch:
    """What the worker gave back for one `rollout_batch`: its rollouts, in iteration order."""

    rollouts: list[Buffered]
    seconds: float  # the worker's wall-clock time for the whole batch
    # ppo.partial_rollouts: the rollouts still decoding after this batch's segments
    partial: list[Partial] = field(default_factory=list)


class RolloutWorker:
    """What generates rollouts, with no collective: decoding on a replica from a random stream
    it is handed (or playing multi-turn episodes with `env`), and the reward function's calls
    on each rollout, streamed as its responses finish (reward.stream). The colocated
    placement's background thread runs it on every rank; under ppo.placement = split a
    generation rank's loop (`serve_generation`) does, for the training ranks it serves."""

    def __init__(self, cfg, prompts, tokenizer, eos_ids: list[int], device: torch.device,
                 reward_fn, lag: int, env=None) -> None:
        self.cfg, self.prompts, self.tokenizer, self.eos_ids = cfg, prompts, tokenizer, eos_ids
        self.device, self.reward_fn, self.env = device, reward_fn, env
        # the settings of what it runs, built once
        self.rollout, self.episodes = rollout_settings(cfg), episode_settings(cfg)
        self.rewards = None if reward_fn is None else reward_call_settings(cfg)
        self.replica: torch.nn.Module | None = None
        # a LoRA policy's frozen base weights of the adapted layers, kept beside the replica at
        # its first weight sync (`build_replica`'s bases); later syncs gather the adapters only
        self.bases: dict[str, torch.Tensor] = {}
        # a batch's reward calls at once: at most max_staleness, bounded by reward.concurrency
        self.reward_pool = shared_pool("reward", max(1, min(lag, cfg.reward.concurrency)))
        # ppo.partial_rollouts: the reward streams of the rollouts decoded in part, by the
        # iteration that trains on each (not saved: a resumed run hands the ended rows in again)
        self.streams: dict[int, RewardStream | None] = {}

    def decode(self, iteration: int, indices: list[int], version: int,
               generator: torch.Generator) -> tuple[Buffered, RewardStream | None]:
        """The rollout of `iteration` (prompts `indices`) on the replica (weights of `version`)
        from `generator`, with its seconds; and the reward stream its responses went to as they
        finished (None: the reward is called on the whole rollout). With an env, its episodes
        (their environment steps here too; a failure is kept for the training thread)."""
        t0 = time.perf_counter()
        if self.env is not None:
            try:  # on the replica, episodes read only the device of the engines
                rollout, gen, stats = make_episodes(
                    self.prompts, indices, SimpleNamespace(device=self.device), self.episodes,
                    self.tokenizer, "gathered", self.eos_ids, self.env,
                    on_replica=(self.replica, generator))
            except EnvFailed as e:
                return Buffered(iteration, version, None, None, None, time.perf_counter() - t0,
                                env_error=e), None
            return Buffered(iteration, version, stamp_versions(rollout, version),
                            replace(gen, replica=None), None, time.perf_counter() - t0,
                            episodes=stats), None
        stream = reward_stream(self.rewards, self.reward_fn)
        rollout, gen = replica_rollout(self.prompts, indices, self.replica, self.rollout,
                                       self.tokenizer, self.eos_ids, self.device, generator,
                                       stream)
        return Buffered(iteration, version, stamp_versions(rollout, version),
                        replace(gen, replica=None), None, time.perf_counter() - t0), stream

    def call(self, rollout: Rollout | None, stream: RewardStream | None,
             since: float | None = None) -> RewardCall | None:
        """The reward function's call on `rollout`, or the outcome of its streamed calls
        (None: a reward model scores it later, or no rollout: its environment failed); `since`
        (perf_counter): the streamed calls' time counts from then at the earliest."""
        if self.reward_fn is None or rollout is None:
            return None
        if stream is not None:
            return stream.result(rollout, in_worker=True, since=since)
        return call_reward(rollout, self.reward_fn, self.rewards, in_worker=True)

    def produce(self, iteration: int, indices: list[int], version: int,
                generator: torch.Generator) -> Buffered:
        """The rollout of `iteration` (prompts `indices`) on the replica (weights of `version`),
        its reward function called, on the calling thread."""
        got, stream = self.decode(iteration, indices, version, generator)
        got.called = self.call(got.rollout, stream)
        got.seconds += got.called.seconds if got.called is not None else 0.0
        return got

    def produce_batch(self, work: list[tuple[int, list[int]]], version: int,
                      generator: torch.Generator) -> Batch:
        """The rollouts of `work` ((iteration, prompt indices) pairs) decoded one after another
        from the replica (weights of `version`) and `generator`, so the tokens do not depend on
        timing; each one's reward calls start as its responses finish (reward.stream), or its
        one call in the reward pool as its decoding ends."""
        t0 = time.perf_counter()
        decoded = []
        for j, indices in work:
            got, stream = self.decode(j, indices, version, generator)
            decoded.append((got, self.reward_pool.submit(self.call, got.rollout, stream)))
        return _collected(decoded, t0)

    def advance(self, work: list[tuple[int, list[int], Partial | None, int]], version: int,
                segments_of: int, generator: torch.Generator) -> Batch:
        """ppo.partial_rollouts: for each (iteration, prompt indices, its `Partial` so far or
        None, the segments of `segments_of` to have decoded) in `work`, in iteration order, the
        next segments decoded on the replica (weights of `version`) from `generator`. Each row's
        reward call starts as its response ends (reward.stream: in whichever segment it ends, so
        the calls of rows that end early overlap the later segments); a rollout at its last
        segment comes back buffered once its calls have returned, version = that of its first
        segment; the others (rows all ended or not) come back as `Batch.partial`."""
        t0 = time.perf_counter()
        g, pad_id = self.rollout.generation, self.tokenizer.pad_token_id
        streams, self.streams = self.streams, {}
        decoded, partial = [], []
        for j, indices, part, segments in work:
            t1 = time.perf_counter()
            if part is None:
                part = start_partial(j, indices, self.rollout.samples_per_prompt,
                                     g.max_new_tokens, pad_id, self.device)
                streams.pop(j, None)
            if j not in streams:  # its first segment, or the first after a resume
                streams[j] = self._partial_stream(part)
            stream = streams[j]
            continue_partial(part, segments, segments_of, self.replica, self.prompts, g,
                             self.eos_ids, pad_id, version, generator,
                             self._watch(stream, part))
            part.seconds += time.perf_counter() - t1
            # one whose rows have all ended before its last segment waits for it: its calls run
            # on beside the iterations in between
            if not part.finished or segments < segments_of:
                partial.append(part)
                self.streams[j] = stream
                continue
            rollout, gen = partial_rollout(part, self.prompts, g, self.tokenizer, self.eos_ids)
            got = Buffered(j, part.first_version, rollout, gen, None, part.seconds)
            decoded.append((got, self.reward_pool.submit(self.call, rollout, stream, t1)))
        return _collected(decoded, t0, partial)

    def _partial_stream(self, part: Partial) -> RewardStream | None:
        """A reward stream for the rollout `part` (None: the reward is called on the whole
        rollout), its rows ended already handed in (a `Partial` from a checkpoint: the calls in
        flight when it was saved are made again; a function scoring each response on its own
        gives the same scores)."""
        stream = reward_stream(self.rewards, self.reward_fn)
        ended = (~part.live).nonzero().flatten().tolist() if part.tokens else []
        if stream is not None and ended:
            self._watch(stream, part)(ended, part.response_ids[ended, :part.tokens].tolist())
        return stream

    def _watch(self, stream: RewardStream | None, part: Partial):
        """The `on_done(rows, tokens)` that hands `part`'s final responses to `stream` (None:
        none)."""
        return watch_responses(stream, self.prompts, part.indices,
                               [self.prompts.input_ids[i] for i in part.indices], self.tokenizer,
                               self.eos_ids)


def _collected(decoded: list[tuple[Buffered, Future]], t0: float,
               partial: list[Partial] | None = None) -> Batch:
    """A batch's rollouts, each with its reward call's outcome (`decoded`: (rollout, the call in
    the reward pool)) and seconds, in order; `t0`: when the batch started."""
    for got, call in decoded:
        got.called = call.result()
        got.seconds += got.called.seconds if got.called is not None else 0.0
    return Batch([got for got, _ in decoded], time.perf_counter() - t0, partial or [])


def sync_error(version: int, bad: str | None, where: str = "the generation replica"
               ) -> WeightSyncError:
    """The one line a failed weight sync stops the run with."""
    return WeightSyncError(
        f"weight sync of policy version {version} into {where} failed its checksum "
        f"({bad or 'on another rank, or the ranks differ'}): stopped; the engines' weights are "
        "intact, run the same command again to resume")
