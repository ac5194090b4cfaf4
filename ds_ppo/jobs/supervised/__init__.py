"""`ds-ppo sft` and `ds-ppo rm`: the supervised jobs' registry rows (the job: job.py over the
tasks in ds_ppo/sft/ and ds_ppo/rm/; each row's config section is the one of its name). No torch
at import: the rows are read by `ds-ppo --help` and `--dry-run`."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from ds_ppo.jobs.contract import JobSpec, register

if TYPE_CHECKING:
    from ds_ppo.config import Config


def _job(cfg: Config, task):
    from ds_ppo.jobs.supervised.training import Supervised

    return Supervised(cfg, task)


def _sft_task():
    from ds_ppo.sft import SFTTask

    return SFTTask()


def _rm_task():
    from ds_ppo.rm import RMTask

    return RMTask()


def _row(name: str, task: Callable[[], Any], help: str, example: str) -> JobSpec:
    """The registry row of the supervised job `name` (its config section of the same name),
    `task` making its Task."""

    def configure(cfg: Config) -> Config:
        from ds_ppo.config import job_config

        return job_config(cfg, name)

    def check(cfg: Config, world: int, dry_run: bool) -> None:
        from ds_ppo.config import validate_job

        validate_job(cfg, name, world)
        if dry_run:
            from ds_ppo.jobs.preflight import job_preflight

            job_preflight(cfg, name)

    return register(JobSpec(name=name, command=name, help=help, example=example,
                            configure=configure, check=check, finished=lambda cfg: None,
                            make=lambda cfg: _job(cfg, task())))


SFT = _row("sft", _sft_task, "supervised fine-tuning of the policy on prompt + completion (or "
           "chat) rows (the sft section)", "sft.batch_size=64")
RM = _row("rm", _rm_task, "train a reward model on preference pairs (the rm section)",
          "rm.batch_size=64")
