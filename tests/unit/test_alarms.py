"""tracking.alarms (ds_ppo/run/alarms.py): when each alarm fires, that it fires once per episode
of its condition, that a resumed state fires exactly as the uninterrupted one, and
checkpoint.keep_best's ranking of saves."""
from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from ds_ppo.config import load_config
from ds_ppo.run.alarms import AlarmState, check_alarms, is_better, save_score


def _alarms(*overrides):
    return load_config(None, [f"tracking.alarms.{o}" for o in overrides]).tracking.alarms


def _run(settings, rows, state=None, start=1):
    """The (iteration, alarm name) of every alarm over the metric rows."""
    state = state or AlarmState()
    return [(i, a.name) for i, m in enumerate(rows, start)
            for a in check_alarms(settings, state, m, i)], state


def test_entropy_alarm_after_n_iterations_below_the_floor_once_per_episode():
    s = _alarms("entropy_floor=0.05", "entropy_iterations=3")
    ent = [0.9, 0.04, 0.03, 0.01, 0.02, 0.5, 0.5, 0.5, 0.01, 0.01, 0.01]
    fired, _ = _run(s, [{"policy/entropy": e} for e in ent])
    # below from iteration 2: the third in a row is 4; clear for 3 iterations (6-8) re-arms
    # it; below again from 9: fires at 11
    assert fired == [(4, "entropy"), (11, "entropy")]
    # a metric flickering across the floor (one iteration above) fires once
    flicker = [0.01, 0.01, 0.01, 0.5, 0.01, 0.01, 0.01, 0.5, 0.01, 0.01, 0.01]
    assert _run(s, [{"policy/entropy": e} for e in flicker])[0] == [(3, "entropy")]


def test_zero_std_alarm_and_metrics_that_are_absent():
    s = _alarms("zero_std_ceiling=0.9", "zero_std_iterations=2")
    rows = [{"group/zero_std_frac": z} for z in (0.5, 1.0, 0.95, 1.0, 0.2)]
    fired, _ = _run(s, rows)
    assert fired == [(3, "zero_std")]
    # a run without groups (no group/zero_std_frac) or without entropy never fires
    assert _run(s, [{"score/mean": 0.0}] * 20)[0] == []


def test_zero_std_alarm_fires_within_three_iterations_of_a_batch_without_signal():
    """group/zero_std_frac = 1 from iteration 5. Without a batch baseline every advantage is 0
    (advantage/zero_frac = 1): the alarm fires at 7, not after zero_std_iterations (14). With
    ppo.zero_std_advantage the responses keep advantages: only the slow path fires."""
    flat = [0.5] * 4 + [1.0] * 16
    no_baseline = [{"group/zero_std_frac": z, "advantage/zero_frac": z} for z in flat]
    fired, _ = _run(_alarms(), no_baseline)
    assert fired == [(7, "zero_std")]
    baseline = [{"group/zero_std_frac": z, "advantage/zero_frac": 0.0} for z in flat]
    assert _run(_alarms(), baseline)[0] == [(14, "zero_std")]
    assert _run(_alarms("zero_signal_iterations=1"), no_baseline)[0] == [(5, "zero_std")]
    assert _run(_alarms("zero_std_ceiling=1"), no_baseline)[0] == []  # the alarm is off
    state = AlarmState()
    msgs = [a.message for i, m in enumerate(no_baseline, 1)
            for a in check_alarms(_alarms(), state, m, i)]
    assert "advantage/zero_frac = 1 for 3 iterations" in msgs[0]
    assert "ppo.zero_std_advantage" in msgs[0]


def test_drop_alarm_on_a_lost_skill():
    """The run that reached 0.71 and lost it: accuracy ~0.7 for a while, then 0.25."""
    s = _alarms("watch=[env/accuracy]", "window=4", "max_drop=0.2")
    acc = [0.2, 0.4, 0.6, 0.7, 0.72, 0.7, 0.71, 0.7, 0.5, 0.3, 0.25, 0.25, 0.25]
    fired, state = _run(s, [{"env/accuracy": a} for a in acc])
    # means of 4: best 0.7075 (iterations 4-7, first reached at 7); at 11 the mean is 0.325
    assert fired == [(11, "drop")]
    assert state.best["env/accuracy"] == [pytest.approx(0.7075), 7.0]
    # noise around a plateau does not fire
    wobble = [0.7, 0.6, 0.75, 0.65] * 10
    assert _run(s, [{"env/accuracy": a} for a in wobble])[0] == []


def test_disabled_and_the_message_names_the_fix():
    rows = [{"policy/entropy": 0.0}] * 20
    assert _run(_alarms("enabled=false"), rows)[0] == []
    state = AlarmState()
    msgs = [a.message for i, m in enumerate(rows, 1)
            for a in check_alarms(_alarms(), state, m, i)]
    assert len(msgs) == 1 and msgs[0].startswith("alarm alarm/entropy at iteration 10:")
    assert "ppo.entropy_coef" in msgs[0]


def test_a_resumed_state_fires_as_the_uninterrupted_run():
    s = _alarms("watch=[score/mean]", "window=3", "max_drop=0.1", "entropy_iterations=2")
    rows = [{"score/mean": v, "policy/entropy": e} for v, e in
            zip([0.1, 0.5, 0.6, 0.6, 0.55, 0.3, 0.2, 0.2, 0.6, 0.6, 0.6, 0.1, 0.1, 0.1],
                [1, 1, 0.01, 0.01, 0.01, 1, 0.0, 0.0, 0.0, 1, 1, 1, 0.01, 0.01])]
    whole, _ = _run(s, rows)
    assert whole  # the scenario fires something
    for k in range(1, len(rows)):
        first, state = _run(s, rows[:k])
        saved = json.loads(json.dumps(asdict(state)))  # what trainer_state.json holds
        rest, _ = _run(s, rows[k:], AlarmState(**saved), start=k + 1)
        assert first + rest == whole, k


def test_keep_best_ranking():
    assert save_score([0.2, float("nan"), 0.4]) == pytest.approx(0.3)
    assert save_score([]) is None
    assert is_better(0.5, None, "max") and is_better(0.5, 0.4, "max")
    assert not is_better(0.4, 0.4, "max") and is_better(0.3, 0.4, "min")
