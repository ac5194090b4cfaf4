"""Scoring: policy/reference log-probs, values and reward scores for a rollout (this rank's shard,
in micro-batches). The advantages that follow are `ppo/advantages.py`."""
from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable

import torch

from ds_ppo import abandon, watchdog
from ds_ppo.config import Config
from ds_ppo.containers import Experience, Rollout, in_row_order
from ds_ppo.engine import dist
from ds_ppo.errors import RewardError, RewardFunctionError, RewardTimeout, UserError
from ds_ppo.ppo.batching import Batching, batching, is_split, model_micro_batches
from ds_ppo.ppo.correction import sampler_logprobs
from ds_ppo.redaction import redact_url
from ds_ppo.rewards.call import MESSAGES, call_reward_function, takes_messages


def _micro_batches(rollout: Rollout, size: int) -> tuple[list[list[int]], list[int]]:
    """The scoring micro-batches of `size` rows (row indices, longest rows first) and their rows
    one after another (for `in_row_order`)."""
    batches = rollout.micro_batches(size)
    return batches, [i for rows in batches for i in rows]


@dataclass
class RewardCall:
    """What one call of the reward function or service on this rank's rows gave (no collective
    yet: `_function_scores` agrees on it across ranks)."""

    scores: list[float]  # one per row ([] after an error)
    # RewardFunctionError, RewardTimeout, RewardServiceError, ...; abandon.Abandoned: SIGTERM
    error: UserError | abandon.Abandoned | None
    seconds: float  # this rank's wall-clock time for the call
    retries: int | None = None  # reward.url: requests retried (None: counted at scoring)


def call_reward(rollout: Rollout, fn, s: RewardCallSettings, in_worker: bool = False
                ) -> RewardCall:
    """reward.function (or reward.url) on this rank's rows (`call_reward_function`: checked,
    with a timeout), its error caught. `in_worker`: called from ppo.schedule's background
    worker, which must not touch the watchdog (the training thread reports its phases)."""
    return call_reward_rows(list(rollout.prompts), list(rollout.responses), rollout.extras, fn,
                            s, in_worker, rollout.messages)


@dataclass(frozen=True)
class RewardCallSettings:
    """What one call of reward.function / reward.url reads from the config."""

    reward_keys: tuple[str, ...]  # data.reward_keys: the dataset columns handed to the reward
    spec: str  # reward.function, or reward.url with its credentials hidden (for messages)
    service: bool  # reward.url (else reward.function)
    timeout_s: float | None  # a function's per-call limit (a service applies its own)
    unlimited: bool  # reward.timeout_s null: never stopped, by the watchdog neither
    concurrency: int  # reward.concurrency: calls at once (reward.stream)
    stream: bool  # reward.stream: calls start as the responses finish decoding


def reward_call_settings(cfg: Config) -> RewardCallSettings:
    r = cfg.reward
    # a reward.url service applies reward.timeout_s per request (then retries) itself: no worker
    # thread around it; its answers are checked like a function's
    return RewardCallSettings(tuple(cfg.data.reward_keys), r.function or redact_url(r.url),
                              r.url is not None, None if r.url is not None else r.timeout_s,
                              r.timeout_s is None, r.concurrency, r.stream)


def call_reward_rows(prompts: list[str], responses: list[str], extras: list[dict], fn,
                     s: RewardCallSettings, in_worker: bool = False,
                     messages: list | None = None) -> RewardCall:
    """`call_reward` on rows given as texts and their dataset rows (`extras`); `messages`: each
    row's chat (None: plain-text prompts), for a function that takes `messages`."""
    columns = {k: [e[k] for e in extras] for k in s.reward_keys}
    if MESSAGES not in columns and takes_messages(fn):  # a reward_keys column of that name wins
        columns[MESSAGES] = list(messages) if messages is not None else [None] * len(prompts)
    exempt = {"limit_s": None} if s.unlimited else {}
    t0 = time.perf_counter()
    try:
        with nullcontext() if in_worker else watchdog.phase("reward call", **exempt):
            scores = call_reward_function(fn, s.spec, prompts, responses, columns, s.timeout_s)
        return RewardCall(scores, None, time.perf_counter() - t0)
    except (UserError, abandon.Abandoned) as e:  # agreed on across ranks (`_function_scores`)
        return RewardCall([], e, time.perf_counter() - t0)


