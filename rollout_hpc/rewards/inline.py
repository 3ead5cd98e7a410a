"""InlineScorer: RewardPool's scoring in the calling process, for `task.reward_workers: 0` (docs/rewards.md).

The same factory, the same results (a reward that raises scores 0 with REWARD_ERROR and goes on; NaN, inf or a
non-number is RewardFatal, with the same message), none of the processes. What that gives up is isolation: no
per-sample timeout (task.reward_timeout does not apply) and no protection from a reward that crashes or hangs
the interpreter; a hung reward stops the rank's progress, and the hang watchdog then ends the job (run.hang_timeout).
For rewards that are fast and cannot hang, such as the built-in exact match, it saves each generator rank its
worker processes and ~2 ms of a quickstart step (docs/rewards.md has the figures).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from rollout_hpc.errors import RewardFatal
from rollout_hpc.rewards.pool import RewardResult, job_result
from rollout_hpc.rewards.worker import factory_failure, job_answer, load_factory


class InlineScorer:
    """score([(key, text)]) -> [RewardResult] in this process, with `fn = factory(*args)` built at construction."""

    def __init__(self, factory: str, args: tuple = (), name: str = "reward"):
        self.factory, self.name = factory, name
        try:
            self._fn = load_factory(factory, name)(*args)
        except RewardFatal:
            raise
        except Exception as exc:  # what the pool says of a worker's "fatal" answer
            message, plugin_error = factory_failure(exc)
            raise RewardFatal(
                f"{name}: {message}" if plugin_error else f"{name}: reward factory '{factory}' failed: {message}"
            ) from exc
        if not callable(self._fn):
            raise RewardFatal(
                f"{name}: reward factory '{factory}' returned {type(self._fn).__name__}, not fn(key, text)"
            )
        self._lock = threading.Lock()
        self._closed = False
        self._counts = {"jobs": 0, "ok": 0, "errors": 0, "timeouts": 0, "score_seconds": 0.0}

    def score(self, jobs: list[tuple[Any, str]]) -> list[RewardResult]:
        """Scores every (key, text): results in job order (one call at a time)."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name}: the reward scorer is closed")
            t0 = time.perf_counter()
            results = []
            for i, (key, text) in enumerate(jobs):
                _, status, payload = job_answer(i, self._fn, key, text)
                result = job_result(status, payload, self.name, self.factory, (key, text))
                self._counts["ok" if result.ok else "errors"] += 1
                results.append(result)
            self._counts["jobs"] += len(jobs)
            self._counts["score_seconds"] += time.perf_counter() - t0
            return results

    def warmup(self, timeout: float | None = None) -> None:
        """Nothing to wait for: the reward was built at construction."""

    def stats(self) -> dict[str, float]:
        with self._lock:
            return {**self._counts, "workers_alive": 0}

    @property
    def pids(self) -> list[int]:
        return []

    def close(self) -> None:
        with self._lock:
            self._closed = True

    def __enter__(self) -> InlineScorer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
