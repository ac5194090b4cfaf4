"""The named choices of the PPO math, one table each: advantage estimators, policy losses, KL
estimators, loss aggregations, rollout corrections, old log-prob sources (and the preference
losses of `ds-ppo dpo`, with `algo/preference.py`). The config's literal types, its checks,
`ds-ppo config --describe`, the advantage stage, the update and the README's tables all read
these tables (tests tie them together), so a new estimator is one row
here plus one registered function in `algo/estimators.py`, and a new policy loss one row here
plus one registered function in `algo/policy_losses.py`.

Imports no torch: the config reads this module, and `--dry-run` must stay quick.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

# what ppo.entropy_target is compared with (algo/entropy.py): the mean token entropy (the
# coefficient follows it) or each token's entropy (a weight per token in the bonus)
EntropyScope = Literal["mean", "token"]

KLEstimator = Literal["k1", "k2", "k3"]
KL_ESTIMATORS: tuple[str, ...] = get_args(KLEstimator)

LossAggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
LOSS_AGGREGATIONS: tuple[str, ...] = get_args(LossAggregation)

# ppo.rollout_correction (algo/importance_sampling.py): none, truncated or masked importance sampling
RolloutCorrection = Literal["none", "tis", "mis"]
ROLLOUT_CORRECTIONS: tuple[str, ...] = get_args(RolloutCorrection)

# ppo.old_logprobs: where the PPO ratio's old log-probs come from: a scoring forward of the
# policy (training) or the sampler's own log-probs (rollout), which skips that forward
OldLogprobs = Literal["training", "rollout"]
OLD_LOGPROBS: tuple[str, ...] = get_args(OldLogprobs)


@dataclass(frozen=True)
class EstimatorSpec:
    """One advantage estimator (`ppo.advantage_estimator`)."""

    name: str
    baseline: str  # what a response is compared against (README's table)
    critic: bool  # trains a value model
    groups: bool  # compares the responses to one prompt: needs ppo.samples_per_prompt >= 2
    kl_in_reward: bool  # default of ppo.kl_in_reward (False: the KL goes in the loss)
    paper: str
    # one advantage per response, the same on all its tokens (what a sequence-level policy
    # loss weighs a response by)
    per_response: bool = False
    # scores every sampled token with a teacher model (the `teacher` section; on-policy
    # distillation): needs teacher.path, and a teacher is only read by such an estimator
    teacher: bool = False


ESTIMATORS: dict[str, EstimatorSpec] = {s.name: s for s in (
    EstimatorSpec("gae", "a learned critic, GAE", critic=True, groups=False, kl_in_reward=True,
                  paper="Schulman et al. 2016, High-Dimensional Continuous Control Using GAE"),
    EstimatorSpec("grpo", "the group's mean score, divided by its std", critic=False, groups=True,
                  kl_in_reward=False, paper="Shao et al. 2024, DeepSeekMath, Sec. 4.1.2",
                  per_response=True),
    EstimatorSpec("dr_grpo", "the group's mean score", critic=False, groups=True,
                  kl_in_reward=False,
                  paper="Liu et al. 2025, Understanding R1-Zero-Like Training, Sec. 3.2",
                  per_response=True),
    EstimatorSpec("rloo", "the mean score of the group's other responses", critic=False,
                  groups=True, kl_in_reward=True,
                  paper="Ahmadian et al. 2024, Back to Basics, Eq. 5", per_response=True),
    EstimatorSpec("reinforce_pp", "none: discounted KL-shaped returns whitened over the global "
                  "batch", critic=False, groups=False, kl_in_reward=True,
                  paper="Hu 2025, REINFORCE++, Sec. 3"),
    EstimatorSpec("distill", "none: the teacher's log-prob of each sampled token less the "
                  "student's (sampled reverse KL), plus distill.reward_coef x a group "
                  "advantage of the reward", critic=False, groups=False, kl_in_reward=False,
                  paper="Agarwal et al. 2024, On-Policy Distillation of Language Models (GKD); "
                  "Lu and Thinking Machines 2025, On-Policy Distillation", teacher=True),
)}

# the config's literal type, from the table (pydantic validates against it)
EstimatorName = Literal[tuple(ESTIMATORS)]  # type: ignore[valid-type]


def _row(table: dict, kind: str, name: str):
    """`table`'s row of `name`; ValueError naming the valid ones (`kind`: what the table holds)."""
    try:
        return table[name]
    except KeyError:
        raise ValueError(f"unknown {kind} {name!r}; valid: {', '.join(table)}") from None


