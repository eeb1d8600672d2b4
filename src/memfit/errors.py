"""Errors that memfit reports to the user as one paragraph, without a traceback.

Every error here is raised *before* anything on disk is changed or any large allocation is made, and its message
names the offending key, file or record and says what to do instead.
"""


class MemfitError(Exception):
    """Base class of the errors the CLI prints as a message and exits non-zero on.

    ``every_rank``: the error is raised alike on every rank of a sharded run (agreed through a collective, or
    found from global values), so only rank 0 prints it.
    """

    every_rank = False


class ConfigError(MemfitError, ValueError):
    """A configuration key is unknown, has the wrong type or an impossible value, or keys conflict."""


class DataError(MemfitError, ValueError):
    """A corpus or dataset file is missing, empty, too short, not UTF-8, or malformed."""


class CheckpointError(MemfitError, OSError):
    """A checkpoint is missing, truncated or inconsistent, or an output directory cannot be written."""


class PreflightError(MemfitError, MemoryError):
    """The run is predicted not to fit in the memory available (``preflight``); nothing was allocated."""


class TokenizerError(MemfitError, ValueError):
    """A tokenizer file is missing, unrecognised or corrupt, or a tokenizer was asked for what it lacks."""


class UnknownPresetError(ValueError, KeyError):
    """A model preset name that ``MODEL_PRESETS`` does not hold (a ValueError, and a KeyError for dict-like
    callers). Config validation turns it into a :class:`ConfigError` naming the key ``model``."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class NoPlanError(MemfitError):
    """``memfit plan``: no combination of memory switches fits the budget."""


class RunLockedError(MemfitError):
    """Another live run holds the lock of the same ``output_dir`` (:mod:`memfit.runlock`)."""


class DivergenceError(MemfitError, ArithmeticError):
    """Training diverged: a step's loss or gradient norm is not finite (``on_nonfinite``); nothing non-finite
    was saved. Found from global values, so every rank raises it."""

    every_rank = True


class WriteError(MemfitError, OSError):
    """A file could not be written (disk full, quota, permissions, read-only file system); the message names the
    path, the cause, what was kept and what to do."""
