"""On-policy distillation on 2 gloo ranks through the real `deepspeed` launcher: a run with a
teacher (teacher.arch, ZeRO-3 sharded over the ranks like the reference) under ppo.schedule =
async with partial rollouts (the teacher scores rollouts decoded in segments beside earlier
updates), killed by SIGKILL in iteration 4's save and started again with the same command,
gives the metrics and final weights of an uninterrupted run, bit for bit.

Three commands in two launched jobs (tests/support/chained_runs.py): the uninterrupted run
then the killed one; the rerun.
"""
from __future__ import annotations

import pytest
import torch

from conftest import SMALL, read_metrics
from support.chains import KILL, comparable, final_weights, run_chain
from support.teachers import TINY_ARCH

pytestmark = pytest.mark.launcher

TEACHER = ["teacher.arch.model_type=llama", "teacher.arch.initializer_range=0.1",
           *(f"teacher.arch.{k}={str(v).lower()}" for k, v in TINY_ARCH.items())]
ARGS = [*SMALL, "iterations=4", "checkpoint.every=2", "ppo.advantage_estimator=distill",
        "ppo.kl_loss_coef=0", "ppo.schedule=async", "ppo.max_staleness=2",
        "ppo.partial_rollouts=true", "ppo.rollout_correction=tis",
        "deepspeed.teacher.offload_param=false", *TEACHER]


def test_a_killed_run_with_a_teacher_resumes_exactly_on_two_ranks(tmp_path):
    full, killed = tmp_path / "full", tmp_path / "killed"
    first = run_chain(tmp_path, "first", [(["train", *ARGS, f"output_dir={full}"], None),
                                       (["train", *ARGS, f"output_dir={killed}"], KILL)])
    assert "[chained_runs] 0 exit 0" in first.stdout, first.stdout[-3000:] + first.stderr[-6000:]
    assert "[chained_runs] 1 exit" not in first.stdout  # killed in iteration 4's save
    assert (killed / "checkpoints" / "latest").read_text().strip() == "iter_000002"
    again = run_chain(tmp_path, "again", [(["train", *ARGS, f"output_dir={killed}"], None)])
    assert "[chained_runs] 0 exit 0" in again.stdout, again.stderr[-6000:]
    assert "resumed from" in again.stdout + again.stderr
    a, b = read_metrics(full), read_metrics(killed)
    assert [r["iteration"] for r in b] == [1, 2, 3, 4]
    assert all(r["distill/reverse_kl"] > 0 and "distill/top1_match" in r for r in a)
    assert all(r["async/continued_token_share"] > 0 for r in a[2:])  # partial rollouts ran
    assert comparable(a) == comparable(b)
    wa, wb = final_weights(full), final_weights(killed)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
