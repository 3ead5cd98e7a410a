"""The errors a user can cause, one hierarchy at the bottom of the package (imports nothing of ours).

`UserError` and its subclasses are printed as one paragraph without a traceback (exit 2); the
message names the field or file and the fix. Anything else is a bug: a Python exception with a traceback.
Each class subclasses UserError (or a subclass of it) only: no mixed bases such as (ConfigError, ValueError),
so `except ValueError` never swallows a message meant for the user.

Defined here, and importable from the module that raises them as well: PluginError (rollout_hpc.plugins),
CheckpointError, CheckpointCorrupt, ConfigMismatch (rollout_hpc.store.checkpoint), TrajectoryLogError
(rollout_hpc.store.trajlog), WorldError (rollout_hpc.runtime.world), EntryError (rollout_hpc.runtime.entry),
TaskError (envs.registry), RewardFatal and RewardSpecError (rewards), TrainerError (backends.trainer),
VLLMUnavailable (backends.generate_vllm), ExportError (models.export). Still defined beside its code (a
UserError subclass): CriticError (runtime.critic).
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


class RewardSpecError(RewardError):
    """A built-in reward named in the config cannot be built (invalid regex, format bonus without a pattern)."""


class RewardFatal(RewardError):
    """The reward cannot be used at all: its factory failed, or it returned NaN/inf/a non-number."""


class TaskError(ConfigError):
    """A task.* setting that cannot work; the message names the field and the fix."""


class PluginError(ConfigError):
    """User plugin problem; the message names the plugin and the fix (a config error: one line, no traceback)."""


class CheckpointError(UserError):
    """A checkpoint problem the user can act on; the message says which file and what to do."""


class CheckpointCorrupt(CheckpointError):
    """A checkpoint whose content does not match its checksum, or that cannot be read at all."""


class ConfigMismatch(CheckpointError):
    """The checkpoint was written under a config whose model or algorithm differs."""


class TrajectoryLogError(UserError):
    """A file that is not a trajectory log this code reads, or a log that cannot be opened; says why."""


class WorldError(UserError):
    """The MPI world does not match the config (a user-fixable launch problem)."""


class EntryError(UserError):
    """The run directory or the program cannot be started (user-fixable)."""


class TrainerError(UserError):
    """A trainer backend that cannot run here; the message says what to use instead."""


class VLLMUnavailable(ConfigError):
    """backend 'vllm' (a generator or a judge) without vLLM or a GPU; the message says what to do."""


def vllm_needs(what: str) -> str:
    return f"{what} needs vLLM and a GPU; install with pip install vllm on a GPU node, or use backend hf"


def import_vllm(what: str = "generator.backend 'vllm'"):
    """vllm, or VLLMUnavailable saying what needs it and how to get it (vLLM missing, or no GPU visible). Here, with
    its error, so that every layer that serves a model with vLLM (backends, rewards) shares one answer."""
    import os

    try:
        import vllm  # a heavy optional dependency (GPU nodes only)
    except ImportError as exc:
        raise VLLMUnavailable(f"{vllm_needs(what)} (import failed: {exc})") from None
    import torch

    if not torch.cuda.is_available():
        raise VLLMUnavailable(f"{vllm_needs(what)} (no CUDA device is visible on {os.uname().nodename})")
    return vllm


class ExportError(UserError):
    """An export the user can fix: no checkpoint, a damaged one, a bad size or dtype, an existing OUT."""
