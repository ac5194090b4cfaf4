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


class RewardFunctionError(UserError):
    """reward.function raised, or returned something other than one real number per response;
    the message names the function and what it returned."""


class RewardTimeout(UserError):
    """A reward.function call ran longer than reward.timeout_s. The trainer checkpoints the last
    completed iteration (unless this iteration's update already ran: `after_update`, set by
    evaluation) and stops with the message."""

    after_update = False


class CheckpointError(UserError):
    """A checkpoint cannot be used (a file is corrupted, cut off or missing) or cannot be written
    (disk full); the message names the checkpoint, the file and what to do."""


class OutputDirBusy(UserError):
    """Another run holds the lock on this output_dir; the message names its host and pid."""
