"""Errors that memfit reports to the user as one paragraph, without a traceback.

Every error here is raised *before* anything on disk is changed or any large allocation is made, and its message
names the offending key, file or record and says what to do instead.
"""


class MemfitError(Exception):
    """Base class of the errors the CLI prints as a message and exits non-zero on."""


class ConfigError(MemfitError, ValueError):
    """A configuration key is unknown, has the wrong type or an impossible value, or keys conflict."""


class DataError(MemfitError, ValueError):
    """A corpus or dataset file is missing, empty, too short, not UTF-8, or malformed."""


class CheckpointError(MemfitError, OSError):
    """A checkpoint is missing, truncated or inconsistent, or an output directory cannot be written."""


class PreflightError(MemfitError, MemoryError):
    """The run is predicted not to fit in the memory available (``preflight``); nothing was allocated."""