def estimator(name: str) -> EstimatorSpec:
    """The table row of `name`; ValueError naming the valid ones."""
    return _row(ESTIMATORS, "advantage estimator", name)


def describe_estimators() -> str:
    """One sentence per estimator, for the config key's description."""
    return "; ".join(f"{s.name}: baseline {s.baseline}"
                     f"{', value model' if s.critic else ''}"
                     f"{', samples_per_prompt >= 2' if s.groups else ''}"
                     f"{', a teacher (teacher.path)' if s.teacher else ''} ({s.paper})"
                     for s in ESTIMATORS.values())


@dataclass(frozen=True)
class PolicyLossSpec:
    """One policy loss (`ppo.policy_loss`): the objective the policy's update minimises."""

    name: str
    what: str  # the ratio it bounds and how (the README's table)
    clips: str  # where it clips, the level of its clip fraction: token, sequence or none
    # the ppo.loss_aggregation modes its objective is defined with; the first is its default
    aggregations: tuple[str, ...]
    # weighs each response by one advantage: needs an estimator with per_response
    per_response: bool
    # ppo.rollout_correction (tis, mis) may weight or drop its per-token terms
    token_correction: bool
    settings: tuple[str, ...]  # the ppo.* keys it reads (its clip or gate)
    paper: str


_SEQ = ("seq_mean_token_mean",)
POLICY_LOSSES: dict[str, PolicyLossSpec] = {s.name: s for s in (
    PolicyLossSpec("ppo", "each token's ratio pi / pi_old clipped to [1 - clip_eps, 1 + "
                   "clip_eps_high], with an optional dual clip", "token", LOSS_AGGREGATIONS,
                   per_response=False, token_correction=True,
                   settings=("clip_eps", "clip_eps_high", "dual_clip"),
                   paper="Schulman et al. 2017, Proximal Policy Optimization, Eq. 7"),
    PolicyLossSpec("gspo", "the response's ratio (pi / pi_old)^(1 / |y|), the geometric mean "
                   "of its token ratios, clipped per response to [1 - gspo_clip_eps, 1 + "
                   "gspo_clip_eps_high]", "sequence", _SEQ, per_response=True,
                   token_correction=False, settings=("gspo_clip_eps", "gspo_clip_eps_high"),
                   paper="Zheng et al. 2025, Group Sequence Policy Optimization"),
    PolicyLossSpec("gspo_token", "GSPO's response ratio on every token (its value, each token's "
                   "own gradient), clipped per token, so token advantages apply", "token", _SEQ,
                   per_response=False, token_correction=False,
                   settings=("gspo_clip_eps", "gspo_clip_eps_high"),
                   paper="Zheng et al. 2025, Group Sequence Policy Optimization, GSPO-token"),
    PolicyLossSpec("cispo", "REINFORCE on every token, its log-prob weighted by its ratio "
                   "clipped to [1 - cispo_eps_low, 1 + cispo_eps_high] and held constant: no "
                   "token loses its gradient", "token",
                   ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"),
                   per_response=False, token_correction=True,
                   settings=("cispo_eps_low", "cispo_eps_high"),
                   paper="MiniMax 2025, MiniMax-M1, Sec. 3.1 (CISPO)"),
    PolicyLossSpec("gmpo", "the geometric mean of the token ratios, each token's log-ratio "
                   "clipped to +-gmpo_clip_eps on the side the advantage's sign pushes it",
                   "token", _SEQ, per_response=True, token_correction=False,
                   settings=("gmpo_clip_eps",),
                   paper="Zhao et al. 2025, Geometric-Mean Policy Optimization"),
    PolicyLossSpec("sapo", "each token's ratio through a soft gate (4 / tau) sigmoid(tau (r - "
                   "1)) instead of the clip, tau = sapo_tau_pos or sapo_tau_neg by the "
                   "advantage's sign", "none",
                   ("seq_mean_token_mean", "token_mean", "seq_mean_token_sum_norm"),
                   per_response=False, token_correction=True,
                   settings=("sapo_tau_pos", "sapo_tau_neg"),
                   paper="Gao et al. 2025 (Qwen), Soft Adaptive Policy Optimization"),
)}

