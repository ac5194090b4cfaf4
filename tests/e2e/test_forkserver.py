"""The tests' fork server (tests/support/forkserver.py): a `ds-ppo` command forked from it must
behave as the same command in a new interpreter, since most e2e tests run through it."""
from __future__ import annotations

import subprocess

import pytest

from conftest import _FORK_SERVER, run_cli

SMALL = ["tracking.enabled=false", "ppo.rollout_batch_size=8", "ppo.mini_batch_size=8",
         "ppo.micro_batch_size=4", "generation.max_new_tokens=6", "checkpoint.export_at_end=false"]


def _lines(text: str) -> list[str]:
    """The progress lines, without their timings."""
    return [line.split("| gen")[0] for line in text.splitlines() if line.startswith("iter ")]


def test_a_forked_command_prints_and_exits_as_a_new_interpreter_does(tmp_path):
    forked = run_cli(["train", *SMALL, "iterations=2", f"output_dir={tmp_path / 'a'}"],
                     cwd=tmp_path)
    fresh = run_cli(["train", *SMALL, "iterations=2", f"output_dir={tmp_path / 'b'}"],
                    cwd=tmp_path, fresh=True)
    assert _FORK_SERVER and _FORK_SERVER[0].proc.poll() is None  # the first ran forked
    assert len(_lines(forked.stdout)) == 2 and _lines(forked.stdout) == _lines(fresh.stdout)
    bad = [run_cli(["train", "ppo.mini_batch_size=7"], cwd=tmp_path, check=False, **kw)
           for kw in ({}, {"fresh": True})]
    assert [p.returncode for p in bad] == [2, 2] and bad[0].stderr == bad[1].stderr
    assert bad[0].stdout == bad[1].stdout == ""


def test_a_command_past_its_timeout_is_killed_and_the_server_goes_on(tmp_path):
    with pytest.raises(subprocess.TimeoutExpired):
        run_cli(["train", *SMALL, "iterations=500", f"output_dir={tmp_path / 'long'}"],
                cwd=tmp_path, timeout=3)
    again = run_cli(["config", "--describe"], cwd=tmp_path)
    assert again.returncode == 0 and "ppo.kl_coef" in again.stdout


def test_the_command_starts_in_its_directory_with_it_first_on_the_path(tmp_path):
    """As `python -m ds_ppo` in a directory: a reward module there is importable."""
    (tmp_path / "here_rewards.py").write_text(
        "import os\n"
        "def score(prompts, responses):\n"
        "    assert os.getcwd() == %r\n"
        "    return [1.0] * len(responses)\n" % str(tmp_path))
    proc = run_cli(["train", *SMALL, "iterations=1", "reward.function=here_rewards:score",
                    f"output_dir={tmp_path / 'o'}"], cwd=tmp_path)
    assert "score +1.0000" in proc.stdout
