"""The recipe end to end, short (`python -m ds_ppo.run.pipeline --quick`, what
launch/recipe_tiny.sh runs): `ds-ppo sft` from a random-init model on the digit-sum task, then
`ds-ppo train` (GRPO, exact-match reward) from its export; RL raises the held-out greedy
exact-match accuracy over the SFT model's, and MLflow holds the pipeline as a parent run with a
child run per step (tracking.parent_run_id). The full recipe's numbers: docs/RESULTS.md."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import clean_env

pytestmark = pytest.mark.slow


def test_quick_recipe_gains_accuracy_and_nests_its_mlflow_runs(tmp_path):
    out = tmp_path / "recipe"
    proc = subprocess.run([sys.executable, "-m", "ds_ppo.run.pipeline", "--quick", "--seeds", "1",
                           "--out", str(out)], cwd=tmp_path, env=clean_env(),
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (res,) = json.loads((out / "results.json").read_text())
    assert 0.05 < res["sft_acc"] < 0.9, res  # competent, not perfect
    assert res["grpo_acc"] >= res["sft_acc"] + 0.05, res  # RL gains on held-out problems
    assert res["grpo_score_last"] > res["grpo_score_first"], res
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{out / 'mlruns' / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("recipe").experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert len(parents) == 1 and parents[0].data.metrics["grpo_acc"] == res["grpo_acc"]
    assert sorted(r.info.run_name for r in children) == ["grpo seed 1", "sft seed 1"]
    assert {r.data.tags["mlflow.parentRunId"] for r in children} == {parents[0].info.run_id}
