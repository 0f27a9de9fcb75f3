"""User-facing errors.

A `KeelError` is something the user can fix (a missing file, a bad field, an unsupported
architecture). The CLI prints its message on one line and exits non-zero, without a traceback;
anything else is a bug and keeps its traceback.
"""


class KeelError(Exception):
    """An error caused by the user's input, reported as one line naming the file or field."""


class ConfigError(KeelError):
    """A model configuration that keel cannot build or does not support."""


class WeightsError(KeelError):
    """A checkpoint that is missing, corrupt, or does not fit the configuration."""
