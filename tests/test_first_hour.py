"""What a new user meets first, through the installed `ds-ppo` console script: the README's reward
function example, paths checked by `--dry-run`, config errors on hostile input, `config --describe`."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import clean_env


def ds_ppo(args: list[str], cwd: Path, timeout: float = 60, **env: str
           ) -> subprocess.CompletedProcess:
    """The installed console script (not `python -m`, which puts the working directory on the
    import path by itself), with this checkout first on PYTHONPATH."""
    exe = shutil.which("ds-ppo")
    assert exe, "the ds-ppo console script is not on PATH (pip install -e .)"
    return subprocess.run([exe, *args], cwd=cwd, env=clean_env(**env), capture_output=True,
                          text=True, timeout=timeout)


# ----------------------------------------------------------------- reward function from cwd
def test_console_script_imports_the_reward_module_from_the_working_directory(tmp_path):
    (tmp_path / "my_rewards.py").write_text(
        "def exact_answer(prompts, responses, answer):\n"
        "    return [float(r.strip().endswith(a)) for r, a in zip(responses, answer)]\n")
    (tmp_path / "problems.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    proc = ds_ppo(["train", "--dry-run", "reward.function=my_rewards:exact_answer",
                   "data.path=problems.jsonl", "data.reward_keys=[answer]"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "config OK" in proc.stdout
    # a module that is not there names the directory it was looked for in
    proc = ds_ppo(["train", "--dry-run", "reward.function=their_rewards:exact_answer",
                   "data.path=problems.jsonl", "data.reward_keys=[answer]"], cwd=tmp_path)
    assert proc.returncode == 2
    assert "their_rewards" in proc.stderr and str(tmp_path) in proc.stderr
    assert "Traceback" not in proc.stderr