def _function_scores(rollout: Rollout, fn, s: RewardCallSettings, call: bool = True,
                     called: RewardCall | None = None) -> list[float]:
    """reward.function on this rank's rows (`call_reward`, or what it gave already: `called`);
    [] without `call` (a sequence-parallel group's other ranks: its first rank's scores reach
    them). Collective: the ranks agree on the outcome, so a function that fails or hangs on one
    rank stops every rank alike (a timeout anywhere is a RewardTimeout everywhere; a call given
    up on SIGTERM anywhere is abandon.Abandoned everywhere, also on ranks that got no signal)."""
    error, scores = None, []
    if called is None and call:
        called = call_reward(rollout, fn, s)
    if called is not None:
        error, scores = called.error, called.scores
    stopped = isinstance(error, abandon.Abandoned)
    code = (3.0 if stopped else 2.0 if isinstance(error, RewardTimeout)
            else 1.0 if error is not None else 0.0)
    worst = float(dist.all_reduce_max(torch.tensor([code], dtype=torch.float64)))
    if worst == 3.0:
        raise error if stopped else abandon.elsewhere("reward call")
    if worst == 2.0:  # every rank raises a RewardTimeout: the trainer's checkpoint is collective
        failed = dist.first_failure(error if isinstance(error, RewardTimeout) else None)
        raise error if isinstance(error, RewardTimeout) else RewardTimeout(
            f"on rank {failed[0]}: {failed[1]}")
    if worst == 1.0:
        failed = dist.first_failure(error)  # a rank that did not fail names the one that did
        if isinstance(error, RewardError):  # every rank raises one: the checkpoint is collective
            raise error
        out = RewardFunctionError(str(error) if error is not None else
                                  f"on rank {failed[0]}: {failed[1]}")
        if error is None and failed[2] is not None:
            out.fix = failed[2]
        raise out
    return scores


@dataclass(frozen=True)
class RewardSettings:
    """What a rollout's reward scores read from the config (`reward_scores`)."""

    call: RewardCallSettings  # reward.function / reward.url
    micro_batch_size: int  # a reward model's rows per forward (ppo.score_micro_batch_size)
    missing_eos_penalty: float | None  # reward.missing_eos_penalty: off a response without EOS


def reward_settings(cfg: Config) -> RewardSettings:
    """`reward_scores`' settings from the config."""
    p = cfg.ppo
    return RewardSettings(reward_call_settings(cfg),
                          p.score_micro_batch_size or p.micro_batch_size,
                          cfg.reward.missing_eos_penalty)


