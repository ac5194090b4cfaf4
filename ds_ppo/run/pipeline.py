"""The recipe from a base model to an RLHF model, run as one pipeline (launch/recipe_tiny.sh): for
each seed, on the digit-sum task (ds_ppo/envs/addition.py),

1. `ds-ppo sft`   on the demonstrations of part of the problems (a random-init model);
2. `ds-ppo rm`    on pairs (right vs wrong sum), starting from the SFT model; its pairwise
                  accuracy on the held-out problems' pairs is the last eval/accuracy;
3. `ds-ppo train` from the SFT model, twice: GRPO with the exact-match checker as the reward
                  (at the same time as step 2: it needs no reward model), and PPO (gae, the
                  value model from the reward model) with the learned reward model;
4. `ds-ppo dpo`   from the SFT model on the reward model's pairs, with no reward model (at the
                  same time as step 2); its pairwise accuracy on the held-out pairs is the last
                  eval/reward_accuracy;

then the greedy exact-match accuracy of the SFT model and of each tuned model on the held-out
problems (plain transformers on the exports, `envs.addition.evaluate`). Each step is its own
process (`python -m ds_ppo ...`: what a user types), all logging into one MLflow store under
--out: a parent run per seed with a child run per step (tracking.parent_run_id), the parent
holding the accuracies. The table and results.json land in --out.

`--quick` is the CI version: fewer steps, GRPO only (tests/e2e/test_recipe.py).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from ds_ppo.envs import addition

# (command, what differs from the recipe preset) per step; {task}, {out} filled per seed
STEPS = {
    "sft": ["sft", "data.path={task}/sft.jsonl", "data.eval_split={task}/test.jsonl"],
    "rm": ["rm", "data.path={task}/pairs.jsonl", "data.eval_split={task}/pairs_test.jsonl",
           "policy.path={out}/sft/final",
           "data.eval_size=1600"],  # every held-out pair: 200 problems x 8
    "grpo": ["train", "data.path={task}/rl.jsonl", "policy.path={out}/sft/final"],
    "ppo": ["train", "data.path={task}/rl.jsonl", "policy.path={out}/sft/final",
            "reward.model={out}/rm/final", "data.reward_keys=[]",
            "ppo.advantage_estimator=gae", "ppo.samples_per_prompt=1",
            "ppo.rollout_batch_size=128", "ppo.mini_batch_size=64", "ppo.micro_batch_size=64",
            "ppo.kl_in_reward=true", "ppo.kl_coef=0.01", "value.lr=3.0e-3",
            "ppo.critic_warmup_iterations=20", "iterations=120"],
    "dpo": ["dpo", "data.path={task}/pairs.jsonl", "data.eval_split={task}/pairs_test.jsonl",
            "policy.path={out}/sft/final", "data.eval_size=1600"],
}
QUICK = {"sft": ["sft.steps=120"], "grpo": ["iterations=20"]}


# the steps in waves: a wave's steps run at once (GRPO and DPO need no reward model)
WAVES = (("sft",), ("rm", "grpo", "dpo"), ("ppo",))


def _run_steps(commands: dict[str, list[str]], logs: dict[str, Path]) -> dict[str, float]:
    """Steps as processes of their own, all at once; returns each one's wall time. A tiny
    model gains nothing from several threads per process, and on a shared CPU idle-spinning
    threads cost time: one thread each unless OMP_NUM_THREADS is set."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    t0, procs, walls = time.perf_counter(), {}, {}
    for name, args in commands.items():
        with open(logs[name], "w") as f:
            procs[name] = subprocess.Popen([sys.executable, "-m", "ds_ppo", *args], stdout=f,
                                           stderr=subprocess.STDOUT, env=env)
    for name, proc in procs.items():
        if proc.wait() != 0:
            raise SystemExit(f"recipe step {name} failed (exit {proc.returncode}); see "
                             f"{logs[name]}")
        walls[name] = time.perf_counter() - t0
    return walls


def _last(metrics_file: Path, key: str) -> float | None:
    rows = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
    values = [r[key] for r in rows if key in r]
    return values[-1] if values else None


def _first(metrics_file: Path, key: str) -> float | None:
    rows = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
    values = [r[key] for r in rows if key in r]
    return values[0] if values else None


def _parent_run(uri: str, experiment: str, name: str, artifacts: Path):
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(experiment)
    exp_id = exp.experiment_id if exp else client.create_experiment(
        experiment, artifact_location=artifacts.resolve().as_uri())
    return client, client.create_run(exp_id, run_name=name).info.run_id


