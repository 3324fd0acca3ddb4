"""gradnan's errors: one hierarchy, so a caller (and the CLI's exit code) can tell whose fault it is.

- ``UsageError``: a wrong option, argument or configuration value; fix the call (exit code 2).
- ``InputError``: a file or directory gradnan cannot use: unreadable, malformed, unsafe (exit code 2).
- ``InternalError``: a bug in gradnan itself. During training it is logged once and training goes on
  unchanged, unless ``strict=True``, where it propagates (every end-to-end test runs strict).
- ``NonFiniteGradientError`` and ``AbortRequested``: the only exceptions gradnan raises into training on
  purpose, when asked to (``on_nonfinite="raise"``, ``abort_after_step``).

Every message is one line: what happened, where, and which option or file.
"""

from __future__ import annotations


class GradnanError(Exception):
    """Base of every error gradnan raises; the message is one line."""


class UsageError(GradnanError):
    """A wrong option, argument or configuration value."""


class ConfigError(UsageError, ValueError):
    """A configuration value or name is wrong; the message names the field."""


class InputError(GradnanError):
    """A file or directory gradnan cannot use (unreadable, malformed, unsafe)."""


class InternalError(GradnanError):
    """gradnan itself failed where it should not have (a bug): what failed and the original error."""


class NonFiniteGradientError(GradnanError, RuntimeError):
    """Raised with ``on_nonfinite="raise"`` after the forensic record is on disk."""


class AbortRequested(GradnanError, RuntimeError):
    """Raised with ``abort_after_step`` once that step has finished and its records are on disk."""


INTENDED_STOPS = (NonFiniteGradientError, AbortRequested)  # the only exceptions raised into training
