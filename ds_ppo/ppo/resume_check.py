"""Whether a checkpoint is one a PPO run can continue: a PPO run's, with the value model its
estimator needs or without one. Read from trainer_state.json alone (no torch: `--dry-run`
checks it before any model code loads, the job again before its models load)."""
from __future__ import annotations

from pathlib import Path

from ds_ppo.algo.choices import estimator as estimator_spec
from ds_ppo.engine.checkpoint.files import read_state
from ds_ppo.errors import UserError


def check_estimator_family(path: Path, estimator: str) -> None:
    """Resuming must keep the value model or its absence: a UserError naming both estimators
    when the checkpoint at `path` was trained with a value model and `estimator` has none, or
    the other way round (other changes of estimator are allowed); and one naming the job when
    another job wrote it."""
    state = read_state(path)
    if state.job != "ppo":
        raise UserError(f"cannot resume from {path}: it is a checkpoint of `ds-ppo {state.job}`, "
                        "not of a PPO run; start `ds-ppo train` in another output_dir (its "
                        "export, output_dir/final, is the model to start from)")
    saved = state.job_state["advantage_estimator"]
    had_value, critic = "value" in state.roles, estimator_spec(estimator).critic
    if had_value != critic:
        what = {True: "with a value model", False: "without a value model"}
        raise UserError(
            f"cannot resume from {path}: it was trained with ppo.advantage_estimator = "
            f"{saved!r} ({what[had_value]}), the config sets ppo.advantage_estimator = "
            f"{estimator!r} ({what[critic]}); set ppo.advantage_estimator={saved} "
            "to continue that run, or start a new run in another output_dir")
