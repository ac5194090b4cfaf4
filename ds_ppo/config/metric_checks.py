"""The settings that name a metric, tracking.alarms.watch and checkpoint.keep_best, against the
metrics the job logs (``ds_ppo.metric_names``), and tracking.alarms.stop against the alarms that
can fire. A name the job never logs is never checked: its alarm never fires (so the stop never
stops) and no save is ever ranked best, so each is refused up front with a did-you-mean.
"""
from __future__ import annotations

import difflib
from typing import Callable

from ds_ppo.config.sections import Config
from ds_ppo.metric_names import is_logged, job_metrics

# metrics a job logs only with a setting: (name prefix, whether this config logs them, the
# setting that does)
_NEEDS: tuple[tuple[str, Callable[[Config], bool], str], ...] = (
    ("eval/", lambda c: c.data.eval_split is not None, "data.eval_split"),
    ("eval_ema/", lambda c: c.data.eval_split is not None and c.policy.ema_decay is not None,
     "data.eval_split and policy.ema_decay"),
    ("env/", lambda c: c.env.enabled, "an env section"),
    ("async/", lambda c: c.ppo.schedule != "sync", "ppo.schedule one_step_off or async"),
    ("sampling/", lambda c: c.ppo.dynamic_sampling, "ppo.dynamic_sampling=true"),
    ("value/", lambda c: c.ppo.uses_critic, "ppo.advantage_estimator=gae (a value model)"),
    ("kl_coef", lambda c: c.ppo.kl_in_reward, "ppo.kl_in_reward=true (the KL in the reward)"),
)
_EFFECT = {"tracking.alarms.watch": "its alarm never fires (nor stops the run)",
           "checkpoint.keep_best": "no checkpoint is ever ranked best"}


def metric_problems(cfg: Config, job: str = "ppo") -> list[str]:
    """Every watched metric and checkpoint.keep_best's must be a metric job `job` (ppo, sft,
    rm) logs with this config; tracking.alarms.stop needs an alarm that can fire."""
    a, named = cfg.tracking.alarms, []
    if a.enabled:
        named += [("tracking.alarms.watch", name) for name in a.watch]
    if cfg.checkpoint.keep_best is not None:
        named.append(("checkpoint.keep_best", cfg.checkpoint.keep_best))
    out = [p for key, name in named if (p := _name_problem(cfg, job, key, name))]
    return out + _stop_problems(cfg, job)


def _name_problem(cfg: Config, job: str, key: str, name: str) -> str | None:
    command = "train" if job == "ppo" else job
    if not name.strip():
        return (f"{key}: {name!r} names no metric: name one that `ds-ppo {command}` logs "
                "(docs/METRICS.md, e.g. score/mean), or "
                + ("drop it" if key.endswith("watch") else f"{key}=null"))
    if not is_logged(name, job):
        close = difflib.get_close_matches(name, sorted(job_metrics(job)), n=1, cutoff=0.6)
        hint = f"did you mean {close[0]!r}" if close else "name one of docs/METRICS.md's"
        return (f"{key}: {name!r} is not a metric `ds-ppo {command}` logs, so "
                f"{_EFFECT[key]}: {hint}?")
    for prefix, logs, setting in _NEEDS:
        if name.startswith(prefix) and not logs(cfg):
            return (f"{key}: {name!r} is logged only with {setting}, which this config does "
                    f"not set, so {_EFFECT[key]}: set it, or name another metric")
    return None


def _stop_problems(cfg: Config, job: str) -> list[str]:
    """tracking.alarms.stop = true with no alarm that can fire would never stop the run."""
    a = cfg.tracking.alarms
    if not a.stop:
        return []
    if not a.enabled:
        return ["tracking.alarms.stop = true stops the run at the first alarm, but "
                "tracking.alarms.enabled = false checks none: set tracking.alarms.enabled=true, "
                "or tracking.alarms.stop=false"]
    # alarm/entropy and alarm/zero_std read policy/entropy and group/zero_std_frac (ppo only)
    if a.watch or (job == "ppo" and (a.entropy_floor > 0 or a.zero_std_ceiling < 1)):
        return []
    off = ("tracking.alarms.entropy_floor = 0, zero_std_ceiling = 1 and watch = []"
           if job == "ppo" else f"`ds-ppo {job}` has only the alarm of tracking.alarms.watch, "
           "which is empty")
    return [f"tracking.alarms.stop = true stops the run at the first alarm, but no alarm can "
            f"fire ({off}): set tracking.alarms.watch (the metrics whose fall is an alarm), or "
            "tracking.alarms.stop=false"]
