"""A run directory that never loses work, driven through small fake checkpoints (no DeepSpeed):
which checkpoint a run continues from, pruning, a save interrupted or out of disk space,
corrupted checkpoint files, the output_dir lock, metrics.jsonl, and `ds-ppo export --out`.
(The end-to-end cases, with real training runs, are in test_resume.py.)
"""
from __future__ import annotations

import json
import logging
import os
import resource
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ds_ppo.engine.checkpoint import save_load as ckpt
from ds_ppo.engine.checkpoint import (TrainerState, latest_checkpoint, load_checkpoint,
                                      read_state, save_checkpoint)
from ds_ppo.engine.role_objects import PolicyRole, ValueRole
from ds_ppo.errors import UserError


# ------------------------------------------------------------------------- fakes
class _Saver:
    """Stands in for an HF config / tokenizer: save_pretrained writes one small file."""

    def save_pretrained(self, d):
        Path(d).mkdir(parents=True, exist_ok=True)
        (Path(d) / "config.json").write_text("{}")


class _Engine:
    """Stands in for a DeepSpeed engine: one torch file per save; load reads it as DeepSpeed
    does (torch.load of a pickle)."""

    def __init__(self, numel: int = 16):
        self.numel, self.module = numel, torch.nn.Module()  # a model without weights
        self.module.config = _Saver()

    def save_checkpoint(self, path, tag, save_latest, **_):
        (Path(path) / tag).mkdir(parents=True)
        torch.save({"w": torch.zeros(self.numel)}, Path(path) / tag / "mp_rank_00_model_states.pt")

    def load_checkpoint(self, path, tag, **_):
        torch.load(Path(path) / tag / "mp_rank_00_model_states.pt", weights_only=False)
        return path, {}


def _engines(numel: int = 16):
    return SimpleNamespace(policy=PolicyRole(_Engine(numel)), value=ValueRole(_Engine(numel)),
                           dtype=torch.float32)


def _save(out: Path, iteration: int, keep_last: int = 2, numel: int = 16) -> Path:
    return save_checkpoint(out, _engines(numel), TrainerState(iteration=iteration), _Saver(),
                           keep_last, save_hf_weights=False)


