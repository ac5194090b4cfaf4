"""examples/ as the README uses it: its commands, as written, from a directory that holds
examples/ (as the repository root does), cut short by overrides appended at the end (steps,
iterations): SFT -> reward model -> PPO from both, the reward function's GRPO run, and the
environment. Each writes only under the test's directory."""
from __future__ import annotations

import re
import shlex

import pytest

from conftest import REPO, read_metrics, run_cli
from ds_ppo.cli import main

SHORT = ["sft.steps=2", "rm.steps=2", "dpo.steps=2", "iterations=1", "tracking.enabled=false",
         "data.eval_size=16"]


def readme_commands(path) -> list[list[str]]:
    """The `ds-ppo ...` commands of a markdown file's ```bash blocks that use examples/ (lines
    ending in a backslash continued), as argument lists without the leading `ds-ppo`."""
    found = []
    for block in re.findall(r"```bash\n(.*?)```", path.read_text(), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0].strip()
            if line.startswith("ds-ppo ") and "examples/" in line:
                found.append(shlex.split(line)[1:])
    return found


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    work = tmp_path_factory.mktemp("examples")
    (work / "examples").symlink_to(REPO / "examples")
    return work


def test_the_readme_uses_the_examples():
    commands = readme_commands(REPO / "README.md")
    assert [c[0] for c in commands] == ["train", "train", "sft", "rm", "train", "dpo"], commands
    assert (REPO / "examples" / "README.md").exists()


def test_the_first_command_is_a_valid_config_as_written(workdir, capsys, monkeypatch):
    monkeypatch.chdir(workdir)
    first = readme_commands(REPO / "README.md")[0]
    assert main([first[0], "--dry-run", *first[1:]]) == 0, capsys.readouterr().err


@pytest.mark.slow
def test_sft_then_reward_model_then_ppo_as_the_readme_says(workdir):
    sft, rm, ppo, dpo = readme_commands(REPO / "README.md")[2:]
    run_cli([*sft, *SHORT], cwd=workdir)
    assert (workdir / "out" / "sft" / "final" / "model.safetensors").exists()
    proc = run_cli([*rm, *SHORT], cwd=workdir)
    assert "policy.path from the command line replaces the config file's policy.arch" in proc.stderr
    assert (workdir / "out" / "rm" / "final" / "model.safetensors").exists()
    proc = run_cli([*ppo, *SHORT], cwd=workdir)
    assert ("reward.model from the command line replaces the config file's reward.function, "
            "data.reward_keys") in proc.stderr
    (row,) = read_metrics(workdir / "out" / "ppo")
    assert "loss/value" in row  # gae: the value model (from the reward model) trained
    run_cli([*dpo, *SHORT], cwd=workdir)  # or DPO from the SFT model on the same pairs
    assert (workdir / "out" / "dpo" / "final" / "model.safetensors").exists()


@pytest.mark.slow
def test_the_reward_function_and_the_environment(workdir):
    reward_fn = readme_commands(REPO / "README.md")[1]
    run_cli([*reward_fn, "output_dir=outputs/fn", *SHORT], cwd=workdir)
    (row,) = read_metrics(workdir / "outputs" / "fn")
    assert 0.0 <= row["score/mean"] <= 1.0
    env = next(c for c in readme_commands(REPO / "examples" / "README.md")
               if any(a.startswith("env.function=") for a in c))
    run_cli([*env, "output_dir=outputs/env", *SHORT], cwd=workdir)
    (row,) = read_metrics(workdir / "outputs" / "env")
    assert "env/correct" in row and row["env/turns_mean"] >= 1.0


def test_the_readme_shows_the_example_reward_function_as_it_is():
    readme = (REPO / "README.md").read_text()
    shown = re.search(r"```python\n# examples/my_rewards.py[^\n]*\n(.*?)```", readme, re.S)
    assert shown is not None
    assert shown.group(1) in (REPO / "examples" / "my_rewards.py").read_text().replace(
        '    """1.0 where the response, stripped, is the row\'s answer; else 0.0."""\n', "")
