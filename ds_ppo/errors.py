"""Errors a user can fix: the CLI prints them without a traceback and exits non-zero."""


class UserError(Exception):
    """Base: something in the user's input (config, data, paths) is wrong; message says what."""

    exit_code = 2


class ConfigError(UserError):
    """The configuration is invalid; the message names the key, the value and the fix."""


class DataError(UserError):
    """The prompt data is unreadable or malformed; the message names file, row and column."""
