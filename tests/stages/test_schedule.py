"""ppo.schedule (ppo/schedule.py): which weights generate each rollout, the config's refusals, and
whole in-process runs of the tiny default: async with max_staleness 0 trains exactly as sync;
one_step_off and async runs resumed from a checkpoint equal uninterrupted ones (metrics and
final weights, bit for bit on CPU), and need every buffered rollout to; a corrupted weight sync
stops the run with one line."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ds_ppo.algo.choices import (PLACEMENT_NAMES, PLACEMENTS, SCHEDULE_NAMES, SCHEDULES,
                                  rollout_batch, rollout_version)
from ds_ppo.config import load_config
from ds_ppo.config.checks import validate
from ds_ppo.errors import ConfigError

SMALL = ["tracking.enabled=false", "ppo.rollout_batch_size=8", "ppo.mini_batch_size=8",
         "ppo.micro_batch_size=4", "generation.max_new_tokens=6", "checkpoint.keep_last=3",
         "checkpoint.export_at_end=false"]
OFF = ["ppo.schedule=one_step_off", "ppo.rollout_correction=tis"]
# wall-clock figures differ between runs; everything else must match
VOLATILE = ("time/", "tokens_per_s/", "memory/", "async/")


def test_registry_names_every_schedule():
    assert tuple(SCHEDULES) == SCHEDULE_NAMES
    assert tuple(PLACEMENTS) == PLACEMENT_NAMES


def test_rollout_version_by_hand():
    # sync, and async with max_staleness 0: the current weights (iteration j after j-1 updates)
    for sched, n in (("sync", 1), ("async", 0)):
        assert [rollout_version(sched, n, j) for j in range(1, 6)] == [0, 1, 2, 3, 4]
    # one_step_off: the weights the previous iteration started from; the first two from version 0
    assert [rollout_version("one_step_off", 1, j) for j in range(1, 7)] == [0, 0, 1, 2, 3, 4]
    assert [rollout_version("async", 1, j) for j in range(1, 7)] == [0, 0, 1, 2, 3, 4]
    # async 3: the replica refreshed at versions 0, 3, 6: a sample is 1 to 3 updates old
    versions = [rollout_version("async", 3, j) for j in range(1, 11)]
    assert versions == [0, 0, 0, 0, 3, 3, 3, 6, 6, 6]
    assert [j - 1 - v for j, v in enumerate(versions, 1)][1:] == [1, 2, 3, 1, 2, 3, 1, 2, 3]


def test_rollout_batch_by_hand():
    # async 3: the next three rollouts in one go at iterations 1, 4, 7
    assert [list(rollout_batch("async", 3, k)) for k in range(1, 8)] == [
        [2, 3, 4], [], [], [5, 6, 7], [], [], [8, 9, 10]]
    assert [list(rollout_batch("one_step_off", 1, k)) for k in range(1, 4)] == [[2], [3], [4]]
    for sched, n in (("sync", 1), ("async", 0)):
        assert not any(rollout_batch(sched, n, k) for k in range(1, 6))


@pytest.mark.parametrize("sched,n", [("one_step_off", 1), ("async", 1), ("async", 2),
                                     ("async", 4)])
def test_every_rollout_after_the_first_is_batched_once_from_its_version(sched, n):
    # each rollout j >= 2 is generated beside exactly one iteration k < j, from the weights k
    # started from, and is at most max_staleness updates old when it trains
    origin = {j: k for k in range(1, 30) for j in rollout_batch(sched, n, k)}
    assert sorted(origin)[:25] == list(range(2, 27))
    for j in range(2, 27):
        assert rollout_version(sched, n, j) == origin[j] - 1
        assert 1 <= (j - 1) - rollout_version(sched, n, j) <= n


@pytest.mark.parametrize("overrides,names", [
    (["ppo.schedule=one_step_off"], ["ppo.rollout_correction=tis", "ppo.old_logprobs=rollout"]),
    (["ppo.schedule=async", "ppo.max_staleness=2"], ["ppo.rollout_correction=tis"]),
    ([*OFF, "ppo.dynamic_sampling=true", "ppo.samples_per_prompt=2",
      "ppo.advantage_estimator=grpo"], ["ppo.dynamic_sampling=false"]),
    ([*OFF, "generation.mode=zero3"], ["generation.mode=gathered"]),
    ([*OFF, "generation.batch_invariant=true"], ["generation.batch_invariant=false"]),
])
def test_refusals_name_the_keys(overrides, names):
    with pytest.raises(ConfigError) as e:
        validate(load_config(None, overrides), 1)
    line = next(x for x in str(e.value).splitlines() if "ppo.schedule" in x)
    assert all(n in line for n in names), line


@pytest.mark.parametrize("overrides", [
    OFF, ["ppo.schedule=one_step_off", "ppo.old_logprobs=rollout"],
    ["ppo.schedule=async", "ppo.max_staleness=0"],
    ["ppo.schedule=async", "ppo.max_staleness=3", "ppo.rollout_correction=mis"]])
def test_sound_settings_pass(overrides):
    validate(load_config(None, overrides), 1)


SPLIT = [*OFF, "ppo.placement=split"]


@pytest.mark.parametrize("overrides,world,names", [
    # no rank left to train
    (SPLIT, 1, ["ppo.generation_ranks = 1 leaves no training rank", "ppo.placement=colocated"]),
    ([*SPLIT, "ppo.generation_ranks=4"], 4, ["leaves no training rank",
                                             "ppo.generation_ranks <= 3"]),
    # a generation rank serves whole training ranks
    ([*SPLIT, "ppo.generation_ranks=3"], 4, ["exceeds the 1 training rank(s)",
                                             "ppo.generation_ranks <= 2"]),
    # a split placement with nothing to overlap
    (["ppo.placement=split"], 2, ["ppo.schedule = 'sync'", "ppo.schedule=one_step_off",
                                  "ppo.placement=colocated"]),
    (["ppo.placement=split", "ppo.schedule=async", "ppo.max_staleness=0"], 2,
     ["ppo.max_staleness = 0", "ppo.placement=colocated"]),
    # the generation ranks' weight sync gathers no expert-parallel experts
    ([*SPLIT, "deepspeed.policy.expert_parallel_size=2"], 2,
     ["deepspeed.policy.expert_parallel_size > 1", "ppo.placement=colocated"]),
    # episodes are played by the colocated worker only
    ([*SPLIT, "env.function=ds_ppo.envs.calculator:Calculator"], 2,
     ["with an env section", "ppo.placement=colocated"]),
    # the batch sizes divide the training ranks: 8 prompts over 3 of 4 ranks
    (SPLIT, 4, ["ppo.rollout_batch_size = 8 must be divisible by the data-parallel world size 3"]),
])
def test_split_refusals_name_the_keys(overrides, world, names):
    with pytest.raises(ConfigError) as e:
        validate(load_config(None, [*SMALL, *overrides]), world)
    line = next(x for x in str(e.value).splitlines() if names[0] in x)
    assert all(n in line for n in names), line


def test_split_settings_pass():
    """1 of 2 and 2 of 4 ranks generating; a colocated run ignores ppo.generation_ranks."""
    validate(load_config(None, [*SMALL, *SPLIT]), 2)
    validate(load_config(None, [*SMALL, *SPLIT, "ppo.generation_ranks=2"]), 4)
    validate(load_config(None, [*SMALL, "ppo.generation_ranks=5"]), 2)


def _train(out: Path, *overrides: str):
    from ds_ppo.trainer import train

    return train(load_config(None, [*SMALL, f"output_dir={out}", *overrides]))


def _rows(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]


def _weights(out: Path, iteration: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(out / "checkpoints" / f"iter_{iteration:06d}" / "hf" / "model.safetensors")


def _same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_async_staleness_zero_trains_as_sync(tmp_path):
    _train(tmp_path / "sync", "iterations=3", "ppo.rollout_correction=tis")
    _train(tmp_path / "async0", "iterations=3", "ppo.rollout_correction=tis",
           "ppo.schedule=async", "ppo.max_staleness=0")
    assert _rows(tmp_path / "sync") == _rows(tmp_path / "async0")
    assert _same_weights(_weights(tmp_path / "sync", 3), _weights(tmp_path / "async0", 3))
    staleness = [json.loads(line)["async/staleness_max"]
                 for line in (tmp_path / "async0" / "metrics.jsonl").read_text().splitlines()]
    assert staleness == [0.0, 0.0, 0.0]


ASYNC2 = ["ppo.schedule=async", "ppo.max_staleness=2", "ppo.rollout_correction=tis"]
ASYNC3 = ["ppo.schedule=async", "ppo.max_staleness=3", "ppo.rollout_correction=tis"]


def _column(out: Path, key: str) -> list[float]:
    return [json.loads(line)[key] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("schedule,stop,buffered,stale", [
    (OFF, 3, 1, [0.0, 1.0, 1.0, 1.0, 1.0]),
    # async 2: iteration 3 generated the rollouts of 4 and 5
    (ASYNC2, 3, 2, [0.0, 1.0, 2.0, 1.0, 2.0]),
    # async 3: iteration 1 generated those of 2, 3 and 4; the checkpoint after 2 holds 3 and 4
    (ASYNC3, 2, 2, [0.0, 1.0, 2.0, 3.0, 1.0]),
], ids=["one_step_off", "async2", "async3"])
def test_resume_continues_exactly(tmp_path, schedule, stop, buffered, stale):
    full, split = tmp_path / "full", tmp_path / "split"
    every = f"checkpoint.every={stop}"
    _train(full, *schedule, "iterations=5", every)
    _train(split, *schedule, f"iterations={stop}", every)
    saved = split / "checkpoints" / f"iter_{stop:06d}" / "in_flight" / "rank_00000.pt"
    # the buffered rollouts (each with its version and reward call) and the worker's stream
    held = torch.load(saved, weights_only=False)
    assert [b.iteration for b in held["buffer"]] == list(range(stop + 1, stop + 1 + buffered))
    for b in held["buffer"]:  # each token's version saved with it: the weights that sampled it
        versions, mask = b.rollout.token_versions, b.rollout.mask
        assert (versions[mask] == b.version).all() and (versions[~mask] == -1).all()
    _train(split, *schedule, "iterations=5", every)
    a, b = _rows(full), _rows(split)
    assert [r["iteration"] for r in b] == [1, 2, 3, 4, 5]
    assert a == b
    assert _same_weights(_weights(full, 5), _weights(split, 5))
    assert _column(split, "async/staleness_mean") == stale
    assert _column(split, "async/token_staleness_mean") == stale
    assert _column(split, "async/token_staleness_max") == stale
    assert _column(split, "async/regenerated") == [0.0] * 5


def test_resume_needs_every_buffered_rollout(tmp_path, monkeypatch):
    # a checkpoint of async 3 after iteration 2 holds the rollouts of 3 and 4; resumed with only
    # the first of them (the worker's stream restored), iteration 4's is generated again and
    # the run no longer equals the uninterrupted one
    from ds_ppo.ppo.schedule import RolloutSchedule

    full, split = tmp_path / "full", tmp_path / "split"
    _train(full, *ASYNC3, "iterations=4", "checkpoint.every=2")
    _train(split, *ASYNC3, "iterations=2", "checkpoint.every=2")
    load = RolloutSchedule.load_state_dict

    def first_only(self, saved):
        load(self, {**saved, "buffer": saved["buffer"][:1]})

    monkeypatch.setattr(RolloutSchedule, "load_state_dict", first_only)
    _train(split, *ASYNC3, "iterations=4", "checkpoint.every=2")
    assert _column(split, "async/regenerated") == [0.0, 0.0, 0.0, 1.0]
    assert _rows(full)[:3] == _rows(split)[:3] and _rows(full)[3] != _rows(split)[3]
    assert not _same_weights(_weights(full, 4), _weights(split, 4))


def test_sync_saves_nothing_in_flight(tmp_path):
    _train(tmp_path, "iterations=1")
    assert not (tmp_path / "checkpoints" / "iter_000001" / "in_flight").exists()


def test_corrupted_weight_sync_stops(tmp_path, monkeypatch):
    from ds_ppo.ppo.schedule import WeightSyncError

    monkeypatch.setenv("DS_PPO_FAULT", "corrupt_sync:1")  # the sync at iteration 2's start
    with pytest.raises(WeightSyncError) as e:
        _train(tmp_path, *OFF, "iterations=3")
    message = str(e.value)
    assert "\n" not in message and "policy version 1" in message and "checksum" in message


def test_resume_with_other_settings_regenerates(tmp_path, capsys):
    def last(out: Path) -> dict:
        return json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])

    # one_step_off's buffered rollout of iteration 3 is 1 update old: too old for max_staleness 0
    _train(tmp_path / "a", *OFF, "iterations=2")
    _train(tmp_path / "a", "ppo.rollout_correction=tis", "ppo.schedule=async",
           "ppo.max_staleness=0", "iterations=3")
    row = last(tmp_path / "a")
    assert (row["iteration"], row["async/regenerated"], row["async/staleness_max"]) == (3, 1, 0)
    # a sync run's checkpoint holds no rollout: one_step_off generates iteration 3's now
    _train(tmp_path / "b", "iterations=2")
    capsys.readouterr()
    _train(tmp_path / "b", *OFF, "iterations=4")
    assert "iteration 3: no buffered rollout for it" in capsys.readouterr().out  # says so
    rows = [json.loads(line) for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["async/regenerated"], r["async/staleness_max"]) for r in rows[2:]] == [(1, 0),
                                                                                     (0, 1)]
    # async 3's checkpoint after iteration 2 holds the rollouts of 3 and 4 (version 0): resumed
    # as one_step_off, 3's is regenerated now and 4's is generated again beside iteration 3
    _train(tmp_path / "c", *ASYNC3, "iterations=2")
    _train(tmp_path / "c", *OFF, "iterations=4")
    assert list(zip(_column(tmp_path / "c", "async/regenerated"),
                    _column(tmp_path / "c", "async/staleness_max")))[2:] == [(1, 0), (0, 1)]


CALC = ["ppo.rollout_batch_size=4", "ppo.mini_batch_size=16", "ppo.micro_batch_size=8",
        "tracking.enabled=false", "checkpoint.export_at_end=false", "checkpoint.keep_last=3",
        "ppo.rollout_correction=tis"]


def _calculator(out: Path, *overrides: str):
    from ds_ppo.config.load import preset_path
    from ds_ppo.trainer import train

    return train(load_config(preset_path("calculator"), [*CALC, f"output_dir={out}",
                                                           *overrides]))


def test_calculator_episodes_resume_exactly(tmp_path):
    # the calculator preset's multi-turn episodes, played in the background worker (environment
    # steps included); a run stopped after iteration 2 and resumed equals the uninterrupted one
    full, split = tmp_path / "full", tmp_path / "split"
    schedule = ["ppo.schedule=one_step_off"]
    _calculator(full, *schedule, "iterations=3", "checkpoint.every=2")
    _calculator(split, *schedule, "iterations=2", "checkpoint.every=2")
    held = torch.load(split / "checkpoints" / "iter_000002" / "in_flight" / "rank_00000.pt",
                      weights_only=False)
    assert [b.iteration for b in held["buffer"]] == [3]  # its episodes and their statistics
    for b in held["buffer"]:  # observations were not sampled: no version
        versions, mask = b.rollout.token_versions, b.rollout.mask
        assert b.episodes is not None and b.rollout.turn_rewards is not None
        assert (versions[mask] == b.version).all() and (versions[~mask] == -1).all()
    _calculator(split, *schedule, "iterations=3", "checkpoint.every=2")
    a, b = _rows(full), _rows(split)
    assert [r["iteration"] for r in b] == [1, 2, 3] and a == b
    assert _column(split, "async/staleness_mean") == [0.0, 1.0, 1.0]
    assert _column(split, "async/regenerated") == [0.0] * 3
    assert all(r["env/calls"] > 0 for r in b)


def test_colocated_worker_decodes_on_its_side_stream(tmp_path, monkeypatch):
    """The worker's batches run through the side stream's `run`, each after a `handoff` on the
    training thread, and every buffered rollout taken is adopted by the training stream."""
    import threading

    from ds_ppo.engine import side_stream
    from ds_ppo.ppo import schedule

    calls = []

    class Spy(side_stream.SideStream):
        def handoff(self):
            calls.append(("handoff", threading.current_thread() is threading.main_thread()))
            super().handoff()

        def run(self, fn, *args):
            calls.append(("run", threading.current_thread() is threading.main_thread(),
                          fn.__name__))
            return super().run(fn, *args)

        def adopt(self, *values):
            if values[0] is not None:
                calls.append(("adopt", values[0].iteration))
            super().adopt(*values)

    monkeypatch.setattr(schedule, "SideStream", Spy)
    _train(tmp_path, "iterations=3", *ASYNC2)
    runs = [c for c in calls if c[0] == "run"]
    assert runs and all(c == ("run", False, "produce_batch") for c in runs)  # worker thread
    for k, c in enumerate(calls):  # every run follows a handoff made on the training thread
        if c[0] == "run":
            assert calls[k - 1] == ("handoff", True)
    assert [c[1] for c in calls if c[0] == "adopt"] == [2, 3]  # iteration 1 is made on take


@pytest.mark.parametrize("overrides,regenerated", [
    # async 2 refreshes at iterations 1, 3, 5: the checkpoint after 3 held the rollouts of 4 and
    # 5, both generated at their iteration's start; iteration 5 generates 6 and 7 beside it
    (ASYNC2, [4, 5]),
    # with partial rollouts iteration 4 decodes the whole of 5's beside it (and starts 6's)
    (["ppo.partial_rollouts=true", *ASYNC2], [4]),
], ids=["async2", "async2_partial"])
def test_a_resume_at_another_world_size_regenerates_what_was_in_flight(
        tmp_path, monkeypatch, capsys, overrides, regenerated):
    """At another world size a checkpoint's in-flight file is not loaded (`read_in_flight`
    returns None, as here): each iteration whose rollout it held, up to the next refresh,
    generates it at its start from the current weights (docs/CHECKPOINTS.md says which)."""
    from ds_ppo.run import driver

    out = tmp_path / "run"
    _train(out, *overrides, "iterations=3", "checkpoint.every=3")
    monkeypatch.setattr(driver, "read_in_flight", lambda path, check=None: None)
    capsys.readouterr()
    _train(out, *overrides, "iterations=6", "checkpoint.every=3")
    said = [int(line.split("iteration ")[1].split(":")[0]) for line in
            capsys.readouterr().out.splitlines() if "no buffered rollout for it" in line]
    assert said == regenerated
    assert _column(out, "async/regenerated") == [float(i in regenerated) for i in range(1, 7)]
