"""Where a generator rank's environments live, behind one batched call.

The episode loop (backends/episodes.py) talks to an *environment host*: every turn it hands the host one list of
calls, `[(key, method, arg), ...]` (method "reset" with the prompt item, "step" with the reply's text, "close"),
one per live episode, and gets back a `Reply` per reset/step. Three hosts, one contract:

    ThreadEnvs   in the rank, each environment in a thread of its own (envs/guard.py); the default
    ProcessEnvs  in `envs.workers` worker processes on the rank's node (envs/process_envs.py)
    RemoteEnvs   on an environment rank of the het group `envs.nodes` (runtime/env_group.py), over MPI

A call that fails (raises, hangs past task.env.step_timeout, returns no text, or its worker process dies) comes
back as a Reply with status EPISODE_ERROR / EPISODE_TIMEOUT and the reason; the host has then closed that
environment. Whatever the host, the same episodes play the same way (each environment is independent and seeded by
its reset item): tests/test_env_workers.py.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable
from typing import Any, NamedTuple, Protocol

from rollout_hpc.envs.guard import EnvFailure, GuardedEnv
from rollout_hpc.trajectory import EPISODE_ERROR, EPISODE_OK

Call = tuple[Hashable, str, Any]  # (episode key, "reset" | "step" | "close", the item or the reply text)

# What the episode loop reads from a step's info (the rest need not cross a process boundary, nor pickle).
INFO_KEYS = ("format_error", "invalid", "success", "solved", "truncated")


class Reply(NamedTuple):
    """One reset() or step(): value is the observation (reset) or (observation, reward, done, info) (step)."""

    value: Any = None
    max_turns: int | None = None  # the environment's own cap, if it has one (known after reset)
    status: int = EPISODE_OK  # EPISODE_ERROR / EPISODE_TIMEOUT: the call failed and the environment is closed
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == EPISODE_OK


def failed(status: int, error: str) -> Reply:
    return Reply(None, None, status, error)


class EnvHost(Protocol):
    def run(self, calls: list[Call]) -> dict[Hashable, Reply]:
        """Start every call, then collect their replies (one per reset/step key; "close" has none)."""
        ...

    def close(self) -> None:
        """Close every environment still open and whatever holds them."""
        ...


def plain_info(info: dict) -> dict:
    return {k: bool(info[k]) for k in INFO_KEYS if k in info}


class ThreadEnvs:
    """Environments in this process, each called in a thread of its own under a deadline (envs/guard.py).
    make(key) builds the environment of an episode (in its thread, so it may fail like a step)."""

    def __init__(self, make: Callable[[Hashable], Any], timeout: float) -> None:
        self.make, self.timeout = make, timeout
        self.guards: dict[Hashable, GuardedEnv] = {}

    def run(self, calls: list[Call]) -> dict[Hashable, Reply]:
        out: dict[Hashable, Reply] = {}
        started = []
        for key, method, arg in calls:
            if method == "close":
                self._close(key)
                continue
            if method == "reset":
                self._close(key)
                self.guards[key] = GuardedEnv(functools.partial(self.make, key), self.timeout)
            guard = self.guards.get(key)
            if guard is None:
                out[key] = failed(EPISODE_ERROR, f"{method}() on an environment that is closed")
                continue
            guard.start(method, arg)
            started.append(key)
        for key in started:
            guard = self.guards[key]
            try:
                value = guard.result()
            except EnvFailure as failure:
                self._close(key)
                out[key] = failed(failure.status, str(failure))
                continue
            if isinstance(value, tuple):  # a step: (observation, reward, done, info)
                value = (*value[:3], plain_info(value[3]))
            out[key] = Reply(value, guard.max_turns)
        return out

    def _close(self, key: Hashable) -> None:
        guard = self.guards.pop(key, None)
        if guard is not None:
            guard.close()

    def close(self) -> None:
        for key in list(self.guards):
            self._close(key)
