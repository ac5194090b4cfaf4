"""ppo.schedule on 2 gloo ranks through the real `deepspeed` launcher: a run killed by SIGKILL and
started again with the same command gives the metrics and final weights of an uninterrupted
run, bit for bit. async 3 runs colocated (ZeRO-3: every weight sync into the background
worker's replica is a collective gather); one_step_off runs with ppo.placement = split (rank 1
only generates, rank 0 only trains), and its runs equal a colocated run on the one training
rank, from the start and resumed from the split run's checkpoint (the buffered rollout carries
over: nothing is regenerated)."""
from __future__ import annotations

import shutil
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


def _weights(out):
    from safetensors.torch import load_file

    return load_file(out / "checkpoints" / "iter_000004" / "hf" / "model.safetensors")


def _same(wa: dict, wb: dict) -> bool:
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def _colocated_on_one_rank(out, extra: list[str]) -> None:
    """The same run in this process: one rank, ppo.placement = colocated."""
    from ds_ppo.config import load_config
    from ds_ppo.trainer import train

    train(load_config(None, [*SMALL, "iterations=4", "checkpoint.every=2", f"output_dir={out}",
                             *[e for e in extra if not e.startswith("ppo.placement")]]))


@pytest.mark.parametrize("schedule", [["ppo.schedule=one_step_off", "ppo.placement=split"],
                                      ["ppo.schedule=async", "ppo.max_staleness=3"]],
                         ids=["one_step_off_split", "async3"])
def test_killed_run_resumes_exactly_on_two_ranks(tmp_path, schedule, capsys):
    extra = [*schedule, "ppo.rollout_correction=tis"]
    split = "ppo.placement=split" in schedule
    full, killed = tmp_path / "full", tmp_path / "killed"
    proc = _launch(full, extra, tmp_path)
    assert proc.returncode == 0, proc.stderr[-6000:]
    # SIGKILL in the middle of iteration 4's save: iteration 2's checkpoint is the one to resume
    # from (one_step_off: with the rollout of iteration 3, generated beside iteration 2; async 3:
    # with those of iterations 3 and 4, generated beside iteration 1)
    proc = _launch(killed, extra, tmp_path, DS_PPO_FAULT="kill_during_save:4")
    assert proc.returncode != 0
    assert (killed / "checkpoints" / "latest").read_text().strip() == "iter_000002"
    if split:  # iteration 2's checkpoint of the split run, to continue colocated
        shutil.copytree(killed, tmp_path / "other")
    proc = _launch(killed, extra, tmp_path)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert "resumed from" in proc.stdout + proc.stderr
    a, b = read_metrics(full), read_metrics(killed)
    assert [r["iteration"] for r in b] == [1, 2, 3, 4]
    assert [r["async/staleness_max"] for r in b][1:] == ([1.0] * 3 if "one_step_off" in
                                                         schedule[0] else [1.0, 2.0, 3.0])
    assert [_comparable(r) for r in a] == [_comparable(r) for r in b]
    assert _same(_weights(full), _weights(killed))
    if not split:
        return
    # the split placement samples and trains what colocated does on its one training rank
    _colocated_on_one_rank(tmp_path / "colocated", extra)
    c = read_metrics(tmp_path / "colocated")
    assert [_comparable(r) for r in a] == [_comparable(r) for r in c]
    assert _same(_weights(full), _weights(tmp_path / "colocated"))
    # resumed with the other placement at the same training world size: the checkpoint's
    # buffered rollout (iteration 3's) is trained on, nothing regenerated
    capsys.readouterr()
    _colocated_on_one_rank(tmp_path / "other", extra)
    assert ("resumed a checkpoint of ppo.placement = split with ppo.placement = colocated on the "
            "same 1 training rank(s): its buffered rollouts (iterations [3])"
            in capsys.readouterr().out)
    o = read_metrics(tmp_path / "other")
    assert [r["async/regenerated"] for r in o] == [0.0] * 4
    assert [_comparable(r) for r in a] == [_comparable(r) for r in o]
    assert _same(_weights(full), _weights(tmp_path / "other"))
