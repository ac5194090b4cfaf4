"""`ds-ppo dpo`: the policy tuned on preference pairs directly (Rafailov et al. 2023), with no
reward model and no generation: its registry row (the job: jobs/dpo/task.py, a task of the
supervised job, jobs/supervised/training.py; its config section: `dpo`). No torch at import: the
row is read by `ds-ppo --help` and `--dry-run`."""
from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from ds_ppo.jobs.contract import JobSpec, register

if TYPE_CHECKING:
    from ds_ppo.config import Config

NAME = "dpo"  # the registry key, the command and the config section


def _configure(cfg: Config) -> Config:
    from ds_ppo.config import job_config

    return job_config(cfg, NAME)


def _check(cfg: Config, world: int, dry_run: bool) -> None:
    from ds_ppo.config import validate_job

    validate_job(cfg, NAME, world)
    for warning in cfg.dpo.warnings():
        print(f"warning: {warning}", file=sys.stderr)
    if dry_run:
        from ds_ppo.jobs.preflight import job_preflight

        job_preflight(cfg, NAME)


def _make(cfg: Config):
    from ds_ppo.jobs.dpo.task import DPOTask
    from ds_ppo.jobs.supervised.training import Supervised

    return Supervised(cfg, DPOTask())


DPO = register(JobSpec(
    name=NAME, command=NAME, help="tune the policy on preference pairs against a frozen "
    "reference, no reward model (DPO, IPO, SimPO: the dpo section)", example="dpo.beta=0.1",
    configure=_configure, check=_check, finished=lambda cfg: None, make=_make))
