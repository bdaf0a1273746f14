"""The one error type for problems a user fixes on the command line (a bad flag value, a missing
file, a stride out of range). `selfspec` prints these as a single line naming the fix; anything
else is a bug and keeps its traceback."""

from __future__ import annotations


class UsageError(ValueError):
    pass
