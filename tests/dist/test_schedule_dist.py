"""ppo.schedule on 2 gloo ranks through the real `deepspeed` launcher (ZeRO-3: every weight sync
into the background worker's replica is a collective gather): a run killed by SIGKILL and
started again with the same command gives the metrics and final weights of an uninterrupted
run, bit for bit."""
from __future__ import annotations

import subprocess

import pytest
import torch

from conftest import SMALL, clean_env, deepspeed_cmd, free_port, read_metrics

VOLATILE = ("time/", "tokens_per_s/", "memory/", "async/training", "async/generation",
            "async/weight_sync_s")


def _launch(out, extra: list[str], cwd, **env: str) -> subprocess.CompletedProcess:
    args = ["train", *SMALL, "iterations=4", "checkpoint.every=2", f"output_dir={out}", *extra]
    return subprocess.run([*deepspeed_cmd(2, free_port()), "--module", "ds_ppo", *args], cwd=cwd,
                          env=clean_env(**env), capture_output=True, text=True, timeout=600)


def _comparable(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(VOLATILE)}


@pytest.mark.parametrize("schedule", [["ppo.schedule=one_step_off"],
                                      ["ppo.schedule=async", "ppo.max_staleness=3"]],
                         ids=["one_step_off", "async3"])
def test_killed_run_resumes_exactly_on_two_ranks(tmp_path, schedule):
    from safetensors.torch import load_file

    extra = [*schedule, "ppo.rollout_correction=tis"]
    full, killed = tmp_path / "full", tmp_path / "killed"
    proc = _launch(full, extra, tmp_path)
    assert proc.returncode == 0, proc.stderr[-6000:]
    # SIGKILL in the middle of iteration 4's save: iteration 2's checkpoint is the one to resume
    # from (one_step_off: with the rollout of iteration 3, generated beside iteration 2; async 3:
    # with those of iterations 3 and 4, generated beside iteration 1)
    proc = _launch(killed, extra, tmp_path, DS_PPO_FAULT="kill_during_save:4")
    assert proc.returncode != 0
    assert (killed / "checkpoints" / "latest").read_text().strip() == "iter_000002"
    proc = _launch(killed, extra, tmp_path)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert "resumed from" in proc.stdout + proc.stderr
    a, b = read_metrics(full), read_metrics(killed)
    assert [r["iteration"] for r in b] == [1, 2, 3, 4]
    assert [r["async/staleness_max"] for r in b][1:] == ([1.0] * 3 if "one_step_off" in
                                                         schedule[0] else [1.0, 2.0, 3.0])
    assert [_comparable(r) for r in a] == [_comparable(r) for r in b]
    wa = load_file(full / "checkpoints" / "iter_000004" / "hf" / "model.safetensors")
    wb = load_file(killed / "checkpoints" / "iter_000004" / "hf" / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
