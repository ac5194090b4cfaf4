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
import subprocess
import sys

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


# --------------------------------------------------- damaged checkpoints (docs/CHECKPOINTS.md)
# One saved checkpoint (the restarted run's), copied per case, two checkpoints in each copy:
# iter_000002 (a copy of iter_000001 with its own iteration and manifest) is damaged, iter_000001
# is the newest that verifies.
@pytest.fixture
def damaged(restarted_run, tmp_path):
    from ds_ppo.engine.checkpoint import manifest

    _, out, _, _, _ = restarted_run
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    root = copy / "checkpoints"
    newer = root / "iter_000002"
    shutil.copytree(root / "iter_000001", newer)
    state = json.loads((newer / "trainer_state.json").read_text())
    (newer / "trainer_state.json").write_text(json.dumps({**state, "iteration": 2}))
    manifest.write_share(newer, 0, 1)
    manifest.merge(newer)
    (root / "latest").write_text("iter_000002")
    return copy, newer, root / "iter_000001"


def _flip(path, offset: int, n: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset:offset + n] = bytes(b ^ 0xFF for b in data[offset:offset + n])
    path.write_bytes(bytes(data))


def _tensor_data(pt) -> int:
    """Where the first tensor's bytes start inside a torch.save file (a zip archive)."""
    import zipfile

    with zipfile.ZipFile(pt) as z:
        info = next(i for i in z.infolist() if "/data/" in i.filename)
    return info.header_offset + len(info.FileHeader()) + 64


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_flipped_tensor_bytes_stop_the_resume_naming_file_and_checkpoint(damaged):
    """8 bytes flipped inside a tensor load silently; the manifest's CRC-32 catches them before
    anything loads and points at the newest checkpoint that verifies."""
    from ds_ppo.engine.checkpoint.files import find_resume
    from ds_ppo.errors import CheckpointError

    out, ckpt, good = damaged
    pt = ckpt / "policy" / "ds" / "mp_rank_00_model_states.pt"
    _flip(pt, _tensor_data(pt), 8)
    with pytest.raises(CheckpointError) as err:
        find_resume(out, "auto")
    assert f"checkpoint {ckpt} is unusable: {pt} has changed since it was saved" in str(err.value)
    assert str(err.value).endswith(f"resume from the newest checkpoint that verifies: "
                                   f"resume={good}")


def test_a_garbled_manifest_is_named_too(damaged):
    from ds_ppo.engine.checkpoint.files import find_resume
    from ds_ppo.errors import CheckpointError

    out, ckpt, good = damaged
    (ckpt / "manifest.json").write_text('{"version": 1, "files": {"hf/co')
    with pytest.raises(CheckpointError, match=f"{ckpt / 'manifest.json'} cannot be read .*"
                                              f"resume={good}$"):
        find_resume(out, "auto")


