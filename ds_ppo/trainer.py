"""The commands' runs: each job plugged into the run driver (run/driver.py). `train(cfg)` is
`ds-ppo train` (also importable as `ds_ppo.trainer.train` from scripts), `run_supervised(cfg,
"sft")` is `ds-ppo sft` (and "rm": `ds-ppo rm`)."""
from __future__ import annotations

from ds_ppo.config import Config
from ds_ppo.run.driver import TrainResult, run


def train(cfg: Config) -> TrainResult:
    """Run PPO as configured; resumes from output_dir's latest checkpoint when resume=auto."""
    from ds_ppo.ppo.train_job import PPOJob

    return run(cfg, PPOJob(cfg))


def run_supervised(cfg: Config, name: str) -> TrainResult:
    """`ds-ppo sft` (name "sft") or `ds-ppo rm` ("rm") as configured, resumed likewise."""
    from ds_ppo.run.supervised_job import SupervisedJob

    if name == "sft":
        from ds_ppo.sft import SFTTask as Task
    else:
        from ds_ppo.rm import RMTask as Task
    return run(cfg, SupervisedJob(cfg, Task()))


__all__ = ["TrainResult", "run_supervised", "train"]
