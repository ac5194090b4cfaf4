"""The commands' runs: each registered job (ds_ppo/jobs/) plugged into the run driver
(run/driver.py). `train(cfg)` is `ds-ppo train` (also importable as `ds_ppo.trainer.train` from
scripts), `run_job(cfg, name)` any job of the registry (`run_supervised(cfg, "sft")` is `ds-ppo
sft`, "rm": `ds-ppo rm`)."""
from __future__ import annotations

from ds_ppo.config import Config
from ds_ppo.jobs import JOBS
from ds_ppo.run.driver import TrainResult, run


def run_job(cfg: Config, name: str) -> TrainResult:
    """Run the registry's job `name` as configured (`cfg` as its row's `configure` made it);
    resumes from output_dir's latest checkpoint when resume=auto."""
    return run(cfg, JOBS[name].make(cfg))


def train(cfg: Config) -> TrainResult:
    """Run PPO as configured; resumes from output_dir's latest checkpoint when resume=auto."""
    return run_job(cfg, "ppo")


def run_supervised(cfg: Config, name: str) -> TrainResult:
    """`ds-ppo sft` (name "sft") or `ds-ppo rm` ("rm") as configured, resumed likewise."""
    return run_job(cfg, name)


__all__ = ["TrainResult", "run_job", "run_supervised", "train"]
