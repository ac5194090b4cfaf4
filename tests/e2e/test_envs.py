"""Multi-turn rollouts end to end (`ds-ppo train --config calculator`): an environment that
raises mid-run stops the job with its name after a checkpoint of the last completed iteration,
and the same command resumes exactly (the metrics equal an uninterrupted run's); here with a
critic-free estimator and packed micro-batches."""
from __future__ import annotations

from conftest import SMALL, clean_env, read_metrics, run_cli

FLAKY = '''
import os
from ds_ppo.envs.calculator import Calculator

RESETS = [0]


class Flaky(Calculator):
    """The calculator, whose sandbox goes away in the third iteration (16 episodes each)."""

    def reset(self, prompt, answer):
        RESETS[0] += 1
        if os.environ.get("FLAKY_ENV_FAIL") and RESETS[0] > 32:
            raise RuntimeError("the sandbox went away")
        super().reset(prompt, answer)
'''

VOLATILE = ("time/", "tokens_per_s/", "memory/")


def test_failing_environment_checkpoints_and_the_run_resumes_exactly(tmp_path):
    (tmp_path / "flaky_env.py").write_text(FLAKY)
    args = ["train", "--config", "calculator", *SMALL, "iterations=4", "checkpoint.every=0",
            "env.function=flaky_env:Flaky", "ppo.advantage_estimator=grpo",
            "ppo.samples_per_prompt=2", "ppo.rollout_batch_size=8",
            "ppo.micro_batch_tokens=48", "policy.arch.hidden_size=64",
            "policy.arch.intermediate_size=128"]
    full = run_cli(args + [f"output_dir={tmp_path / 'full'}", "checkpoint.save_at_end=false"],
                   cwd=tmp_path)
    assert "env/" not in full.stderr
    env = clean_env()
    env["FLAKY_ENV_FAIL"] = "1"
    split = args + [f"output_dir={tmp_path / 'split'}"]
    failed = run_cli(split, cwd=tmp_path, env=env, check=False)
    assert failed.returncode == 2, failed.stderr[-3000:]
    assert ("env.function = 'flaky_env:Flaky' (reset) raised RuntimeError: the sandbox went "
            "away") in failed.stderr
    assert "iter_000002" in failed.stderr and "run the same command again" in failed.stderr
    resumed = run_cli(split, cwd=tmp_path)
    assert "resumed from" in resumed.stdout
    a, b = read_metrics(tmp_path / "full"), read_metrics(tmp_path / "split")
    assert [r["iteration"] for r in b] == [1, 2, 3, 4]
    for ra, rb in zip(a, b):
        assert ({k: v for k, v in ra.items() if not k.startswith(VOLATILE)} ==
                {k: v for k, v in rb.items() if not k.startswith(VOLATILE)}), ra["iteration"]
    assert a[-1]["env/turns_mean"] >= 1.0 and "env/tool_call" in a[-1]
    assert a[-1]["padding/update_positions_per_token"] == 1.0  # packed
