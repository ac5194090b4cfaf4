"""No silent hang on DeepSpeed's C++ extensions: nothing is JIT-built on a CPU machine, and a build
lock left by a killed build is named (with the path to remove) instead of waited on forever."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

from conftest import SMALL, clean_env
from ds_ppo.engine.extensions import stale_locks


def _lock(root, name="deepspeed_shm_comm", age_s=600.0):
    path = root / name / "lock"
    path.parent.mkdir(parents=True)
    path.touch()
    os.utime(path, (time.time() - age_s, time.time() - age_s))
    return path


def test_a_lock_no_process_holds_is_stale_and_a_held_one_is_not(tmp_path):
    left = _lock(tmp_path, "killed_build")
    held = tmp_path / "building_now" / "lock"
    held.parent.mkdir()
    # a build in progress: torch's FileBaton keeps the lock file open until it releases it
    holder = subprocess.Popen(
        [sys.executable, "-c", "import time\nfrom torch.utils.file_baton import FileBaton\n"
         f"assert FileBaton({str(held)!r}).try_acquire()\nprint('held', flush=True)\n"
         "time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        os.utime(held, (time.time() - 600, time.time() - 600))
        assert stale_locks(tmp_path) == [left]
    finally:
        holder.kill()
        holder.wait()
    assert sorted(stale_locks(tmp_path)) == sorted([left, held])  # its owner is gone
    assert stale_locks(tmp_path / "missing") == []


def test_train_names_a_stale_build_lock_instead_of_waiting_forever(tmp_path):
    """Through the console script, with the lock in the extensions cache that DeepSpeed uses."""
    lock = _lock(tmp_path / "ext")
    exe = shutil.which("ds-ppo")
    assert exe, "the ds-ppo console script is not on PATH (pip install -e .)"
    t0 = time.time()
    proc = subprocess.run([exe, "train", *SMALL, "iterations=1", f"output_dir={tmp_path / 'out'}"],
                          cwd=tmp_path,
                          env=clean_env(TORCH_EXTENSIONS_DIR=str(tmp_path / "ext")),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"rm {lock}" in proc.stderr and "Traceback" not in proc.stderr
    assert time.time() - t0 < 120
