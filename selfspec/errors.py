"""`UserError`: the base of every error a user fixes (a bad flag value, a missing file, a model
that cannot run a mode, a port in use). `selfspec` prints these as one line naming the fix;
anything else is a bug and keeps its traceback.

Subclasses say where the problem was found: `UsageError` (command-line flags and data paths),
`selfspec.models.ModelNotFoundError`, `selfspec.decoding.step.ModeUnavailable`,
`selfspec.checkpoints.metadata.MetadataError`, `selfspec.serving.ServeError`,
`selfspec.sglang_ext.config.SelfSpecConfigError`.
"""

from __future__ import annotations


class UserError(ValueError):
    pass


class UsageError(UserError):
    """A command-line flag or data path that cannot be used as given."""