def run_seed(seed: int, out: Path, config: str, steps: list[str], quick: bool,
             extra: list[str]) -> dict[str, float]:
    """The pipeline for one seed under out/seed<N>; returns its measurements."""
    root = out / f"seed{seed}"
    task = root / "task"
    if not (task / "test.jsonl").exists():
        addition.write_task(task, seed=seed)
    uri = f"sqlite:///{(out / 'mlruns' / 'mlflow.db').resolve()}"
    (out / "mlruns").mkdir(parents=True, exist_ok=True)
    client, parent = _parent_run(uri, "recipe", f"recipe seed {seed}",
                                 out / "mlruns" / "artifacts")
    res: dict[str, float] = {"seed": seed}
    t_all = time.perf_counter()
    for wave in WAVES:
        commands = {}
        # a step whose export exists is done (a pipeline run again continues where it stopped)
        for name in (n for n in wave if n in steps and not (root / n / "final").exists()):
            cmd, *overrides = STEPS[name]
            commands[name] = [
                cmd, "--config", config, *[o.format(task=task, out=root) for o in overrides],
                f"output_dir={root / name}", f"seed={seed}", f"tracking.uri={uri}",
                "tracking.experiment=recipe", f"tracking.parent_run_id={parent}",
                f"tracking.run_name={name} seed {seed}",
                *(QUICK.get(name, []) if quick else []), *extra]
        walls = _run_steps(commands, {n: root / f"{n}.log" for n in commands})
        for name in (n for n in wave if n in steps):
            res[f"{name}_wall_s"] = walls.get(name)
            if name in ("sft", "grpo", "ppo", "dpo"):
                res[f"{name}_acc"] = addition.evaluate(root / name / "final", task / "test.jsonl")
            if name == "rm":
                res["rm_acc"] = _last(root / "rm" / "metrics.jsonl", "eval/accuracy")
                res["rm_pick"] = addition.reward_model_picks(root / "rm" / "final",
                                                             task / "test.jsonl")
            if name == "dpo":
                res["dpo_pair_acc"] = _last(root / "dpo" / "metrics.jsonl",
                                            "eval/reward_accuracy")
            if name in ("grpo", "ppo"):  # the reward the RL step maximised: first vs last
                res[f"{name}_score_first"] = _first(root / name / "metrics.jsonl", "score/mean")
                res[f"{name}_score_last"] = _last(root / name / "metrics.jsonl", "score/mean")
            print(json.dumps({k: v for k, v in res.items() if k.startswith(name)}), flush=True)
    res["wall_s"] = time.perf_counter() - t_all
    for k, v in res.items():
        if v is not None and k != "seed":
            client.log_metric(parent, k, float(v))
    client.set_terminated(parent)
    return res


def table(results: list[dict[str, float]]) -> str:
    cols = [("seed", "seed"), ("sft_acc", "SFT acc"), ("rm_acc", "RM pair acc"),
            ("rm_pick", "RM picks right sum"),
            ("grpo_acc", "GRPO acc"), ("ppo_acc", "PPO (RM) acc"),
            ("ppo_score_first", "PPO RM score first"), ("ppo_score_last", "last"),
            ("dpo_acc", "DPO acc"), ("dpo_pair_acc", "DPO pair acc"),
            ("wall_s", "wall s")]
    cols = [(k, h) for k, h in cols if any(k in r for r in results)]
    lines = ["| " + " | ".join(h for _, h in cols) + " |", "|" + "---|" * len(cols)]
    for r in results:
        lines.append("| " + " | ".join(
            (f"{r[k]:.3f}" if isinstance(r.get(k), float) else str(r.get(k, "")))
            for k, _ in cols) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="outputs/recipe")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--config", default="recipe")
    ap.add_argument("--steps", default="sft,rm,grpo,ppo,dpo",
                    help="comma-separated steps among sft, rm, grpo, ppo, dpo")
    ap.add_argument("--quick", action="store_true", help="the CI version: shorter, GRPO only")
    ap.add_argument("overrides", nargs="*", help="key=value for every step")
    args = ap.parse_args(argv)
    steps = ["sft", "grpo"] if args.quick else args.steps.split(",")
    out = Path(args.out)
    results = [run_seed(s, out, args.config, steps, args.quick, args.overrides)
               for s in args.seeds]
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(table(results))
    print(f"MLflow: mlflow ui --backend-store-uri sqlite:///{(out / 'mlruns' / 'mlflow.db').resolve()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
