"""`ds-ppo train`: the PPO job's row (the job itself: ppo/train_job.py over the stages in ppo/).
Its checks before a start: the cross-field rules and warnings (config/checks.py), the estimator
family of the checkpoint it would resume, the data columns and the reward function
(jobs/preflight.py) and an env function's import."""
from __future__ import annotations

import os
import sys

from ds_ppo.jobs.contract import JobSpec, register


def _check(cfg, world: int, dry_run: bool) -> None:
    from ds_ppo.config import config_warnings, validate
    from ds_ppo.jobs.preflight import preflight

    validate(cfg, world)
    if os.environ.get("RANK", "0") == "0":  # once per job, not once per rank
        for warning in config_warnings(cfg, world):
            print(f"ds-ppo: warning: {warning}", file=sys.stderr)
    _check_resume_estimator(cfg)
    preflight(cfg, paths=dry_run)  # data columns, the reward function; paths: dry run
    if cfg.env.function is not None:  # importable, and its methods take what they are given
        from ds_ppo.envs.base import load_python_env

        load_python_env(cfg.env.function, cfg.data.reward_keys)


def _check_resume_estimator(cfg) -> None:
    """The checkpoint a run would resume from must match its estimator family (with or without
    a value model): found here, before any model code loads (the job checks it again)."""
    from ds_ppo.engine.checkpoint.files import latest_checkpoint
    from ds_ppo.ppo.resume_check import check_estimator_family

    if cfg.resume == "never":
        return
    path = latest_checkpoint(cfg.output_dir) if cfg.resume == "auto" else None
    if cfg.resume != "auto":
        from ds_ppo.engine.checkpoint.files import resolve_checkpoint

        path = resolve_checkpoint(cfg.resume)
    if path is not None:
        check_estimator_family(path, cfg.ppo.advantage_estimator)


def _finished(cfg) -> str | None:
    """A rerun of a finished run: its message, before torch even imports."""
    from ds_ppo.engine.checkpoint.files import finished_message, finished_run

    c = cfg.checkpoint
    done = finished_run(cfg.output_dir, cfg.resume, cfg.iterations, c.export_at_end)
    if done is None:
        return None
    return finished_message(cfg.output_dir, *done, cfg.iterations, c.export_at_end)


def _make(cfg):
    from ds_ppo.ppo.train_job import PPOJob

    return PPOJob(cfg)


PPO = register(JobSpec(
    name="ppo", command="train", help="run PPO training (no arguments: the tiny CPU default)",
    example="ppo.kl_coef=0.05", configure=lambda cfg: cfg, check=_check, finished=_finished,
    make=_make))
