"""ppo.schedule on 2 gloo ranks through the real `deepspeed` launcher: a run killed by SIGKILL and
started again with the same command gives the metrics and final weights of an uninterrupted
run, bit for bit. async 3 runs colocated (ZeRO-3: every weight sync into the background
worker's replica is a collective gather); one_step_off runs with ppo.placement = split (rank 1
only generates, rank 0 only trains), and its runs equal a colocated run on the one training
rank, from the start and resumed from the split run's checkpoint (the buffered rollout carries
over: nothing is regenerated).

The six launched commands (per schedule: the uninterrupted run, the run killed in iteration 4's
save and its rerun) run in five launched jobs (tests/support/chained_runs.py), in the order a
user would run them: async 3 full then killed, async 3 again (resumes); one_step_off split
full, killed, again, each alone in its job (a split run's process groups are set up once per
process).
"""
from __future__ import annotations

import shutil

import pytest
import torch

from conftest import SMALL, rank_threads, read_metrics
from support.chains import KILL, comparable, final_weights, run_chain

SCHEDULES = {"one_step_off_split": ["ppo.schedule=one_step_off", "ppo.placement=split"],
             "async3": ["ppo.schedule=async", "ppo.max_staleness=3"]}
pytestmark = pytest.mark.launcher


def _extra(schedule: str) -> list[str]:
    return [*SCHEDULES[schedule], "ppo.rollout_correction=tis"]


def _argv(out, schedule: str) -> list[str]:
    return ["train", *SMALL, "iterations=4", "checkpoint.every=2", f"output_dir={out}",
            *_extra(schedule)]


def _same(wa: dict, wb: dict) -> bool:
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def _colocated_on_one_rank(out, schedule: str) -> None:
    """The same run in this process: one rank, ppo.placement = colocated, with the launched
    ranks' torch threads (the placements are equal at equal threads per rank)."""
    from ds_ppo.config import load_config
    from ds_ppo.trainer import train

    with rank_threads():
        train(load_config(None, [*SMALL, "iterations=4", "checkpoint.every=2",
                                 f"output_dir={out}", *[e for e in _extra(schedule)
                                                        if not e.startswith("ppo.placement")]]))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Per schedule: (the chain whose last command was killed, the chain that resumed it)."""
    work = tmp_path_factory.mktemp("schedules")
    full = {s: work / f"full_{s}" for s in SCHEDULES}
    killed = {s: work / f"killed_{s}" for s in SCHEDULES}
    split, colocated = SCHEDULES
    chains, latest = {}, {}
    killed_in = run_chain(work, "async", [(_argv(full[colocated], colocated), None),
                                       (_argv(killed[colocated], colocated), KILL)])
    latest[colocated] = (killed[colocated] / "checkpoints" / "latest").read_text().strip()
    chains[colocated] = (killed_in, 1, run_chain(work, "async_again",
                                              [(_argv(killed[colocated], colocated), None)]))
    full_split = run_chain(work, "split_full", [(_argv(full[split], split), None)])
    assert full_split.returncode == 0, full_split.stdout[-3000:] + full_split.stderr[-6000:]
    killed_in = run_chain(work, "split_killed", [(_argv(killed[split], split), KILL)])
    latest[split] = (killed[split] / "checkpoints" / "latest").read_text().strip()
    # iteration 2's checkpoint of the split run, to continue colocated
    shutil.copytree(killed[split], work / "other")
    chains[split] = (killed_in, 0, run_chain(work, "split_again",
                                          [(_argv(killed[split], split), None)]))
    return work, full, killed, latest, chains


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_killed_run_resumes_exactly_on_two_ranks(runs, schedule, capsys):
    work, full, killed, latest, chains = runs
    killed_in, kill_at, resumed_in = chains[schedule]
    # the killed command (its chain's last) never finished; the commands before it did
    assert killed_in.returncode != 0
    assert [f"[chained_runs] {i} exit 0" in killed_in.stdout for i in range(kill_at + 1)] == \
        [True] * kill_at + [False], killed_in.stdout[-3000:] + killed_in.stderr[-6000:]
    assert "[chained_runs] 0 exit 0" in resumed_in.stdout, resumed_in.stderr[-6000:]
    # SIGKILL in the middle of iteration 4's save: iteration 2's checkpoint is the one to resume
    # from (one_step_off: with the rollout of iteration 3, generated beside iteration 2; async 3:
    # with those of iterations 3 and 4, generated beside iteration 1)
    assert latest[schedule] == "iter_000002"
    assert "resumed from" in resumed_in.stdout + resumed_in.stderr
    a, b = read_metrics(full[schedule]), read_metrics(killed[schedule])
    assert [r["iteration"] for r in b] == [1, 2, 3, 4]
    stale = [1.0] * 3 if schedule == "one_step_off_split" else [1.0, 2.0, 3.0]
    assert [r["async/staleness_max"] for r in b][1:] == stale
    assert comparable(a) == comparable(b)
    assert _same(final_weights(full[schedule]), final_weights(killed[schedule]))
    if "ppo.placement=split" not in SCHEDULES[schedule]:
        return
    # the split placement samples and trains what colocated does on its one training rank
    _colocated_on_one_rank(work / "colocated", schedule)
    assert comparable(a) == comparable(read_metrics(work / "colocated"))
    assert _same(final_weights(full[schedule]), final_weights(work / "colocated"))
    # resumed with the other placement at the same training world size: the checkpoint's
    # buffered rollout (iteration 3's) is trained on, nothing regenerated
    capsys.readouterr()
    _colocated_on_one_rank(work / "other", schedule)
    assert ("resumed a checkpoint of ppo.placement = split with ppo.placement = colocated on the "
            "same 1 training rank(s): its buffered rollouts (iterations [3])"
            in capsys.readouterr().out)
    o = read_metrics(work / "other")
    assert [r["async/regenerated"] for r in o] == [0.0] * 4
    assert comparable(a) == comparable(o)
    assert _same(final_weights(full[schedule]), final_weights(work / "other"))
