"""Errors a user can fix: the CLI prints them without a traceback and exits non-zero."""


class UserError(Exception):
    """Base: something in the user's input (config, data, paths) is wrong; message says what."""

    exit_code = 2


class ConfigError(UserError):
    """The configuration is invalid; the message names the key, the value and the fix."""


class DataError(UserError):
    """The prompt data is unreadable or malformed; the message names file, row and column."""


class Diverged(UserError):
    """Training produced a non-finite loss or gradient norm: the weights are no longer usable.
    The message names the iteration, the values and the last checkpoint saved before it."""

    exit_code = 3


class JoinError(UserError):
    """A rank could not join the process group (rendezvous timed out or rank 0 unreachable);
    the message names the address, what was seen and what to check."""


class RewardError(UserError):
    """The reward stage failed (a function that raised, returned garbage or hung; a service
    that failed for good). Scoring runs before the update, so the weights are still the last
    completed iteration's: the trainer checkpoints it (unless `after_update`: the failure came in
    evaluation, after this iteration's update) and stops with the message, then `fix`: what to
    do before the same command runs again."""

    after_update = False
    fix = "Fix the reward source"


class RewardFunctionError(RewardError):
    """reward.function raised, or returned something other than one real number per response;
    the message names the function and what it returned."""


class RewardTimeout(RewardError):
    """A reward.function call ran longer than reward.timeout_s."""

    fix = "Find what makes the function hang, or raise reward.timeout_s"


class CheckpointError(UserError):
    """A checkpoint cannot be used (a file is corrupted, cut off or missing) or cannot be written
    (disk full); the message names the checkpoint, the file and what to do."""


class RegistrationError(UserError):
    """Training finished and everything is saved, but registering the policy in the MLflow model
    registry (tracking.register_model) failed: exit code 4, so a pipeline notices. Registration
    is idempotent per run and iteration: the same command again registers it (once)."""

    exit_code = 4


class AlarmStop(UserError):
    """tracking.alarms.stop: an alarm fired (the run lost its learning signal or a skill), so an
    unattended run saved a checkpoint and stopped; the message names the alarm and the
    checkpoint. Exit code 5."""

    exit_code = 5


class OutputDirBusy(UserError):
    """Another run holds the lock on this output_dir; the message names its host and pid."""


class NotOnPolicy(UserError):
    """generation.require_exact: the sampler's log-probs differ from the trainer's for the same
    tokens; the message names the iteration's largest gap and how to close it."""
