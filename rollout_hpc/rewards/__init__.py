"""Verifiable rewards: built-in verifiers (math, exact, regex, code) and a process pool that scores responses with a
per-sample timeout. Semantics: docs/rewards.md.

This package stays light: `python -m rollout_hpc.rewards.worker` imports it in every reward worker, so nothing is
imported here eagerly (no torch, mpi4py, numpy, pydantic); the public names load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

# RewardResult.status values; the same numbers as the record schema's reward status column.
REWARD_OK = 0
REWARD_ERROR = 1
REWARD_TIMEOUT = 2

_LAZY = {
    "RewardPool": "pool",
    "RewardResult": "pool",
    "RewardFatal": "pool",
    "BUILTIN_REWARDS": "verifiers",
    "RewardSpecError": "verifiers",
    "builtin_reward": "verifiers",
    "reward_factory": "verifiers",
    "is_builtin_reward": "verifiers",
    "math_reward": "verifiers",
    "exact_reward": "verifiers",
    "regex_reward": "verifiers",
    "format_ok": "verifiers",
    "gold_answer": "verifiers",
    "code_reward": "code_sandbox",
    "code_limits": "code_sandbox",
    "CodeLimits": "code_sandbox",
    "CodeSandboxError": "code_sandbox",
    "CODE_PARAMS": "code_sandbox",
}

__all__ = ["REWARD_OK", "REWARD_ERROR", "REWARD_TIMEOUT", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