def _names(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").iterdir() if p.is_dir())


def _point(out: Path, name: str) -> None:
    (out / "checkpoints" / "latest").write_text(name)


# ------------------------------------------------- 1. which checkpoint a run continues from
def test_dangling_latest_continues_from_newest_complete_checkpoint(tmp_path, caplog):
    _save(tmp_path, 1)
    _save(tmp_path, 2)
    _point(tmp_path, "iter_000003")  # names a directory that does not exist
    with caplog.at_level(logging.WARNING, logger="ds_ppo"):
        assert latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "iter_000002"
    assert "iter_000003, which does not exist" in caplog.text
    assert "newest complete checkpoint" in caplog.text


def test_garbled_latest_continues_from_newest_complete_checkpoint(tmp_path, caplog):
    _save(tmp_path, 1)
    (tmp_path / "checkpoints" / "latest").write_bytes(b"\xff\xfe\x00garbage")
    with caplog.at_level(logging.WARNING, logger="ds_ppo"):
        assert latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "iter_000001"
    assert "unreadable" in caplog.text


def test_a_latest_fallback_is_warned_of_once_per_job(tmp_path, caplog, monkeypatch):
    """A start asks for the latest checkpoint several times (the finished-run check, the
    estimator check, the resume, the final save), on every rank: one line, from rank 0."""
    _save(tmp_path, 1)
    (tmp_path / "checkpoints" / "latest").write_bytes(b"\xff\xfe\x00garbage")
    monkeypatch.setenv("RANK", "1")
    with caplog.at_level(logging.WARNING, logger="ds_ppo"):
        latest_checkpoint(tmp_path)
        monkeypatch.setenv("RANK", "0")
        for _ in range(4):
            assert latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "iter_000001"
    assert caplog.text.count("is unreadable: continuing from") == 1, caplog.text


def test_no_usable_checkpoint_is_an_error_not_a_fresh_start(tmp_path):
    root = tmp_path / "checkpoints"
    (root / "iter_000004").mkdir(parents=True)
    (root / "iter_000004" / "trainer_state.json").write_text('{"iterat')  # cut off
    _point(tmp_path, "iter_000005")
    with pytest.raises(UserError, match="holds no usable checkpoint") as e:
        latest_checkpoint(tmp_path)
    assert str(root) in str(e.value)


def test_newer_checkpoints_are_moved_aside_when_resuming_an_older_one(tmp_path, caplog):
    """A kill between the rename of iter_3 and the pointer write: `latest` names iter_2 while
    iter_3 is complete. The run continues from iter_2, iter_3 is renamed aside (not lost, not
    overwritten, not pruned), and the next saves are kept."""
    for it in (1, 2, 3):
        _save(tmp_path, it)
    _point(tmp_path, "iter_000002")
    with caplog.at_level(logging.WARNING, logger="ds_ppo"):
        found = ckpt.find_resume(tmp_path, "auto")
    assert found == tmp_path / "checkpoints" / "iter_000002"
    assert "moved" in caplog.text and "iter_000003.aside" in caplog.text
    assert _names(tmp_path) == ["iter_000002", "iter_000003.aside"]
    _save(tmp_path, 3)
    _save(tmp_path, 4)
    assert _names(tmp_path) == ["iter_000003", "iter_000003.aside", "iter_000004"]
    assert latest_checkpoint(tmp_path).name == "iter_000004"


def test_pruning_never_removes_latest_or_the_checkpoint_just_written(tmp_path):
    """Newer checkpoints than the one being written (resumed from an older one by hand): pruning
    keeps the new save, which `latest` names, so the next start continues from it."""
    for it in (5, 6):
        _save(tmp_path, it)
    new = _save(tmp_path, 3)
    assert new.is_dir() and latest_checkpoint(tmp_path) == new
    assert _names(tmp_path) == ["iter_000003", "iter_000005", "iter_000006"]


def _save_best(out: Path, iteration: int, best: int | None, keep_last: int = 1) -> Path:
    """A save whose trainer state records iteration `best` as the best (checkpoint.keep_best;
    None: no best yet)."""
    state = TrainerState(iteration=iteration, best={} if best is None else {
        "metric": "score/mean", "value": float(best), "iteration": best})
    return save_checkpoint(out, _engines(), state, _Saver(), keep_last, save_hf_weights=False)


def _best_agrees(out: Path) -> Path | None:
    """The checkpoint the trainer state of `latest`'s checkpoint calls best: it exists and `best`
    names it (no `best` when the state records none)."""
    root = out / "checkpoints"
    recorded = read_state(latest_checkpoint(out)).best
    if not recorded:
        assert not (root / "best").exists(), (root / "best").read_text()
        return None
    best = root / f"iter_{recorded['iteration']:06d}"
    assert best.is_dir(), _names(out)
    assert (root / "best").read_text() == best.name
    return best


def test_pruning_never_removes_the_best(tmp_path):
    """checkpoint.keep_best: the checkpoint the trainer state calls best, which the save points
    `best` at, outlives keep_last; once the state calls another best, the old one is pruned like
    any other."""
    _save_best(tmp_path, 1, best=1, keep_last=2)
    for it in (2, 3, 4):
        _save_best(tmp_path, it, best=1, keep_last=2)
        assert _best_agrees(tmp_path).name == "iter_000001"
    assert _names(tmp_path) == ["iter_000001", "iter_000003", "iter_000004"]
    _save_best(tmp_path, 5, best=4, keep_last=2)
    assert _names(tmp_path) == ["iter_000004", "iter_000005"]
    assert _best_agrees(tmp_path).name == "iter_000004"


@pytest.mark.parametrize("before", [6, None])
def test_a_kill_at_any_step_of_a_save_keeps_the_best(tmp_path, monkeypatch, before):
    """A save of iteration 7, the new best (keep_last = 1; iteration 6 the best before it, or
    none yet),
    killed before each of its renames and removals in turn (the commit's, the pointers',
    keep_last's), then the next start and the rerun of 7 and 8 (8 not better). At every point
    the checkpoint the resumed trainer state calls best exists and `best` names it, and the
    rerun never prunes it."""
    real_replace, real_rmtree = os.replace, ckpt.shutil.rmtree
    killed_at = []
    for step in range(100):
        out = tmp_path / f"kill_{step}"
        _save_best(out, 5, best=5 if before else None)
        _save_best(out, 6, best=before)
        steps = iter(range(100))

        def step_or_kill(real):
            def call(*args, **kwargs):
                if next(steps) == step:
                    killed_at.append(Path(args[1] if real is real_replace else args[0]).name)
                    raise _Killed()
                return real(*args, **kwargs)
            return call

        monkeypatch.setattr(ckpt.os, "replace", step_or_kill(real_replace))
        monkeypatch.setattr(ckpt.shutil, "rmtree", step_or_kill(real_rmtree))
        try:
            _save_best(out, 7, best=7)
            ran_to_end = True
        except _Killed:
            ran_to_end = False
        monkeypatch.setattr(ckpt.os, "replace", real_replace)
        monkeypatch.setattr(ckpt.shutil, "rmtree", real_rmtree)
        resumed = ckpt.find_resume(out, "auto")  # the next start
        assert resumed == latest_checkpoint(out)
        assert resumed.name in ("iter_000006", "iter_000007")
        _best_agrees(out)
        _save_best(out, 7, best=7)  # the rerun: 7 is the best again, 8 is not
        _save_best(out, 8, best=7)
        assert _best_agrees(out).name == "iter_000007", (step, _names(out))
        assert {"iter_000007", "iter_000008"} <= set(_names(out))
        if ran_to_end:
            break
    # the kills covered the commit (its rename, `best`, `latest`) and keep_last's removal of 6
    assert {"iter_000007", "best", "latest", "iter_000006"} <= set(killed_at), killed_at


def test_a_start_repairs_best_from_the_trainer_state(tmp_path, caplog):
    """`best` naming an older checkpoint than the one the trainer state calls best (a save killed
    between its pointers): the next start points `best` back at the state's best, and keep_last
    then never prunes it."""
    _save_best(tmp_path, 6, best=6, keep_last=2)
    _save_best(tmp_path, 7, best=7, keep_last=2)
    (tmp_path / "checkpoints" / "best").write_text("iter_000006")
    with caplog.at_level(logging.WARNING, logger="ds_ppo"):
        ckpt.find_resume(tmp_path, "auto")
    assert "checkpoints/best now names iter_000007" in caplog.text
    assert _best_agrees(tmp_path).name == "iter_000007"
    _save_best(tmp_path, 8, best=7)
    _save_best(tmp_path, 9, best=7)
    assert _names(tmp_path) == ["iter_000007", "iter_000009"]
    assert _best_agrees(tmp_path).name == "iter_000007"


def test_pruning_orders_by_recorded_iteration_not_by_name(tmp_path, caplog):
    _save(tmp_path, 999_998)
    _save(tmp_path, 999_999)
    caplog.clear()  # the two saves above log too where an earlier test left the logger at INFO
    with caplog.at_level(logging.INFO, logger="ds_ppo"):
        _save(tmp_path, 1_000_000)  # "iter_1000000" sorts before "iter_999998" by name
    assert _names(tmp_path) == ["iter_1000000", "iter_999999"]
    assert latest_checkpoint(tmp_path).name == "iter_1000000"
    # the save, then each checkpoint pruned: one line each
    root = tmp_path / "checkpoints"
    assert [r.getMessage() for r in caplog.records] == [
        f"saved checkpoint {root / 'iter_1000000'} (iteration 1000000)",
        f"removed checkpoint {root / 'iter_999998'} (checkpoint.keep_last = 2)"]


class _Killed(BaseException):
    """A SIGKILL at this point: nothing after it runs."""


def test_a_kill_while_replacing_a_checkpoint_loses_neither(tmp_path, monkeypatch):
    """Saving iteration 3 again while iter_3 exists (and `latest` names it): a kill between
    moving the old one away and renaming the new one into place. The next start restores the old
    iter_3 instead of finding `latest` dangling."""
    _save(tmp_path, 2)
    old = _save(tmp_path, 3)
    (old / "marker").write_text("the first iter_3")
    real = os.replace

    def replace(src, dst):
        if str(src).endswith(".tmp") and Path(dst).name == "iter_000003":
            raise _Killed()
        return real(src, dst)

    monkeypatch.setattr(ckpt.os, "replace", replace)
    with pytest.raises(_Killed):
        _save(tmp_path, 3)
    monkeypatch.setattr(ckpt.os, "replace", real)
    found = ckpt.find_resume(tmp_path, "auto")  # the next start
    assert found == old and (found / "marker").read_text() == "the first iter_3"


# ---------------------------------------------------------------- 5. corrupted checkpoints
def test_cut_trainer_state_names_the_file_and_the_previous_checkpoint(tmp_path):
    _save(tmp_path, 1)
    bad = _save(tmp_path, 2)
    (bad / "trainer_state.json").write_text('{"iteration": 2, "kl_con')
    with pytest.raises(UserError) as e:
        read_state(bad)
    msg = str(e.value)
    assert str(bad / "trainer_state.json") in msg
    assert f"resume from the previous checkpoint: resume={tmp_path / 'checkpoints' / 'iter_000001'}" \
        in msg
    assert e.value.exit_code == 2


@pytest.mark.parametrize("damage", ["cut", "garbage"])
def test_corrupted_torch_file_names_the_file(tmp_path, damage):
    _save(tmp_path, 1)
    bad = _save(tmp_path, 2)
    f = bad / "policy" / "ds" / "mp_rank_00_model_states.pt"
    data = f.read_bytes()
    f.write_bytes(data[:len(data) // 2] if damage == "cut" else os.urandom(len(data)))
    with pytest.raises(UserError) as e:  # DeepSpeed's load (the fake's torch.load) fails
        load_checkpoint(bad, _engines())
    assert str(bad / "policy" / "ds") in str(e.value)
    assert "resume=" + str(tmp_path / "checkpoints" / "iter_000001") in str(e.value)
    with pytest.raises(UserError) as e:  # and the check before any model is built names it
        ckpt.verify_checkpoint(bad, world_size=1)
    assert str(f) in str(e.value) and "corrupted or cut off" in str(e.value)


def test_a_deleted_manifest_does_not_switch_the_check_off(tmp_path, caplog):
    """A checkpoint saved with a manifest records so in trainer_state.json: deleting
    manifest.json is an error naming it, not a resume that loads unchecked; one saved without
    (checkpoint.verify=false) loads with a warning that says so, and checkpoint.verify=false
    on a checkpoint that has one warns that it is not checked."""
    from ds_ppo.engine.checkpoint.files import find_resume
    from ds_ppo.errors import CheckpointError

    path = _save(tmp_path, 1)
    assert read_state(path).manifest
    (path / "manifest.json").unlink()
    with caplog.at_level(logging.INFO, logger="ds_ppo"), pytest.raises(CheckpointError) as e:
        find_resume(tmp_path, "auto")
    assert f"{path / 'manifest.json'} is missing (its trainer_state.json records that it was " \
           "saved with one" in str(e.value)
    assert "verified" not in caplog.text
    unchecked = tmp_path / "unchecked"
    path = save_checkpoint(unchecked, _engines(), TrainerState(iteration=1), _Saver(), 2,
                           save_hf_weights=False, verify=False)
    assert not read_state(path).manifest and not (path / "manifest.json").exists()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ds_ppo"):
        assert find_resume(unchecked, "auto") == path
    assert "has no manifest" in caplog.text and "loaded unchecked" in caplog.text
    assert "verified" not in caplog.text
    checked = _save(tmp_path / "skipped", 1)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ds_ppo"):
        assert find_resume(tmp_path / "skipped", "auto", verify=False) == checked
    assert "loaded WITHOUT checking its files against its manifest" in caplog.text


def test_exports_are_checked_wherever_they_load(tmp_path, caplog):
    """An export carries a manifest that its marker records: a flipped byte, a deleted
    manifest or a deleted marker is an error naming the file at a model path (policy.path
    etc.) and in `ds-ppo generate`; checkpoint.verify=false / --no-verify warn instead."""
    from ds_ppo.engine.checkpoint.files import verify_model_paths
    from ds_ppo.engine.checkpoint.hf_export import write_marker
    from ds_ppo.errors import CheckpointError
    from ds_ppo.run.generate import check_files

    export = tmp_path / "final"
    export.mkdir()
    (export / "config.json").write_text("{}")
    (export / "model.safetensors").write_bytes(bytes(range(256)) * 8)
    write_marker(export, str(tmp_path / "checkpoints" / "iter_000003"), torch.bfloat16, False)
    listed = json.loads((export / "manifest.json").read_text())["files"]
    assert sorted(listed) == ["config.json", "ds_ppo_export.json", "model.safetensors"]
    with caplog.at_level(logging.INFO, logger="ds_ppo"):
        verify_model_paths({"policy.path": str(export), "value.path": None}, True)
        check_files(export)
    assert f"verified policy.path {export} against its manifest" in caplog.text

    weights = export / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[1000:1016] = bytes(b ^ 0xFF for b in data[1000:1016])
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as e:
        verify_model_paths({"reward.model": str(export)}, True)
    assert str(e.value) == (
        f"reward.model {export} is unusable: {weights} has changed since it was saved "
        f"(CRC-32 {e.value.args[0].split('CRC-32 ')[1][:8]}, saved as "
        f"{listed['model.safetensors'][1]:08x}: damaged on disk or in transfer). To use it, "
        f"export it again: ds-ppo export --checkpoint {tmp_path / 'checkpoints' / 'iter_000003'}"
        f" --out {export}")
    with pytest.raises(CheckpointError, match="--model .* has changed since it was saved"):
        check_files(export)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ds_ppo"):
        verify_model_paths({"policy.path": str(export)}, False)
    assert f"policy.path {export} is loaded WITHOUT checking" in caplog.text
    check_files(export, verify=False)  # warns on stderr (tested through the CLI)

    (export / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match=r"manifest.json is missing \(its ds_ppo_export"
                                              r".json records that it was written with one"):
        check_files(export)
    write_marker(export, "x", torch.bfloat16, False)  # a fresh manifest; now lose the marker
    (export / "ds_ppo_export.json").unlink()
    with pytest.raises(CheckpointError, match="ds_ppo_export.json is missing"):
        verify_model_paths({"policy.path": str(export)}, True)


def test_generate_checks_a_lora_checkpoint_adapter(tmp_path):
    """`ds-ppo generate --model CHECKPOINT` loads hf/ (here a LoRA policy's PEFT adapter):
    checked against the checkpoint's manifest, named with the checkpoint to use instead."""
    from ds_ppo.errors import CheckpointError
    from ds_ppo.run.generate import check_files, model_dir

    good = _save(tmp_path, 1)
    for path in (good, _save(tmp_path, 2)):  # the adapter is written before the manifest
        (path / "hf" / "adapter_config.json").write_text("{}")
        (path / "hf" / "adapter_model.safetensors").write_bytes(bytes(range(256)) * 4)
        (path / "manifest.json").unlink()
        from ds_ppo.engine.checkpoint import manifest

        manifest.write_share(path, 0, 1)
        manifest.merge(path)
    path = model_dir(str(tmp_path))
    assert path == tmp_path / "checkpoints" / "iter_000002" / "hf"
    check_files(path)
    adapter = path / "adapter_model.safetensors"
    data = bytearray(adapter.read_bytes())
    data[500:516] = bytes(b ^ 0xFF for b in data[500:516])
    adapter.write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as e:
        check_files(path)
    assert str(e.value).startswith(f"checkpoint {path.parent} is unusable: {adapter} has "
                                   "changed since it was saved")
    assert str(e.value).endswith(f"generate from the newest checkpoint that verifies: "
                                 f"ds-ppo generate --model {good}")
    (path.parent / "trainer_state.json").unlink()  # the other record: still checked
    with pytest.raises(CheckpointError, match="trainer_state.json is missing"):
        check_files(path)


def test_a_lora_merge_checks_its_base_when_that_is_an_export(tmp_path):
    """`ds-ppo export` of a LoRA policy merges the adapter into its base: a base that is a
    ds_ppo export (e.g. an SFT run's final/) is checked against its manifest first."""
    from ds_ppo.engine.checkpoint import manifest
    from ds_ppo.engine.checkpoint.hf_export import write_marker
    from ds_ppo.errors import CheckpointError
    from ds_ppo.run.export import export_checkpoint

    base = tmp_path / "sft_final"
    base.mkdir()
    (base / "model.safetensors").write_bytes(bytes(range(256)) * 8)
    write_marker(base, "sft", torch.bfloat16, False)
    path = _save(tmp_path / "run", 1)
    state = json.loads((path / "trainer_state.json").read_text())
    state["lora_bases"] = {"policy": {"path": str(base), "fingerprint": "x"}}
    (path / "trainer_state.json").write_text(json.dumps(state))
    (path / "manifest.json").unlink()
    manifest.write_share(path, 0, 1)
    manifest.merge(path)
    weights = base / "model.safetensors"
    weights.write_bytes(b"\x00" * 16 + weights.read_bytes()[16:])
    with pytest.raises(CheckpointError, match=f"the LoRA policy's base model {base} is unusable: "
                                              f"{weights} has changed since it was saved"):
        export_checkpoint(path, tmp_path / "out", torch.bfloat16)
    assert not (tmp_path / "out").exists()


def test_missing_rng_file_is_an_error_not_a_world_size_change(tmp_path, caplog):
    path = _save(tmp_path, 1)
    (path / "rng" / "rank_00000.pt").unlink()
    with caplog.at_level(logging.WARNING, logger="ds_ppo"), pytest.raises(UserError) as e:
        load_checkpoint(path, _engines())
    assert str(path / "rng" / "rank_00000.pt") in str(e.value) and "is missing" in str(e.value)
    assert "move" in str(e.value)  # no earlier checkpoint: says how to start fresh
    assert "world size changed" not in caplog.text


def test_out_of_memory_while_loading_is_not_called_a_corrupted_checkpoint(tmp_path):
    """A checkpoint that fails to load for want of memory (or a failed collective) is intact:
    the error stays what it is, it does not send the user back to an older checkpoint."""
    _save(tmp_path, 1)
    path = _save(tmp_path, 2)

    class _OOM(_Engine):
        def load_checkpoint(self, path, tag, **_):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    with pytest.raises(torch.OutOfMemoryError, match="CUDA out of memory"):
        load_checkpoint(path, SimpleNamespace(policy=PolicyRole(_OOM()),
                                              value=ValueRole(_Engine())))


# ------------------------------------------------------------------------- 7. disk full
def test_file_size_limit_during_save_keeps_previous_checkpoint(tmp_path):
    """torch.save under a file-size limit fails as on a full disk: with an errno-less
    `enforce fail at inline_container.cc`."""
    prev = _save(tmp_path, 1)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, hard))
    try:
        with pytest.raises(UserError) as e:
            _save(tmp_path, 2, numel=100_000)  # a 400 kB file
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    msg = str(e.value)
    assert msg.startswith("file too large") and "while writing" in msg
    assert f"the previous checkpoint {prev} is intact" in msg
    assert latest_checkpoint(tmp_path) == prev and _names(tmp_path) == ["iter_000001"]


def test_no_space_left_during_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    prev = _save(tmp_path, 1)
    monkeypatch.setenv("DS_PPO_FAULT", "enospc_during_save:2")  # the fault-injection hook
    with pytest.raises(UserError) as e:
        _save(tmp_path, 2)
    msg = str(e.value)
    assert msg.startswith("no space left") and "iter_000002.tmp" in msg
    assert f"the previous checkpoint {prev} is intact" in msg
    assert latest_checkpoint(tmp_path) == prev and _names(tmp_path) == ["iter_000001"]


# ------------------------------------------------------------------------------ 2. lock
def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_lock_live_holder_refused_stale_taken_over_released_at_exit(tmp_path, caplog):
    import socket

    from ds_ppo.run.rundir import LOCK_NAME, acquire_lock

    lock = tmp_path / LOCK_NAME
    host = socket.gethostname()
    # a live run holds it
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lock.write_text(json.dumps({"host": host, "pid": child.pid, "started": "then"}))
        with pytest.raises(UserError) as e:
            acquire_lock(tmp_path)
        assert f"process {child.pid} on host {host}" in str(e.value)
        assert e.value.exit_code == 2
    finally:
        child.kill()
        child.wait()
    # its process is gone (killed): taken over with a warning
    lock.write_text(json.dumps({"host": host, "pid": _dead_pid(), "started": "then"}))
    with caplog.at_level(logging.WARNING, logger="ds_ppo"):
        assert acquire_lock(tmp_path) == lock
    assert "taking over" in caplog.text and json.loads(lock.read_text())["pid"] == os.getpid()
    # released when the holding process exits
    from ds_ppo.run.rundir import release_lock

    release_lock(lock)
    code = f"from ds_ppo.run.rundir import acquire_lock; from pathlib import Path; " \
           f"acquire_lock(Path({str(tmp_path)!r})); assert Path({str(lock)!r}).exists()"
    subprocess.run([sys.executable, "-c", code], check=True)
    assert not lock.exists()


def test_lock_left_by_an_earlier_process_with_this_pid_is_released_at_exit(tmp_path):
    """A restarted container often gives rank 0 the pid of the killed run's rank 0: the lock
    that run left names this very process. It is taken, and released at exit like any other
    (else it outlives the run and stops the next one on another host)."""
    from ds_ppo.run.rundir import LOCK_NAME

    lock = tmp_path / LOCK_NAME
    code = ("import json, os, socket; from pathlib import Path; "
            "from ds_ppo.run.rundir import acquire_lock; "
            f"lock = Path({str(lock)!r}); lock.write_text(json.dumps({{'host': "
            "socket.gethostname(), 'pid': os.getpid(), 'started': 'before the kill'})); "
            f"assert acquire_lock(Path({str(tmp_path)!r})) == lock")
    subprocess.run([sys.executable, "-c", code], check=True)
    assert not lock.exists()


def test_train_refuses_an_output_dir_in_use(tmp_path):
    """`ds-ppo train` on a directory whose lock a live process holds: exit 2, no training."""
    import socket

    from conftest import SMALL, run_cli

    out = tmp_path / "o"
    out.mkdir()
    (out / ".ds_ppo.lock").write_text(json.dumps({"host": socket.gethostname(),
                                                  "pid": os.getpid(), "started": "now"}))
    proc = run_cli(["train", *SMALL, "iterations=1", f"output_dir={out}"], cwd=tmp_path,
                   check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"output_dir {out} is in use by another run" in proc.stderr
    assert "Traceback" not in proc.stderr and not (out / "metrics.jsonl").exists()


# --------------------------------------------------------------------- 4. metrics.jsonl
def test_metrics_log_torn_last_line_dropped_malformed_line_named(tmp_path, caplog):
    from ds_ppo.run.rundir import read_metrics_log, start_metrics_log

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"iteration": 1, "x": 0.5}\n{"iteration": 2, "x": 0.25}\n{"iteration": 3, "x')
    with caplog.at_level(logging.WARNING, logger="ds_ppo"):
        start_metrics_log(tmp_path, 2)
    assert "line 3 is cut off" in caplog.text
    assert [r["iteration"] for r in read_metrics_log(path)] == [1, 2]
    path.write_text('{"iteration": 1}\n{"iterat\n{"iteration": 2}\n')
    with pytest.raises(UserError, match=f"{path} line 2 is not a metrics row"):
        start_metrics_log(tmp_path, 2)
    # a fresh start keeps an earlier log: moved aside, never truncated
    path.write_text('{"iteration": 1}\n')
    start_metrics_log(tmp_path, None)
    assert not path.exists() and (tmp_path / "metrics.jsonl.1").read_text() == '{"iteration": 1}\n'


def test_samples_log_keeps_the_rows_up_to_the_resumed_iteration(tmp_path):
    """samples.jsonl is trimmed on resume (and moved aside on a fresh start) as metrics.jsonl."""
    from ds_ppo.run.rundir import start_metrics_log
    from ds_ppo.run.samples import read_samples

    path = tmp_path / "samples.jsonl"
    path.write_text("".join(json.dumps({"iteration": i, "split": "train", "prompt": "p",
                                        "response": "r", "score": 0.0}) + "\n"
                            for i in (2, 2, 4, 6)))
    start_metrics_log(tmp_path, 4)  # iteration 6 runs again after the resume
    assert [r["iteration"] for r in read_samples(tmp_path)] == [2, 2, 4]
    start_metrics_log(tmp_path, None)
    assert not path.exists() and (tmp_path / "samples.jsonl.1").exists()


# --------------------------------------------------------------------------- 3. export
def test_export_refuses_a_foreign_directory(tmp_path, capsys):
    from ds_ppo.cli import main

    _save(tmp_path / "run", 1)
    other = tmp_path / "other_model"
    other.mkdir()
    (other / "model-00001-of-00002.safetensors").write_text("someone else's weights")
    (other / "config.json").write_text("{}")
    rc = main(["export", "--checkpoint", str(tmp_path / "run"), "--out", str(other)])
    assert rc == 2
    err = capsys.readouterr().err
    assert f"--out {other} is not empty and is not an earlier ds_ppo export" in err
    assert "--overwrite" in err
    assert sorted(p.name for p in other.iterdir()) == ["config.json",
                                                       "model-00001-of-00002.safetensors"]


def test_export_writes_atomically(tmp_path):
    from ds_ppo.run.export import MARKER, check_export_target, write_atomically

    out = tmp_path / "model"
    out.mkdir()
    (out / MARKER).write_text("{}")
    (out / "model.safetensors").write_text("the earlier export")
    check_export_target(out, overwrite=False)  # an earlier export: may be replaced

    def fails(tmp):
        (tmp / "model.safetensors").write_text("half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        write_atomically(out, fails)
    assert (out / "model.safetensors").read_text() == "the earlier export"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no temporary left
    write_atomically(out, lambda tmp: (tmp / "model.safetensors").write_text("new"))
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_a_reward_timeout_saves_the_random_state_of_the_iterations_start(tmp_path):
    """A hung reward function in iteration N: the checkpoint of N-1 it saves holds the random
    state from N's start (not from after N's sampling), so the resume samples N exactly as the
    uninterrupted run does."""
    from ds_ppo.config import load_config
    from ds_ppo.errors import RewardTimeout
    from ds_ppo.run.saves import stop_on_reward_error

    out = tmp_path / "run"
    cfg = load_config(None, [f"output_dir={out}", "checkpoint.save_hf_weights=false"])
    torch.manual_seed(123)
    at_start = ckpt.rng_state()
    expected = torch.rand(4)  # what iteration N's sampling draws first
    err = stop_on_reward_error(RewardTimeout("hung"), cfg, out, _engines(),
                               TrainerState(iteration=3), _Saver(), None, at_start)
    assert "checkpoint is" in str(err)
    saved = torch.load(out / "checkpoints" / "iter_000003" / "rng" / "rank_00000.pt",
                       weights_only=True)
    ckpt.set_rng_state(saved)
    assert torch.equal(torch.rand(4), expected)
