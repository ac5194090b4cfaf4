"""Resume and crash recovery, as a user runs them: `ds-ppo train` in fresh processes.

- resume continuity: iterations after a resume equal those of an uninterrupted run, and the final
  weights are identical (exported from safetensors copies and from ZeRO shards);
- a SIGKILL in the middle of a save leaves the previous checkpoint as `latest`, loadable;
- a restart before the first checkpoint is the same run as a fresh one; a torn metrics line, a
  cut trainer_state.json and `ds-ppo export --out` onto another model's directory lose nothing
  (the same cases on small fake checkpoints: test_rundir.py).
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from conftest import SMALL, clean_env, read_metrics, run_cli

# wall-clock and memory figures differ between runs; everything else must match
VOLATILE = ("time/", "tokens_per_s/", "memory/")


def _comparable(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(VOLATILE)}


# continuous batching (4 slots refilled over each rank's 16 rows) and the rollout correction run
# in the resumed iterations too: the same rows in the same order from the same random streams
CONTINUOUS = ["generation.batch_size=4", "ppo.rollout_correction=tis"]


def test_resume_continues_exactly(tmp_path):
    full, split = tmp_path / "full", tmp_path / "split"
    run_cli(["train", *SMALL, *CONTINUOUS, "iterations=4", "checkpoint.every=2",
             f"output_dir={full}"], cwd=tmp_path)
    # the split run keeps no safetensors copies: its export below consolidates ZeRO shards
    run_cli(["train", *SMALL, *CONTINUOUS, "iterations=2", "checkpoint.every=2",
             f"output_dir={split}", "checkpoint.save_hf_weights=false"], cwd=tmp_path)
    resumed = run_cli(["train", *SMALL, *CONTINUOUS, "iterations=4", "checkpoint.every=2",
                       f"output_dir={split}", "checkpoint.save_hf_weights=false"], cwd=tmp_path)
    assert "resumed from" in resumed.stdout
    a, b = read_metrics(full), read_metrics(split)
    assert [r["iteration"] for r in b] == [1, 2, 3, 4]  # nothing repeated, nothing lost
    assert all("rollout_is/weight_mean" in r and r["generation/slot_utilisation"] > 0 for r in b)
    # Exact equality: CPU float32 kernels are deterministic for the same shapes, and the
    # checkpoint restores weights, optimizer, LR schedule, KL controller, data position and RNG.
    for ra, rb in zip(a, b):
        assert _comparable(ra) == _comparable(rb), ra["iteration"]
    # and the final weights are identical: exported from the safetensors copy (full) and from
    # DeepSpeed's ZeRO shards (split), both in fp32
    for run in (full, split):
        run_cli(["export", "--checkpoint", str(run), "--out", str(run / "export"), "--value",
                 "--dtype", "fp32"], cwd=tmp_path)
    from safetensors.torch import load_file

    for sub in ("", "value"):
        wa = load_file(full / "export" / sub / "model.safetensors")
        wb = load_file(split / "export" / sub / "model.safetensors")
        assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa), sub


def test_kill_during_save_keeps_previous_checkpoint(tmp_path):
    out = tmp_path / "out"
    args = ["train", *SMALL, "iterations=3", "checkpoint.every=1", f"output_dir={out}"]
    proc = run_cli(args, cwd=tmp_path, check=False,
                   env=clean_env(DS_PPO_FAULT="kill_during_save:2"))
    assert proc.returncode == -9, proc.returncode  # SIGKILL
    ckpts = out / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "iter_000001"
    assert (ckpts / "iter_000002.tmp").exists()  # the half-written save is left behind
    with open(out / "metrics.jsonl", "a") as f:  # and a metrics row cut off by the kill
        f.write('{"iteration": 3, "score/mean": 0.1')
    # resumed with a lower learning rate: the config's, not the checkpoint's, from now on
    resumed = run_cli(args + ["policy.lr=1e-4"], cwd=tmp_path)
    assert "resumed from" in resumed.stdout and "iter_000001" in resumed.stdout
    assert "metrics.jsonl line 3 is cut off (a write was interrupted): dropped" in resumed.stdout
    assert "policy optimizer settings from the config, not the checkpoint: lr: 0.002 -> 0.0001" \
        in resumed.stdout
    assert not (ckpts / "iter_000002.tmp").exists()
    assert (ckpts / "latest").read_text().strip() == "iter_000003"
    # checkpoint.keep_last=2: older complete checkpoints are pruned
    assert sorted(p.name for p in ckpts.glob("iter_*")) == ["iter_000002", "iter_000003"]
    rows = read_metrics(out)
    # iteration 2 ran before the crash and again after the resume; metrics.jsonl keeps the
    # iterations of the latest attempt only once
    assert [r["iteration"] for r in rows] == [1, 2, 3]
    # warm-up of 2 optimizer steps per 2 steps an iteration: full lr from iteration 2 on
    assert [r["lr/policy"] for r in rows] == [2e-3, 1e-4, 1e-4]
    assert [r["lr/value"] for r in rows] == [2e-3, 2e-3, 2e-3]


@pytest.fixture(scope="module")
def restarted_run(tmp_path_factory):
    """A run SIGKILLed in the middle of its first save (no checkpoint exists yet: it leaves
    init_models, a half-written save, metrics row 1 and its lock), then the same command again."""
    work = tmp_path_factory.mktemp("restart")
    out = work / "out"
    args = ["train", *SMALL, "iterations=1", f"output_dir={out}"]
    killed = run_cli(args, cwd=work, check=False, env=clean_env(DS_PPO_FAULT="kill_during_save:1"))
    again = run_cli(args, cwd=work)
    return work, out, args, killed, again


def test_restart_before_the_first_checkpoint_is_the_same_run(restarted_run):
    _, out, _, killed, again = restarted_run
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert "taking over the lock" in again.stdout  # the killed run's lock: its pid is gone
    assert "the earlier metrics.jsonl is kept as metrics.jsonl.1" in again.stdout
    before = [json.loads(line) for line in (out / "metrics.jsonl.1").read_text().splitlines()]
    after = read_metrics(out)
    assert [r["iteration"] for r in before] == [r["iteration"] for r in after] == [1]
    assert _comparable(before[0]) == _comparable(after[0])  # same seed, nothing saved: same run
    assert (out / "checkpoints" / "latest").read_text().strip() == "iter_000001"
    assert not (out / ".ds_ppo.lock").exists()  # released at exit


def test_cut_trainer_state_stops_with_one_message(restarted_run, tmp_path):
    work, out, args, _, _ = restarted_run
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    state = copy / "checkpoints" / "iter_000001" / "trainer_state.json"
    state.write_text(state.read_text()[:20])
    proc = run_cli(args[:-1] + [f"output_dir={copy}"], cwd=work, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"checkpoint {state.parent} is unusable: {state} cannot be read" in proc.stderr
    assert "there is no earlier checkpoint: move" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_export_replaces_only_its_own_exports(restarted_run, tmp_path):
    from ds_ppo.cli import main
    from ds_ppo.run.export import MARKER

    _, out, _, _, _ = restarted_run
    other = tmp_path / "other"
    other.mkdir()
    (other / "model-00001-of-00002.safetensors").write_text("someone else's")
    assert main(["export", "--checkpoint", str(out), "--out", str(other)]) == 2  # refused
    assert main(["export", "--checkpoint", str(out), "--out", str(other), "--overwrite"]) == 0
    assert not (other / "model-00001-of-00002.safetensors").exists()
    assert (other / MARKER).exists() and (other / "model.safetensors").exists()
    assert main(["export", "--checkpoint", str(out), "--out", str(other)]) == 0  # its own export
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other"]  # no temporaries left
