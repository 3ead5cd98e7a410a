"""Calling an environment so that one that raises, hangs or answers with something other than text ends its
episode, never the run.

Each episode's environment is called in a daemon thread of its own (threads are reused by later episodes): the
caller starts reset() or step() on every live episode, then collects each answer before a deadline
(task.env.step_timeout after the start). A call that raised,
took too long, or returned the wrong kind of value becomes an `EnvFailure` with the episode status to record
(trajectory.EPISODE_ERROR / EPISODE_TIMEOUT). A hung call cannot be stopped from Python: its thread is abandoned
(daemon, so it never holds up the rank's exit, and never reused) and the environment is never called again.
"""

from __future__ import annotations

import math
import numbers
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from rollout_hpc.trajectory import EPISODE_ERROR, EPISODE_TIMEOUT


class EnvFailure(Exception):
    """An environment call that ends its episode: `status` is the record's episode_status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def checked_observation(value: Any, method: str) -> str:
    if not isinstance(value, str):
        raise EnvFailure(
            EPISODE_ERROR,
            f"{method}() returned a {type(value).__name__} observation, not text (str); render it as text",
        )
    return value


def checked_step(value: Any) -> tuple[str, float, bool, dict]:
    """step()'s (observation, reward, done, info), checked: text, a finite number, a bool, a dict."""
    if not isinstance(value, tuple) or len(value) != 4:
        raise EnvFailure(EPISODE_ERROR, f"step() returned {value!r:.80}, not (observation, reward, done, info)")
    obs, reward, done, info = value
    obs = checked_observation(obs, "step")
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or not math.isfinite(float(reward)):
        raise EnvFailure(EPISODE_ERROR, f"step() returned the reward {reward!r:.40}, not a finite number")
    if info is None:
        info = {}
    if not isinstance(info, dict):
        raise EnvFailure(EPISODE_ERROR, f"step() returned info of type {type(info).__name__}, not a dict")
    return obs, float(reward), bool(done), info


class _Worker:
    """A daemon thread that runs calls from its inbox; reused by the next episode unless a call of its hung."""

    idle: list[_Worker] = []  # workers whose last episode ended (thread start-up is ~1 ms a episode otherwise)
    lock = threading.Lock()

    def __init__(self) -> None:
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="env", daemon=True).start()

    @classmethod
    def get(cls) -> _Worker:
        with cls.lock:
            return cls.idle.pop() if cls.idle else cls()

    def release(self) -> None:
        with self.lock:
            self.idle.append(self)

    def _serve(self) -> None:
        while True:
            fn, arg = self.inbox.get()
            try:
                self.outbox.put((True, fn(arg)))
            except BaseException as exc:  # noqa: BLE001 - whatever it raised ends the episode, not the thread
                self.outbox.put((False, exc))


class GuardedEnv:
    """One episode's environment, made by `factory` and called in a thread of its own.

    guard.start("reset", item); obs = guard.result()   # raises EnvFailure
    guard.start("step", text);  obs, reward, done, info = guard.result()
    guard.close()
    """

    def __init__(self, factory: Callable[[], Any], timeout: float) -> None:
        self.factory, self.timeout = factory, timeout
        self.env: Any = None
        self._worker: _Worker | None = _Worker.get()
        self._method, self._deadline, self._pending = "", 0.0, False

    def _call(self, job: tuple[str, Any]) -> Any:
        method, arg = job
        if self.env is None:
            self.env = self.factory()  # the task's make_env(): it may raise or hang too
        return getattr(self.env, method)(arg)

    def start(self, method: str, arg: Any) -> None:
        assert self._worker is not None, "the environment hung or was closed"
        self._method, self._deadline, self._pending = method, time.monotonic() + self.timeout, True
        self._worker.inbox.put((self._call, (method, arg)))

    def result(self) -> Any:
        """The started call's checked answer (waits until its deadline at most)."""
        assert self._worker is not None
        try:
            ok, value = self._worker.outbox.get(timeout=max(0.0, self._deadline - time.monotonic()))
        except queue.Empty:
            self._worker = None  # busy for good, maybe: never reused
            raise EnvFailure(
                EPISODE_TIMEOUT,
                f"{self._method}() took longer than task.env.step_timeout={self.timeout:g}s (abandoned)",
            ) from None
        self._pending = False
        if not ok:
            raise EnvFailure(EPISODE_ERROR, f"{self._method}() raised {type(value).__name__}: {value}")
        return checked_observation(value, "reset") if self._method == "reset" else checked_step(value)

    @property
    def max_turns(self) -> int | None:
        return getattr(self.env, "max_turns", None)

    def close(self) -> None:
        """Give the thread to the next episode (unless a call is still running in it)."""
        if self._worker is not None and not self._pending:
            self._worker.release()
        self._worker = None
