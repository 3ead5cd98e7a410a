"""The errors a user can cause, one hierarchy at the bottom of the package (imports nothing of ours).

`UserError` and its subclasses are printed as one paragraph without a traceback (exit 2); the
message names the field or file and the fix. Anything else is a bug: a Python exception with a traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """A problem the user can fix (bad input, missing tool, refused action)."""


class ConfigError(UserError):
    """A config problem a user can fix; the message says where and how."""


class ModelLoadError(ConfigError):
    """model.path is not a loadable causal-LM directory or tokenizer; the message says why and what to do."""


class DatasetError(ConfigError):
    """A prompt dataset file that cannot be used (missing, unknown format, missing keys, bad rows)."""


class RewardError(ConfigError):
    """A reward that cannot be used: an unknown built-in, a bad pattern, or a reward function returning a non-number."""