# the config's literal type, from the table
PolicyLossName = Literal[tuple(POLICY_LOSSES)]  # type: ignore[valid-type]


def policy_loss_spec(name: str) -> PolicyLossSpec:
    """The table row of `name`; ValueError naming the valid ones."""
    return _row(POLICY_LOSSES, "policy loss", name)


def describe_policy_losses() -> str:
    """One sentence per policy loss, for the config key's description."""
    return "; ".join(f"{s.name}: {s.what} ({s.paper})" for s in POLICY_LOSSES.values())


@dataclass(frozen=True)
class PreferenceLossSpec:
    """One preference loss of `ds-ppo dpo` (`dpo.loss`): the objective a policy minimises on
    (chosen, rejected) pairs, with no reward model (algo/preference.py computes it)."""

    name: str
    what: str  # the loss in one line (docs/GUIDE.md's table)
    reference: bool  # reads a frozen reference's log-probs (False: the reference is not built)
    length_normalised: bool  # compares per-token mean log-probs (False: sums over the answer)
    settings: tuple[str, ...]  # the dpo.* keys it reads besides beta
    paper: str


PREFERENCE_LOSSES: dict[str, PreferenceLossSpec] = {s.name: s for s in (
    PreferenceLossSpec("sigmoid", "-log sigmoid(beta h), h = the chosen answer's log-ratio to "
                       "the reference less the rejected one's (summed log-probs); with "
                       "label_smoothing eps the pair's label is flipped with probability eps",
                       reference=True, length_normalised=False, settings=("label_smoothing",),
                       paper="Rafailov et al. 2023, Direct Preference Optimization, Eq. 7; "
                       "label smoothing: Mitchell 2023, conservative DPO"),
    PreferenceLossSpec("ipo", "(h - 1 / (2 beta))^2 with h from per-token mean log-probs: the "
                       "log-ratio gap is pulled to a fixed target instead of pushed to infinity",
                       reference=True, length_normalised=True, settings=(),
                       paper="Azar et al. 2023, A General Theoretical Paradigm to Understand "
                       "Learning from Human Preferences, Eq. 17"),
    PreferenceLossSpec("simpo", "-log sigmoid(beta mean log pi(chosen) - beta mean log "
                       "pi(rejected) - simpo_gamma): length-normalised, no reference model",
                       reference=False, length_normalised=True,
                       settings=("simpo_gamma", "label_smoothing"),
                       paper="Meng et al. 2024, SimPO: Simple Preference Optimization with a "
                       "Reference-Free Reward, Eq. 6"),
)}

# the config's literal type, from the table
PreferenceLossName = Literal[tuple(PREFERENCE_LOSSES)]  # type: ignore[valid-type]


def preference_loss_spec(name: str) -> PreferenceLossSpec:
    """The table row of `name`; ValueError naming the valid ones."""
    return _row(PREFERENCE_LOSSES, "preference loss", name)


def describe_preference_losses() -> str:
    """One sentence per preference loss, for the config key's description."""
    return "; ".join(f"{s.name}: {s.what} ({s.paper})" for s in PREFERENCE_LOSSES.values())


# ppo.schedule: when a rollout is generated relative to the update it feeds (ppo/schedule.py)
Schedule = Literal["sync", "one_step_off", "async"]


@dataclass(frozen=True)
class ScheduleSpec:
    """One rollout schedule (`ppo.schedule`)."""

    name: str
    what: str  # which weights generate iteration j's rollout, and when (docs/ASYNC.md's table)


SCHEDULES: dict[str, ScheduleSpec] = {s.name: s for s in (
    ScheduleSpec("sync", "generated at the start of iteration j with the current weights "
                 "(version j-1), then scored and trained on: on-policy"),
    ScheduleSpec("one_step_off", "generated during iteration j-1's scoring and update with the "
                 "weights iteration j-1 started from (version j-2): every sample one update old"),
    ScheduleSpec("async", "generated N = ppo.max_staleness at a time: the rollouts of "
                 "iterations k+1 .. k+N during iteration k's scoring and update (k = 1, N+1, "
                 "2N+1, ...), all with the weights iteration k started from (version k-1): "
                 "samples 1 to N updates old (N = 0: generated after the update, as sync)"),
)}
SCHEDULE_NAMES: tuple[str, ...] = get_args(Schedule)


