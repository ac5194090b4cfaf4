"""Dynamic sampling with refill (ppo.dynamic_sampling; DAPO, Yu et al. 2025, "DAPO: An
Open-Source LLM Reinforcement Learning System at Scale", Sec. 3.2): generate rounds of prompts
until the batch holds rollout_batch_size prompts whose ppo.samples_per_prompt responses do not
all score alike. A group whose scores are equal has advantage 0 under every group baseline: it
costs a forward and a backward and teaches nothing; the refill keeps the batch full of groups
that do.

Round k of an iteration draws the next rollout_batch_size prompts of the sampler's stream
(position `PromptDraw.start` + k x rollout_batch_size, the position saved in the trainer state),
laid out over the data-parallel ranks as an iteration's are. After each round the ranks
exchange which of their groups carry signal (one all-gather of B / W booleans), so every rank
knows the same list in stream order. The batch is the first rollout_batch_size groups with
signal in stream order (then, when ppo.dynamic_sampling_max_rounds ran out, the earliest
without: they weigh nothing in a group estimator's update); the prompts drawn but not taken are
dropped. The chosen groups are laid out over the ranks again as the sampler lays out an
iteration (`slot`), so each PPO mini-batch holds the same groups at any world size; a group
generated on another rank than the one that trains it travels in one all-gather of objects.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ds_ppo.algo import group_score_stats
from ds_ppo.config import Config
from ds_ppo.containers import Rollout, concat_rollouts
from ds_ppo.engine import dist
from ds_ppo.engine.generation import Generated
from ds_ppo.metrics import Accumulator
from ds_ppo.ppo.rollout import generation_metrics
from ds_ppo.ppo.scoring import RewardScores


@dataclass(frozen=True)
class RefillSettings:
    """Everything the refill reads from the config."""

    samples_per_prompt: int  # ppo.samples_per_prompt: the responses of a group
    rollout_batch_size: int  # prompts of the batch (and of each round)
    mini_batch_size: int  # ppo.mini_batch_size (responses): the sampler's layout
    max_rounds: int  # ppo.dynamic_sampling_max_rounds


def refill_settings(cfg: Config) -> RefillSettings:
    """The refill's settings from the config."""
    p = cfg.ppo
    return RefillSettings(p.samples_per_prompt, p.rollout_batch_size, p.mini_batch_size,
                          p.dynamic_sampling_max_rounds)


@dataclass
class PromptDraw:
    """Where an iteration's rounds take their prompts: the sampler's stream from `start` (a
    count of prompts), rollout_batch_size per round. `rounds` counts the rounds drawn."""

    sampler: object  # data.sampler.PromptSampler
    start: int
    rounds: int = 0

    def indices(self, k: int) -> list[int]:
        """This rank's prompt indices of round `k` (0-based)."""
        self.rounds = max(self.rounds, k + 1)
        return self.sampler.indices_at(self.start + k * self.sampler.global_batch_size)

    @property
    def end(self) -> int:
        """The stream position after the rounds drawn: where the next iteration starts."""
        return self.start + self.rounds * self.sampler.global_batch_size


