"""Alarms: an iteration's metrics say the run lost its learning signal or a skill
(tracking.alarms), and which checkpoint is the best so far (checkpoint.keep_best).

Three alarms, each read from the metrics every rank already holds (reduced across ranks, so
every rank decides alike):

- ``entropy``: policy/entropy below entropy_floor for entropy_iterations in a row. A policy that
  samples one response per prompt gives a group estimator equal scores: no advantage, no
  gradient, and it stays where it is.
- ``zero_std``: group/zero_std_frac above zero_std_ceiling for zero_std_iterations in a row: the
  same, seen from the scores; or, sooner, advantage/zero_frac = 1 (every advantage is 0: the
  batch gives no gradient at all) for zero_signal_iterations in a row.
- ``drop``: a watched metric's mean over its last `window` logged values more than max_drop below
  the best such mean: the policy lost something it had learned.

An alarm fires when its condition starts to hold (one line, one MLflow tag and metric
alarm/<name>) and again only after it has been clear for as many iterations as it takes to fire
(entropy_iterations, zero_std_iterations, window): a metric that flickers around its threshold
fires once. The state (counters, windows, bests) is part of the trainer state, so a resumed run
fires exactly as the uninterrupted one would.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class Alarm:
    """One alarm that fired: its metric name (alarm/<name>) and the line to print."""

    name: str
    message: str


@dataclass
class AlarmState:
    """What the checks remember between iterations (JSON-able: saved in trainer_state.json)."""

    below_entropy: int = 0  # iterations in a row with policy/entropy under the floor
    above_zero_std: int = 0  # iterations in a row with group/zero_std_frac over the ceiling
    no_signal: int = 0  # iterations in a row with advantage/zero_frac = 1
    recent: dict[str, list[float]] = field(default_factory=dict)  # watched metric -> last values
    best: dict[str, list[float]] = field(default_factory=dict)  # metric -> [best mean, iteration]
    active: list[str] = field(default_factory=list)  # alarms fired and not yet re-armed
    clear: dict[str, int] = field(default_factory=dict)  # active alarm -> iterations clear in a row


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def check_alarms(settings, state: AlarmState, metrics: dict[str, float],
                 iteration: int) -> list[Alarm]:
    """Update `state` with this iteration's `metrics`; the alarms that fire now.

    Args:
        settings: tracking.alarms (config.run_sections.AlarmsConfig).
        state: updated in place.
        metrics: the iteration's metrics (identical on every rank).
        iteration: 1-based.
    """
    if not settings.enabled:
        return []
    holding: dict[str, str] = {}  # alarm -> message, where its condition holds long enough
    seen: dict[str, bool] = {}  # alarm -> whether this iteration is on the wrong side
    entropy = metrics.get("policy/entropy")
    if settings.entropy_floor > 0 and entropy is not None:
        seen["entropy"] = entropy < settings.entropy_floor
        state.below_entropy = state.below_entropy + 1 if seen["entropy"] else 0
        if state.below_entropy >= settings.entropy_iterations:
            holding["entropy"] = (
                f"policy/entropy = {entropy:.3g} nats per token, below "
                f"tracking.alarms.entropy_floor = {settings.entropy_floor:g} for "
                f"{state.below_entropy} iterations: the policy samples (nearly) one response "
                "per prompt and has stopped exploring. Try ppo.entropy_coef (e.g. 0.005) or "
                "ppo.dynamic_sampling")
    zero_std, silent = metrics.get("group/zero_std_frac"), metrics.get("advantage/zero_frac")
    if settings.zero_std_ceiling < 1 and silent is not None:
        seen["zero_std"] = silent >= 1.0
        state.no_signal = state.no_signal + 1 if seen["zero_std"] else 0
        if state.no_signal >= settings.zero_signal_iterations:
            holding["zero_std"] = (
                f"advantage/zero_frac = 1 for {state.no_signal} iterations: every response's "
                "advantage is 0 (the responses to each prompt score alike), so the policy gets "
                "no gradient. Try ppo.zero_std_advantage (a batch baseline), "
                "ppo.dynamic_sampling, ppo.entropy_coef or more ppo.samples_per_prompt")
    if settings.zero_std_ceiling < 1 and zero_std is not None:
        above = zero_std > settings.zero_std_ceiling
        seen["zero_std"] = seen.get("zero_std", False) or above
        state.above_zero_std = state.above_zero_std + 1 if above else 0
        if state.above_zero_std >= settings.zero_std_iterations and "zero_std" not in holding:
            holding["zero_std"] = (
                f"group/zero_std_frac = {zero_std:.3g}, above tracking.alarms.zero_std_ceiling "
                f"= {settings.zero_std_ceiling:g} for {state.above_zero_std} iterations: the "
                "responses to a prompt all score alike, so the advantages are 0 and the policy "
                "gets no gradient. Try ppo.dynamic_sampling, ppo.entropy_coef or more "
                "ppo.samples_per_prompt")
    for name in settings.watch:
        value = metrics.get(name)
        if value is None or not math.isfinite(value):
            continue
        recent = state.recent.setdefault(name, [])
        recent.append(float(value))
        del recent[:-settings.window]
        if len(recent) < settings.window:
            continue
        now = _mean(recent)
        best = state.best.get(name)
        if best is None or now > best[0]:
            state.best[name] = best = [now, float(iteration)]
        dropped = best[0] - now > settings.max_drop
        seen["drop"] = seen.get("drop", False) or dropped
        if dropped and "drop" not in holding:
            holding["drop"] = (
                f"{name} fell to {now:.3g} (mean of its last {settings.window} values) from its "
                f"best {best[0]:.3g} (at iteration {int(best[1])}), more than "
                f"tracking.alarms.max_drop = {settings.max_drop:g}: the run lost what it had "
                "learned. checkpoint.keep_best keeps the best checkpoint")
    # a fired alarm re-arms once its condition has been clear for as long as it takes to fire
    rearm = {"entropy": settings.entropy_iterations, "zero_std": settings.zero_std_iterations,
             "drop": settings.window}
    for k in list(state.active):
        if k not in seen:  # its metric is absent this iteration: nothing changes
            continue
        state.clear[k] = 0 if seen[k] else state.clear.get(k, 0) + 1
        if state.clear[k] >= rearm[k]:
            state.active.remove(k)
            del state.clear[k]
    fired = [Alarm(k, f"alarm alarm/{k} at iteration {iteration}: {m}")
             for k, m in holding.items() if k not in state.active]
    for alarm in fired:
        state.active.append(alarm.name)
        state.clear[alarm.name] = 0
    return fired


def save_score(values: list[float]) -> float | None:
    """checkpoint.keep_best's score of a save: the mean of the metric's finite values over the
    iterations since the previous save (None when none logged it)."""
    finite = [v for v in values if math.isfinite(v)]
    return _mean(finite) if finite else None


def is_better(value: float, best: float | None, mode: str) -> bool:
    """Whether `value` beats `best` (None: nothing yet) for keep_best_mode `mode`."""
    if best is None:
        return True
    return value > best if mode == "max" else value < best