def test_export_refuses_damaged_cut_or_missing_files_in_one_line(damaged, capsys):
    """16 bytes flipped in hf/model.safetensors (the manifest), then, without the manifest's
    check, the file cut to 4 KB and hf/config.json deleted (the files' own structure): each
    `ds-ppo export` is one line naming the file, and writes nothing."""
    from ds_ppo.cli import main

    out, ckpt, good = damaged
    weights, target = ckpt / "hf" / "model.safetensors", out / "export"
    _flip(weights, weights.stat().st_size // 2, 16)
    args = ["export", "--checkpoint", str(out), "--out", str(target)]
    assert main(args) == 2
    line = _one_line(capsys.readouterr().err)
    assert f"{weights} has changed since it was saved" in line
    assert line.endswith(f"ds-ppo export --checkpoint {good}")
    weights.write_bytes(weights.read_bytes()[:4096])
    assert main([*args, "--no-verify"]) == 2
    assert f"{weights} is cut off" in _one_line(_skipped_loudly(capsys.readouterr().err))
    (ckpt / "hf" / "config.json").unlink()
    assert main([*args, "--no-verify"]) == 2
    assert f"{ckpt / 'hf' / 'config.json'} is missing" in _one_line(
        _skipped_loudly(capsys.readouterr().err))
    assert not target.exists() and not list(out.glob(".export*"))


def _skipped_loudly(err: str) -> str:
    """stderr after --no-verify's warning line (which is checked)."""
    first, _, rest = err.partition("\n")
    assert "--no-verify: the files of" in first and "NOT checked" in first, err
    return rest


def test_a_damaged_pickle_is_one_message_naming_the_file(damaged):
    """Without the manifest's check (checkpoint.verify=false), bytes flipped inside the pickle
    of a DeepSpeed file make torch's unpickler raise whatever it meets (OverflowError,
    UnicodeDecodeError, ...): the resume still stops with one message naming the file."""
    from types import SimpleNamespace

    from ds_ppo.engine.checkpoint import load_checkpoint
    from ds_ppo.engine.checkpoint.files import find_resume
    from ds_ppo.errors import CheckpointError

    out, ckpt, good = damaged
    pt = ckpt / "policy" / "ds" / "mp_rank_00_model_states.pt"
    _flip(pt, 300, 16)  # inside data.pkl, the archive's first member
    assert find_resume(out, "auto", verify=False) == ckpt  # the zip directory is intact

    class Loads:  # what DeepSpeed's engine does with the file: torch.load, pickles allowed
        def load_checkpoint(self, path, tag, strict=True):
            return torch.load(path / tag / pt.name, weights_only=False)

    with pytest.raises(CheckpointError) as err:
        load_checkpoint(ckpt, SimpleNamespace(policy=Loads(), value=Loads()))
    assert str(err.value).startswith(f"checkpoint {ckpt} is unusable: {pt.parent} cannot be "
                                     "loaded (")
    assert len(str(err.value).splitlines()) == 1


def test_generate_refuses_damaged_weights_in_one_line(damaged, capsys):
    """16 bytes flipped in a checkpoint's hf/model.safetensors, then in an export's
    model.safetensors: `ds-ppo generate` stops with one line naming the file (garbage text
    otherwise); `--no-verify` generates, with a warning."""
    from ds_ppo.cli import main

    out, ckpt, good = damaged
    export = out / "exported"
    assert main(["export", "--checkpoint", str(good), "--out", str(export)]) == 0
    assert (export / "manifest.json").exists()
    capsys.readouterr()
    for weights, model in ((ckpt / "hf" / "model.safetensors", out),
                           (export / "model.safetensors", export)):
        _flip(weights, weights.stat().st_size // 2, 16)
        assert main(["generate", "--model", str(model), "--max-new-tokens", "2", "hi"]) == 2
        line = _one_line(capsys.readouterr().err)
        assert f"{weights} has changed since it was saved" in line
    assert line.endswith(f"export it again: ds-ppo export --checkpoint {good} --out {export}")
    assert main(["generate", "--model", str(export), "--max-new-tokens", "2", "--no-verify",
                 "hi"]) == 0
    assert "--no-verify: the files of" in capsys.readouterr().err


def test_a_full_disk_during_the_export_at_the_end_is_one_line_and_resumable(restarted_run,
                                                                            tmp_path):
    """The end-of-run export under a file-size limit (`ulimit -f`, smaller than the exported
    weights): exit 2, one line, no partial .final.tmp, the checkpoint intact; the same command
    without the limit finishes the export."""
    work, out, args, _, _ = restarted_run
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    size = (copy / "checkpoints" / "iter_000001" / "hf" / "model.safetensors").stat().st_size
    cmd = args[:-1] + [f"output_dir={copy}", "checkpoint.export_at_end=true"]
    limited = subprocess.run(
        ["bash", "-c", f"ulimit -f {size // 4 // 1024} && exec {sys.executable} -m ds_ppo "
         + " ".join(cmd)], cwd=work, env=clean_env(), capture_output=True, text=True,
        timeout=600)
    assert limited.returncode == 2, limited.stderr[-3000:]
    line = _one_line(limited.stderr)
    assert line.startswith("ds-ppo: error: file too large (the file-size limit, `ulimit -f`) "
                           f"while exporting to {copy / '.final.tmp'}")
    assert line.endswith("run the same command to finish the export")
    assert not (copy / ".final.tmp").exists() and not (copy / "final").exists()
    assert (copy / "checkpoints" / "latest").read_text().strip() == "iter_000001"
    run_cli(cmd, cwd=work)
    assert json.loads((copy / "final" / "ds_ppo_export.json").read_text())["iteration"] == 1
    from ds_ppo.engine.checkpoint.files import verify_export

    verify_export(copy / "final", "final")


def test_resume_after_a_zero_stage_change_goes_through_the_universal_checkpoint(tmp_path):
    """Saved with ZeRO-3 on one rank, resumed with zero_stage auto (stage 0 there on CPU): the
    stage changed, so the trained roles load DeepSpeed's universal conversion (auto's ladder then
    holds them at 3) and the run continues where it stopped."""
    out = tmp_path / "run"
    zero3 = ["deepspeed.policy.zero_stage=3", "deepspeed.value.zero_stage=3"]
    run_cli(["train", *SMALL, "iterations=2", "checkpoint.every=2", f"output_dir={out}",
             *zero3], cwd=tmp_path)
    resumed = run_cli(["train", *SMALL, "iterations=3", "checkpoint.every=2",
                       f"output_dir={out}"], cwd=tmp_path)
    assert "the ZeRO stage of policy, value changed since" in resumed.stdout
    assert "ZeRO stage per role (world size 1, universal checkpoint): policy 3 (auto), value 3 " \
           "(auto), reference 3 (auto)" in resumed.stdout
    assert [r["iteration"] for r in read_metrics(out)] == [1, 2, 3]