# ppo.placement: which ranks generate and which train (docs/ASYNC.md)
Placement = Literal["colocated", "split"]


@dataclass(frozen=True)
class PlacementSpec:
    """One placement (`ppo.placement`)."""

    name: str
    what: str  # what runs where, which process owns which weights


PLACEMENTS: dict[str, PlacementSpec] = {s.name: s for s in (
    PlacementSpec("colocated", "every rank trains (its ZeRO engines) and generates (a background "
                  "worker on a 16-bit replica of its own, beside the training states)"),
    PlacementSpec("split", "the last ppo.generation_ranks ranks only generate (a 16-bit replica, "
                  "no ZeRO engine) and call the reward function; the others only train, their "
                  "ZeRO states partitioned over the training ranks alone"),
)}
PLACEMENT_NAMES: tuple[str, ...] = get_args(Placement)


def training_ranks(placement: str, world_size: int, generation_ranks: int) -> int:
    """Ranks that hold the ZeRO engines and train: the world, or under `split` the world less
    the generation ranks."""
    return world_size - generation_ranks if placement == "split" else world_size


def max_lag(schedule: str, max_staleness: int) -> int:
    """The most updates a sample's weights may lag the weights that train on it: 0 for sync,
    1 for one_step_off, ppo.max_staleness for async (also the rollouts generated per refresh)."""
    return {"sync": 0, "one_step_off": 1}.get(schedule, max_staleness)


def rollout_version(schedule: str, max_staleness: int, iteration: int) -> int:
    """The policy version (optimizer updates applied, 0 = the initial weights) whose weights
    generate the rollout of `iteration` (1-based). Fixed by the schedule, never by timing, so an
    interrupted and resumed run generates every rollout from the same weights.

    sync (or async with max_staleness 0): iteration - 1, the current weights. one_step_off
    (async with max_staleness 1): iteration - 2, the weights the previous iteration started
    from (the first two rollouts both come from the initial weights). async with N >= 1: the
    weights iteration k started from (version k - 1), where k is the iteration whose
    `rollout_batch` holds `iteration`: versions 0, N, 2N, ..., so a sample is 1 to N updates
    old."""
    every = max_lag(schedule, max_staleness)
    if every == 0:
        return iteration - 1
    return max(0, (iteration - 2) // every * every)


def rollout_batch(schedule: str, max_staleness: int, iteration: int) -> range:
    """The iterations whose rollouts are generated beside `iteration`'s scoring and update, in
    one go from the weights `iteration` started from (version iteration - 1; see
    `rollout_version`). one_step_off: the next one. async with N >= 1: at iterations 1, N+1,
    2N+1, ... the next N (their reward calls overlap one another and training), else none.
    sync and async with max_staleness 0: none (the rollout is generated at the iteration's start,
    or after the update)."""
    every = max_lag(schedule, max_staleness)
    if every == 0 or (iteration - 1) % every:
        return range(0)
    return range(iteration + 1, iteration + every + 1)


def partial_plan(max_staleness: int, iteration: int) -> list[tuple[int, int]]:
    """ppo.partial_rollouts (async, N = max_staleness >= 2): beside `iteration` j, from the
    weights j started from (version j - 1), the worker decodes the next segments of the
    rollouts of iterations j + 1 .. j + N. Returns (rollout iteration t, segments of it decoded
    once j's part is done) pairs in iteration order: min(N, j + N + 1 - t). A rollout's N
    segments are therefore decoded beside iterations t - N .. t - 1 (at iteration 1, the
    segments of earlier ones too), each from the weights of that iteration, so a token is 1 to
    N updates old when it trains and its version rises along the response. Fixed by the
    schedule, never by timing."""
    n = max_staleness
    return [(t, min(n, iteration + n + 1 - t)) for t in range(iteration + 1, iteration + n + 1)]


def segment_end(max_new_tokens: int, max_staleness: int, segments: int) -> int:
    """Response tokens decoded once `segments` of a partial rollout's max_staleness segments are
    (ppo.partial_rollouts): the first ceil(s * max_new_tokens / max_staleness) tokens, so the
    segments differ in length by at most one token and the last ends at max_new_tokens."""
    return -(-segments * max_new_tokens // max_staleness)
