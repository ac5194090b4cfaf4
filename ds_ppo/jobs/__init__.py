"""The training jobs as plug-ins: `JOBS`, the one registry (jobs/contract.py), with a row per job:
`ds-ppo train` (jobs/ppo/, the PPO job of ppo/), `ds-ppo sft` and `ds-ppo rm`
(jobs/supervised/), `ds-ppo dpo` (jobs/dpo/). A new job is its folder here, its config section
and its row; the command line and the run driver learn of it from the row. No torch at import."""
from ds_ppo.jobs.contract import JOBS, Job, JobSpec, by_command, register
from ds_ppo.jobs import ppo as _ppo, supervised as _supervised  # noqa: E402,F401  (their rows)
from ds_ppo.jobs import dpo as _dpo  # noqa: E402,F401  (its row, after sft and rm)

__all__ = ["JOBS", "Job", "JobSpec", "by_command", "register"]
