"""Hangs that name themselves, on two real gloo ranks of `ds-ppo train`.

Rank 1 is stopped with SIGSTOP mid-run (a frozen process: a dead GPU, a node under swap). Rank
0, waiting for it in a collective, must not sit there for dist_timeout_minutes and then die with
a bare gloo traceback: after watchdog_minutes it prints one line naming its phase and rank 1 as
the rank that did not arrive, writes its Python stacks to output_dir/hang-0.txt and exits 4.
The same command then resumes from the last checkpoint. (The two ranks are started as plain
processes with the launcher's variables: the `deepspeed` launcher would add start-up time and
kill the stopped rank itself.)
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import SMALL, clean_env, free_port, read_metrics
from ds_ppo.watchdog import EXIT_HANG


def _start_ranks(args: list[str], cwd: Path) -> list[subprocess.Popen]:
    port = str(free_port())
    return [subprocess.Popen(
        [sys.executable, "-m", "ds_ppo", "train", *args], cwd=cwd, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env=clean_env(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=port, PYTHONUNBUFFERED="1"))
        for r in range(2)]


def _wait_for_checkpoint(out: Path, procs, timeout: float = 400) -> None:
    t0 = time.time()
    while not (out / "checkpoints" / "latest").exists():
        assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
        assert time.time() - t0 < timeout
        time.sleep(0.1)


def test_a_stopped_rank_is_named_by_the_other_which_exits_4_and_the_run_resumes(tmp_path):
    out = tmp_path / "out"
    args = [*SMALL, f"output_dir={out}", "iterations=2", "checkpoint.every=1",
            "watchdog_minutes=0.1", "dist_timeout_minutes=2",  # 6 s without progress
            "reward.timeout_s=5"]
    ranks = _start_ranks(args, tmp_path)
    try:
        _wait_for_checkpoint(out, ranks)  # iteration 1 saved
        os.kill(ranks[1].pid, signal.SIGSTOP)  # frozen in iteration 2, in whatever phase
        t_stop = time.time()
        stdout, stderr = ranks[0].communicate(timeout=120)
        took = time.time() - t_stop
    finally:
        for p in ranks:  # a scheduler ends the job's other processes
            if p.poll() is None:
                p.kill()
                p.communicate()
    assert ranks[0].returncode == EXIT_HANG, stderr[-3000:]
    assert took < 60, took  # watchdog_minutes, not dist_timeout_minutes (120 s)
    lines = [ln for ln in stderr.splitlines() if "watchdog" in ln]
    assert len(lines) == 1, stderr[-3000:]
    line = lines[0]
    assert line.startswith("ds-ppo: error: watchdog: rank 0 in "), line
    assert "no progress for" in line and "watchdog_minutes = 0.1" in line
    assert "did not arrive: rank 1 (last in " in line, line
    assert f"{out / 'hang-0.txt'}" in line and "resume" in line
    assert "Traceback" not in stderr and "gloo" not in stderr, stderr[-3000:]
    stacks = (out / "hang-0.txt").read_text()
    assert "did not arrive: rank 1" in stacks and "most recent call first" in stacks
    saved = json.loads((out / "checkpoints" / (out / "checkpoints" / "latest").read_text()
                        .strip() / "trainer_state.json").read_text())["iteration"]
    assert saved == 1

    # the same command resumes after the last checkpoint and finishes
    ranks = _start_ranks(args, tmp_path)
    outs = [p.communicate(timeout=400) for p in ranks]
    assert [p.returncode for p in ranks] == [0, 0], outs[0][1][-3000:]
    assert f"resumed from {out / 'checkpoints'}" in outs[0][1] + outs[0][0]
    assert [r["iteration"] for r in read_metrics(out)][-1] == 2


def test_split_ranks_stop_together_name_a_stopped_generation_rank_and_a_gone_training_rank(
        tmp_path):
    """ppo.placement = split, rank 0 trains, rank 1 generates. SIGTERM to the training rank: it
    saves at the iteration's end and exits 143; told so, the generation rank exits 0, no error.
    The same command resumes; then the generation rank is stopped with SIGSTOP: the training
    rank names it within watchdog_minutes (one line, exit 4). Continued, the generation rank
    finds the training rank gone: one line naming training rank 0, exit 4, no traceback (as
    when rank 0 is killed)."""
    out = tmp_path / "out"
    latest = out / "checkpoints" / "latest"
    args = [*SMALL, f"output_dir={out}", "iterations=6", "checkpoint.every=1",
            "ppo.schedule=one_step_off", "ppo.placement=split", "ppo.rollout_correction=tis",
            "watchdog_minutes=0.1", "dist_timeout_minutes=2", "reward.timeout_s=5"]
    ranks = _start_ranks(args, tmp_path)
    try:
        _wait_for_checkpoint(out, ranks)  # iteration 1 saved
        os.kill(ranks[0].pid, signal.SIGTERM)
        outs = [p.communicate(timeout=120) for p in ranks]
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
                p.communicate()
    assert [p.returncode for p in ranks] == [128 + signal.SIGTERM, 0], outs[1][1][-3000:]
    assert "ds-ppo: error" not in outs[1][0] + outs[1][1], outs[1][1][-3000:]
    stopped_at = latest.read_text().strip()

    ranks = _start_ranks(args, tmp_path)
    try:
        t0 = time.time()
        while latest.read_text().strip() == stopped_at:  # a checkpoint after the resume
            assert all(p.poll() is None for p in ranks), [p.communicate() for p in ranks]
            assert time.time() - t0 < 400
            time.sleep(0.1)
        os.kill(ranks[1].pid, signal.SIGSTOP)
        t_stop = time.time()
        stdout, stderr = ranks[0].communicate(timeout=120)
        took = time.time() - t_stop
        os.kill(ranks[1].pid, signal.SIGCONT)
        _, gen_stderr = ranks[1].communicate(timeout=120)
    finally:
        for p in ranks:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
                p.communicate()
    assert f"resumed from {out / 'checkpoints' / stopped_at}" in stdout + stderr
    assert ranks[0].returncode == EXIT_HANG, stderr[-3000:]
    assert took < 60, took
    lines = [ln for ln in stderr.splitlines() if "watchdog" in ln]
    assert len(lines) == 1, stderr[-3000:]
    assert lines[0].startswith("ds-ppo: error: watchdog: rank 0 in "), lines[0]
    assert "did not arrive: generation rank 1 (last in " in lines[0], lines[0]
    assert "Traceback" not in stderr, stderr[-3000:]

    assert ranks[1].returncode == EXIT_HANG, gen_stderr[-3000:]
    lines = [ln for ln in gen_stderr.splitlines() if "ds-ppo: error" in ln]
    assert len(lines) == 1, gen_stderr[-3000:]
    assert lines[0].startswith("ds-ppo: error: watchdog: generation rank 1 in "), lines[0]
    assert "rank 0" in lines[0] and f"{out / 'hang-1.txt'}" in lines[0], lines[0]
    assert "Traceback" not in gen_stderr, gen_stderr[-3000:]
