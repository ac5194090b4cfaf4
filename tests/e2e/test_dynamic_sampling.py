"""ppo.dynamic_sampling in `ds-ppo train`: a GRPO run refills its batch with groups that carry
signal (metrics sampling/*, no signal-free group left in the batch while rounds remain), and a
resumed run continues from the saved stream position, and with the entropy bonus's coefficient
(ppo.entropy_target) saved, exactly as the uninterrupted run."""
from __future__ import annotations

import json

import pytest

from conftest import read_metrics, run_cli

VOLATILE = ("time/", "tokens_per_s/", "memory/")
DYNAMIC = ["ppo.advantage_estimator=grpo", "ppo.samples_per_prompt=4", "ppo.rollout_batch_size=8",
           "ppo.dynamic_sampling=true", "tracking.enabled=false", "checkpoint.every=2",
           "checkpoint.export_at_end=false",
           # a target above any entropy: the coefficient follows the entropy every iteration,
           # and a resume that restarted it (at entropy_coef) would change iteration 3
           "ppo.entropy_coef=0.01", "ppo.entropy_target=100"]


def _comparable(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(VOLATILE)}


def test_dynamic_sampling_refills_and_resumes_exactly(tmp_path):
    full, split = tmp_path / "full", tmp_path / "split"
    run_cli(["train", *DYNAMIC, "iterations=4", f"output_dir={full}"], cwd=tmp_path)
    run_cli(["train", *DYNAMIC, "iterations=2", f"output_dir={split}"], cwd=tmp_path)
    resumed = run_cli(["train", *DYNAMIC, "iterations=4", f"output_dir={split}"], cwd=tmp_path)
    assert "resumed from" in resumed.stdout
    a, b = read_metrics(full), read_metrics(split)
    assert [r["iteration"] for r in b] == [1, 2, 3, 4]
    for ra, rb in zip(a, b):
        assert _comparable(ra) == _comparable(rb), ra["iteration"]
    drawn = 0
    for r in a:
        assert r["sampling/rounds"] >= 1 and r["sampling/prompts_drawn"] == 8 * r["sampling/rounds"]
        if r["sampling/filled_frac"] == 0:  # enough groups with signal: no flat group trained
            assert r["group/zero_std_frac"] == 0
        drawn += r["sampling/prompts_drawn"]
    # the tiny task's random policy scores many groups alike: the refill drew more than 4 x 8
    assert drawn > 32 and any(r["sampling/rounds"] > 1 for r in a)
    state = json.loads((full / "checkpoints" / "iter_000004" / "trainer_state.json").read_text())
    assert state["job_state"]["prompts_drawn"] == drawn
    # each iteration trains with the coefficient of the last one's entropy
    coefs = [r["policy/entropy_coef"] for r in a] + [state["job_state"]["entropy_controller"]["value"]]
    assert coefs[0] == 0.01
    for r, coef in zip(a, coefs[1:]):
        assert coef == pytest.approx(0.01 * (1 - r["policy/entropy"] / 100)) and coef < 0.01
