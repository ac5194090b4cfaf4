"""tracking.alarms and checkpoint.keep_best in `ds-ppo train`: an alarm prints one line, sets the
MLflow tag and metric, and with tracking.alarms.stop saves a checkpoint and exits 5; the resumed
run does not fire it again while its condition holds; `checkpoints/best` names the best save by
the chosen metric and survives keep_last pruning."""
from __future__ import annotations

import json

from conftest import clean_env, read_metrics, run_cli

# entropy_floor 100 nats: every iteration of a tiny random policy is "below" it, so the alarm's
# path runs after entropy_iterations iterations, whatever the sampling
BASE = ["ppo.advantage_estimator=grpo", "ppo.samples_per_prompt=4", "ppo.rollout_batch_size=8",
        "iterations=8", "checkpoint.every=2", "checkpoint.keep_last=1",
        "checkpoint.export_at_end=false", "checkpoint.keep_best=score/mean",
        "tracking.alarms.entropy_floor=100", "tracking.alarms.entropy_iterations=3"]


def _state(ckpt) -> dict:
    return json.loads((ckpt / "trainer_state.json").read_text())


def test_alarm_stops_saves_and_the_resumed_run_keeps_the_best(tmp_path):
    out = tmp_path / "out"
    proc = run_cli(["train", f"output_dir={out}", *BASE, "tracking.alarms.stop=true"],
                   cwd=tmp_path, check=False)
    assert proc.returncode == 5, proc.stderr[-3000:]
    logs = proc.stdout + proc.stderr
    assert logs.count("alarm alarm/entropy at iteration 3:") == 2  # the warning, the error
    assert "ppo.entropy_coef" in logs and "Traceback" not in logs
    rows = read_metrics(out)
    assert [r.get("alarm/entropy") for r in rows] == [None, None, 1.0]
    ckpts = out / "checkpoints"
    assert (ckpts / "latest").read_text() == "iter_000003"  # saved on the alarm
    assert (ckpts / "best").read_text() == "iter_000002"  # the only periodic save so far
    assert _state(ckpts / "iter_000002")["best"]["value"] == \
        (rows[0]["score/mean"] + rows[1]["score/mean"]) / 2
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{(out / 'mlruns' / 'mlflow.db').resolve()}")
    run = client.search_runs([e.experiment_id for e in client.search_experiments()])[0]
    assert run.data.tags["alarm/entropy"].startswith("alarm alarm/entropy at iteration 3")
    assert [m.step for m in client.get_metric_history(run.info.run_id, "alarm/entropy")] == [3]

    # the same command, stop off: resumes at 4; the condition still holds: no new alarm
    proc = run_cli(["train", f"output_dir={out}", *BASE, "tracking.alarms.stop=false"],
                   cwd=tmp_path)
    assert "alarm alarm/" not in proc.stdout + proc.stderr
    rows = read_metrics(out)
    assert [r["iteration"] for r in rows] == list(range(1, 9))
    score = {r["iteration"]: r["score/mean"] for r in rows}
    # each save's mean since the previous save (the resumed run's first: since iteration 3's)
    windows = {2: [1, 2], 4: [4], 6: [5, 6], 8: [7, 8]}
    means = {it: sum(score[i] for i in its) / len(its) for it, its in windows.items()}
    best = max(means, key=means.get)
    named = (ckpts / "best").read_text()
    assert named == f"iter_{best:06d}" and (ckpts / named).is_dir()
    assert abs(_state(ckpts / named)["best"]["value"] - means[best]) < 1e-12
    # keep_last=1 pruned the rest, but never the best
    kept = {p.name for p in ckpts.glob("iter_*")}
    assert {"iter_000008", named} <= kept and len(kept) <= 3


CONSTANT_REWARD = "def score(prompts, responses):\n    return [1.0] * len(responses)\n"


def test_a_batch_without_signal_fires_within_three_iterations_and_grpo_logs_no_kl_coef(
        tmp_path):
    """GRPO with a reward that scores every response alike: every advantage is 0 from the first
    iteration (advantage/zero_frac = 1), so alarm/zero_std fires at iteration 3, not after
    zero_std_iterations (10). The KL is in GRPO's loss, not its reward: no kl_coef is logged."""
    (tmp_path / "constant_reward.py").write_text(CONSTANT_REWARD)
    out = tmp_path / "out"
    proc = run_cli(["train", f"output_dir={out}", "tracking.enabled=false",
                    "ppo.advantage_estimator=grpo", "ppo.samples_per_prompt=4",
                    "ppo.rollout_batch_size=8", "ppo.mini_batch_size=8",
                    "ppo.micro_batch_size=4", "generation.max_new_tokens=8", "iterations=3",
                    "checkpoint.export_at_end=false", "checkpoint.save_at_end=false",
                    "reward.function=constant_reward:score"], cwd=tmp_path,
                   env=clean_env(PYTHONPATH=f"{tmp_path}:{clean_env()['PYTHONPATH']}"))
    logs = proc.stdout + proc.stderr
    assert "alarm alarm/zero_std at iteration 3: advantage/zero_frac = 1 for 3" in logs
    rows = read_metrics(out)
    assert [r["advantage/zero_frac"] for r in rows] == [1.0, 1.0, 1.0]
    assert [r.get("alarm/zero_std") for r in rows] == [None, None, 1.0]
    assert not any("kl_coef" in r for r in rows)
    assert all("kl/sequence_mean" in r and "kl/token_mean" in r for r in rows)
    assert "| kl/tok " in proc.stdout and "| pg +0.0000 |" in proc.stdout
