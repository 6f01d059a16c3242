"""Errors that mean "the user asked for something we cannot do" (as opposed to bugs), and the small value
checks and message helper every input parser shares.

The CLI turns every `SwitchheadError` into a one-line message and exit code 2; anything else is a bug and
keeps its traceback.
"""

import math


class SwitchheadError(ValueError):
    """Base class for user-facing errors."""


class ConfigError(SwitchheadError):
    """An invalid or unknown model configuration."""


class CheckpointError(SwitchheadError):
    """A checkpoint that is missing, corrupt or does not match its config."""


def is_int(v) -> bool:
    """An int that is not a bool (JSON's true/false are ints to Python)."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_finite_number(v) -> bool:
    """An int or float, not a bool, that is finite (NaN and inf are not, nor ints beyond float range, which
    JSON allows)."""
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


def check_flag(value, name: str) -> bool:
    """`value` if it is True or False; else one line naming `name` (a string such as "no" is truthy, and would
    silently mean True)."""
    if not isinstance(value, bool):
        raise SwitchheadError(f"{name} must be True or False, got {brief(value)}")
    return value


def brief(value, limit: int = 60) -> str:
    """`repr(value)` cut to `limit` characters, for messages about values of any size."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."
