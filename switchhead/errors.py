"""Errors that mean "the user asked for something we cannot do" (as opposed to bugs).

The CLI turns every `SwitchheadError` into a one-line message and exit code 2; anything else is a bug and
keeps its traceback.
"""


class SwitchheadError(ValueError):
    """Base class for user-facing errors."""


class ConfigError(SwitchheadError):
    """An invalid or unknown model configuration."""


class CheckpointError(SwitchheadError):
    """A checkpoint that is missing, corrupt or does not match its config."""