def reward_scores(rollout: Rollout, engines, s: RewardSettings, reward_encode,
                  called: RewardCall | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(B,) float32 sequence scores from the reward function or model, with the missing-EOS
    penalty applied (clipping happens in shape_rewards); and, for a reward model, (B,) bool: the
    rows whose input lost the start of its prompt to reward.max_len (None for a function).
    `called`: the reward function's call on these rows, made already (`call_reward`)."""
    device = rollout.prompt_ids.device
    cut = None
    if engines.reward_fn is None and engines.reward is None:  # an env's turn rewards are all
        scores = torch.zeros(len(rollout), dtype=torch.float32, device=device)
    elif engines.reward_fn is not None:  # called once per sequence-parallel group
        scores = torch.tensor(_function_scores(rollout, engines.reward_fn, s.call,
                                               call=dist.is_sp_leader(), called=called),
                              dtype=torch.float32, device=device)
    else:
        batches, order = _micro_batches(rollout, s.micro_batch_size)
        parts, cuts = [], []
        for k, rows in enumerate(batches):
            watchdog.progress(k)
            ids, am, part_cut = reward_encode(rollout.slice(rows))
            parts.append(engines.reward.scores(ids.to(device), am.to(device)))
            cuts.append(part_cut.to(device))
        scores = in_row_order(torch.cat(parts), order)
        cut = in_row_order(torch.cat(cuts), order)
    # a sequence-parallel group's ranks hold the same rows: its first rank's scores on all
    scores = dist.broadcast_in_sp_group(scores, device)
    if s.missing_eos_penalty is not None:
        scores = scores - s.missing_eos_penalty * (~rollout.ended).float()
    return scores, cut


@dataclass
class RewardScores:
    """A rollout's reward scores (`reward_scores`) with what they cost (metrics only)."""

    scores: torch.Tensor  # (B,) float32, after the missing-EOS penalty
    cut: torch.Tensor | None  # (B,) bool, reward-model input cut to reward.max_len (None: a function)
    seconds: float  # this rank's wall-clock time for them
    retries: int | None  # reward.url: requests retried for them


def timed_reward_scores(rollout: Rollout, engines, s: RewardSettings, reward_encode,
                        called: RewardCall | None = None) -> RewardScores:
    """`reward_scores`, timed, with the reward service's retries counted. `called`: the reward
    function's call made already (its time counts, the agreement's adds to it)."""
    retries = getattr(engines.reward_fn, "retries", None)  # a RewardService counts them
    t0 = time.perf_counter() - (called.seconds if called is not None else 0.0)
    scores, cut = reward_scores(rollout, engines, s, reward_encode, called)
    if scores.is_cuda:
        torch.cuda.synchronize()  # the reward model's forwards run asynchronously
    seconds = time.perf_counter() - t0
    if called is not None and called.retries is not None:  # counted where it was called
        retries = called.retries
    elif retries is not None:
        retries = engines.reward_fn.retries - retries
    return RewardScores(scores, cut, seconds, retries)


@dataclass(frozen=True)
class ScoringSettings:
    """Everything step 2's model forwards read from the config."""

    temperature: float  # generation.temperature: the log-probs' softmax
    old_from_rollout: bool  # ppo.old_logprobs = rollout: the sampler's, no policy forward
    plan: Batching  # micro-batches (ppo.score_micro_batch_size, ppo.micro_batch_tokens)
    tiled_logits: bool | str  # ppo.tiled_logits (auto, true, false)
    logits_tile_tokens: int  # ppo.logits_tile_tokens


def scoring_settings(cfg: Config) -> ScoringSettings:
    """Step 2's settings from the config (the reward's are `reward_settings`')."""
    p = cfg.ppo
    return ScoringSettings(cfg.generation.temperature, p.old_logprobs == "rollout", batching(cfg),
                           p.tiled_logits, p.logits_tile_tokens)


@torch.no_grad()
def score(rollout: Rollout, engines, s: ScoringSettings,
          rewards: Callable[[], RewardScores]) -> Experience:
    """Log-probs (policy, reference, a distillation teacher), values and scores, micro-batch by
    micro-batch. Every rank runs the same number of forwards of each ZeRO-3 engine (equal shard
    sizes; packed by ppo.micro_batch_tokens or with rows split across a sequence-parallel group,
    idle micro-batches make up the difference). `rewards()`, called after the model forwards: the
    rollout's reward scores (`timed_reward_scores`, taking the outcome of the calls that
    reward.stream started as generation finished the responses, or scores known already:
    ppo.dynamic_sampling chose its groups by them)."""
    temp = s.temperature
    critic = engines.value  # None with a critic-free estimator
    # ppo.old_logprobs=rollout: the sampler's log-probs (the config checks make them the
    # policy's own distribution's) and no policy forward
    sampled = (sampler_logprobs(rollout, "old_logprobs", "rollout", "training")
               if s.old_from_rollout else None)
    engines.policy.eval()
    if critic is not None:
        critic.eval()
    plan = s.plan
    batches, order, mine = model_micro_batches(rollout, plan)
    packed = plan.micro_batch_tokens is not None
    tiling = {"tiled": s.tiled_logits, "tile_tokens": s.logits_tile_tokens}
    logp, ref_logp, values, entropy = [], [], [], []
    teacher_logp, top1 = [], []  # on-policy distillation's teacher (empty without one)
    reference, teacher = engines.reference, engines.teacher
    engines.policy.take_route_flips()  # counted from here: the scoring forwards' own
    for k, rows in enumerate(batches):
        watchdog.progress(k)
        mb = rollout.slice(rows)
        split = is_split(rollout, plan, rows)  # one row across the sequence-parallel group
        if sampled is None:
            lp, ent = engines.policy.logprobs(mb, temp, with_entropy=True, packed=packed,
                                              split=split, **tiling)
            logp.append(lp)
            entropy.append(ent)
        # the reference's softmax without top-k / top-p (forward.logit_shape says why)
        if reference is not None:
            ref_logp.append(reference.logprobs(mb, temp, packed=packed, split=split,
                                               truncate=False, **tiling)[0])
        if teacher is not None:  # the same softmax of the teacher, and its top-1 matches
            lp, match = teacher.scores(mb, temp, packed=packed, split=split, **tiling)
            teacher_logp.append(lp)
            top1.append(match)
        if critic is not None:
            values.append(critic.values(mb, packed=packed, split=split))
    del logp[mine:], ref_logp[mine:], values[mine:], entropy[mine:]  # idle micro-batches
    del teacher_logp[mine:], top1[mine:]
    flips = engines.policy.take_route_flips()  # idle repeats too: a share, it barely moves
    engines.policy.train()
    if critic is not None:
        critic.train()
    mask = rollout.mask

    def zero(parts):  # row order, 0 at masked positions
        return in_row_order(torch.cat(parts), order).masked_fill(~mask, 0.0)

    scored = rewards()
    old = zero(logp) if sampled is None else sampled.masked_fill(~mask, 0.0)
    # no reference (distillation without a KL loss): the policy's own, a KL of 0
    ref = zero(ref_logp) if reference is not None else old
    # a top-1 share only where every micro-batch could read the teacher's logits (a row split
    # across a sequence-parallel group cannot)
    matches = zero(top1) if top1 and all(m is not None for m in top1) else None
    return Experience(rollout=rollout, old_logprobs=old, ref_logprobs=ref,
                      teacher_logprobs=zero(teacher_logp) if teacher is not None else None,
                      teacher_top1=matches,
                      old_values=zero(values) if values else None,
                      entropy=zero(entropy) if sampled is None else None,
                      scores=scored.scores, reward_cut=scored.cut, reward_s=scored.seconds,
                      reward_retries=scored.retries,
                      scoring_positions=rollout.positions(batches, packed, mine),
                      route_flips=flips)