def position(rank: int, i: int, share: int, chunk: int) -> int:
    """The place in the round's stream slice of data-parallel rank `rank`'s i-th prompt: the
    sampler gives each rank `share` consecutive prompts of every `chunk` (PPO mini-batch)."""
    return (i // share) * chunk + rank * share + i % share


def slot(j: int, share: int, chunk: int) -> tuple[int, int]:
    """The (rank, row-group index) that the j-th prompt of a batch sits at (inverse of
    `position`)."""
    c, q = divmod(j, chunk)
    return q // share, c * share + q % share


def choose_groups(signal: list[list[bool]], batch: int) -> list[tuple[int, int]]:
    """The batch's groups as (round, position): the first `batch` with signal in draw order,
    then, if fewer, the earliest without.

    Args:
        signal: signal[k][p]: round k's prompt at stream position p has responses that do not
            all score alike.
        batch: rollout_batch_size.
    """
    drawn = [(k, p) for k, flags in enumerate(signal) for p in range(len(flags))]
    spread = [kp for kp in drawn if signal[kp[0]][kp[1]]]
    flat = [kp for kp in drawn if not signal[kp[0]][kp[1]]]
    return (spread + flat)[:batch]


@dataclass
class _Round:
    rollout: Rollout
    rewards: RewardScores


def refill(s: RefillSettings, draw: PromptDraw,
           generate: Callable[[list[int]], tuple[Rollout, Generated]],
           reward: Callable[[Rollout], RewardScores], pad_id: int, acc: Accumulator
           ) -> tuple[Rollout, Generated, RewardScores]:
    """This rank's rollout of the iteration (in the sampler's layout), its reward scores and the
    first round's generation output, after as many rounds as it took (module docstring).
    Collective over the data-parallel group; `generate(indices)` makes one round's rollout,
    `reward(rollout)` scores it (`scoring.timed_reward_scores`). Adds sampling/* (and each
    round's generation) metrics to `acc`."""
    n, batch = s.samples_per_prompt, s.rollout_batch_size
    world, me = dist.dp_world_size(), dist.dp_rank()
    chunk = s.mini_batch_size // n  # prompts per PPO mini-batch: the sampler's group size
    share = chunk // world
    rounds: list[_Round] = []
    signal: list[list[bool]] = []
    first_generated = None
    for k in range(s.max_rounds):
        rollout, generated = generate(draw.indices(k))
        generation_metrics(rollout, generated, acc)
        first_generated = first_generated or generated
        rewards = reward(rollout)
        rounds.append(_Round(rollout, rewards))
        episode = rewards.scores if rollout.turn_rewards is None else \
            rewards.scores + rollout.turn_rewards.sum(dim=1)
        _, constant = group_score_stats(episode, n)
        flags = [not c for c in constant.tolist()]
        round_signal = [False] * batch
        for rank, theirs in enumerate(dist.gather_objects(flags, data_parallel=True)):
            for i, f in enumerate(theirs):
                round_signal[position(rank, i, share, chunk)] = f
        signal.append(round_signal)
        if sum(map(sum, signal)) >= batch:
            break
    chosen = choose_groups(signal, batch)
    kept = sum(map(sum, signal))
    acc.add_replicated("sampling/rounds", float(len(rounds)))
    acc.add_replicated("sampling/prompts_drawn", float(len(rounds) * batch))
    acc.add_replicated("sampling/kept_frac", kept / (len(rounds) * batch))
    acc.add_replicated("sampling/filled_frac", max(batch - kept, 0) / batch)
    rollout, rewards = _lay_out(chosen, rounds, me, share, chunk, n, pad_id)
    return rollout, first_generated, rewards


def _rows(r: _Round, i: int, n: int) -> tuple[Rollout, RewardScores]:
    """Row group i (its n responses) of a round."""
    rows = list(range(i * n, (i + 1) * n))
    w = r.rewards
    return r.rollout.slice(rows), RewardScores(
        w.scores[rows], None if w.cut is None else w.cut[rows], 0.0, None)


def _lay_out(chosen: list[tuple[int, int]], rounds: list[_Round], me: int, share: int,
             chunk: int, n: int, pad_id: int) -> tuple[Rollout, RewardScores]:
    """This rank's groups of the batch `chosen`, in the sampler's layout: its own from its
    rounds, the others' through one all-gather (only the groups that change rank travel)."""
    where = {}  # (round, position) -> this rank's row-group index in that round
    for k, r in enumerate(rounds):
        for i in range(len(r.rollout) // n):
            where[(k, position(me, i, share, chunk))] = i
    mine: dict[int, tuple[Rollout, RewardScores]] = {}  # row-group index in the batch -> rows
    outgoing = []
    for j, (k, pos) in enumerate(chosen):
        if (k, pos) not in where:
            continue
        to, index = slot(j, share, chunk)
        rows = _rows(rounds[k], where[(k, pos)], n)
        if to == me:
            mine[index] = rows
        else:
            outgoing.append((to, index, rows))
    device = rounds[0].rewards.scores.device
    for sent in dist.exchange_objects(outgoing, device):
        for to, index, rows in sent:
            if to == me:
                mine[index] = rows
    parts = [mine[i] for i in range(len(mine))]
    rollout = concat_rollouts([r for r, _ in parts], pad_id)
    cuts = [w.cut for _, w in parts]
    return rollout, RewardScores(
        torch.cat([w.scores for _, w in parts]),
        None if cuts[0] is None else torch.cat(cuts),
        sum(r.rewards.seconds for r in rounds),
        None if rounds[0].rewards.retries is None else sum(r.rewards.retries for r in rounds))
