"""RewardPool: score (key, response) pairs in worker processes, with a per-sample timeout (docs/rewards.md).

Workers are plain subprocesses (`python -m rollout_hpc.rewards.worker`; why not multiprocessing, and the wire
format: rollout_hpc/worker_process.py).

Scheduling: jobs go out in chunks (guided self-scheduling: remaining / (2 * workers), at most 32) to whichever
worker is idle; a worker answers each job as soon as it is done, so a job's clock starts when the previous answer
(or the chunk) arrived, and the timeout is per sample. A job over timeout_s: TIMEOUT, its worker SIGKILLed and
replaced, the rest of its chunk handed out again. A job that raises: ERROR, the worker goes on. A worker that dies
in a job: that job ERROR, the worker replaced. A reward that is NaN/inf/not a number, or a factory that fails:
RewardFatal (the run must stop).

Workers are started at construction (without waiting: they import the factory while the caller does other
things); score() waits for them. `warmup()` waits now and raises RewardFatal if the factory fails.
"""

from __future__ import annotations

import math
import os
import selectors
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any, cast

from rollout_hpc.errors import RewardFatal
from rollout_hpc.rewards import REWARD_ERROR, REWARD_OK, REWARD_TIMEOUT
from rollout_hpc.worker_process import exit_text, frame, reap, send, shutdown, spawn, split_messages

_MSG_OK, _MSG_ERROR, _MSG_BAD, _MSG_SAMPLE_ERROR = 0, 1, 3, 4
_MAX_CHUNK = 32


@dataclass(frozen=True, slots=True)
class RewardResult:
    value: float  # 0.0 when status != REWARD_OK
    status: int  # REWARD_OK, REWARD_ERROR, REWARD_TIMEOUT
    error: str | None = None  # one line: "TypeName: message", "timed out after Xs", "worker died (exit code N)"
    sample_fault: bool = False  # ERROR raised by an exception marked `sample_fault = True`: the sample broke a rule
    # (a code reward's sandbox violation), the reward itself works

    @property
    def ok(self) -> bool:
        return self.status == REWARD_OK


def job_result(status: int, payload, name: str, factory: str, job: tuple[Any, str]) -> RewardResult:
    """A job's answer (rewards/worker.py's job_answer: status, payload) as its RewardResult; RewardFatal for a
    value no run may train on (NaN, inf, not a number), naming the reward, the key and the response."""
    if status == _MSG_OK:
        if not math.isfinite(payload):
            raise RewardFatal(_bad_value(f"{payload}", "a reward must be finite", name, factory, job))
        return RewardResult(payload, REWARD_OK, None)
    if status in (_MSG_ERROR, _MSG_SAMPLE_ERROR):
        return RewardResult(0.0, REWARD_ERROR, payload, status == _MSG_SAMPLE_ERROR)
    raise RewardFatal(_bad_value(payload, "a reward must be a float", name, factory, job))


def _bad_value(what: str, rule: str, name: str, factory: str, job: tuple[Any, str]) -> str:
    key, text = job
    key_text, text_text = repr(key), repr(text)
    if len(key_text) > 80:
        key_text = key_text[:77] + "..."
    if len(text_text) > 80:
        text_text = text_text[:77] + "..."
    return f"{name} returned {what}; {rule} (reward factory '{factory}', key {key_text}, response {text_text})"


class _Worker:
    __slots__ = ("proc", "fd", "buf", "ready", "started", "outstanding", "head_start")

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        assert proc.stdout is not None  # started with stdout=PIPE
        self.fd = proc.stdout.fileno()
        self.buf = bytearray()
        self.ready = False
        self.started = time.monotonic()
        self.outstanding: deque[int] = deque()
        self.head_start = 0.0

    def messages(self):
        return split_messages(self.buf)


class RewardPool:
    """Scores `fn(key, text) -> float` in `n_workers` worker processes, `fn = factory(*args)` built once per worker.

    factory: 'package.module:function' or 'path/to/file.py:function' (importable in a fresh interpreter; the
    parent's sys.path is added to the worker's). args: plain picklable data. timeout_s: per sample.
    name: how errors name the reward (e.g. "task.reward 'my_pkg:reward'").
    """

    def __init__(
        self,
        factory: str,
        args: tuple = (),
        n_workers: int = 2,
        timeout_s: float = 10.0,
        name: str = "reward",
        start_timeout_s: float = 300.0,
    ):
        if not isinstance(factory, str) or ":" not in factory:
            raise RewardFatal(
                f"{name}: reward factory must be 'package.module:function' or "
                f"'path/to/file.py:function', got {factory!r}"
            )
        if int(n_workers) < 1:
            raise ValueError(f"n_workers must be >= 1, got {n_workers}")
        if not (timeout_s > 0 and math.isfinite(timeout_s)):
            raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s}")
        self.factory = factory
        self.args = tuple(args)
        self.n_workers = int(n_workers)
        self.timeout_s = float(timeout_s)
        self.start_timeout_s = float(start_timeout_s)
        self.name = name
        try:
            self._init_msg = frame(("init", factory, self.args, name, list(sys.path)))
        except Exception as exc:
            raise RewardFatal(
                f"{name}: the arguments of reward factory '{factory}' must be plain picklable data: "
                f"{type(exc).__name__}: {exc}"
            ) from None
        self._lock = threading.Lock()
        self._sel = selectors.DefaultSelector()
        self._workers: list[_Worker] = []
        self._procs: list[subprocess.Popen] = []  # shared with the finalizer (which must not reference self)
        self._closed = False
        self._counts = {
            "jobs": 0,
            "ok": 0,
            "errors": 0,
            "timeouts": 0,
            "worker_deaths": 0,
            "workers_started": 0,
            "score_seconds": 0.0,
        }
        self._finalizer = weakref.finalize(self, shutdown, self._procs, os.getpid())
        try:
            self._fill()
        except BaseException:
            self.close()
            raise

    # ---------------------------------------------------------------------------------------------- public

    def score(self, jobs: list[tuple[Any, str]]) -> list[RewardResult]:
        """Scores every (key, text): results in job order; blocks until all are done (one call at a time)."""
        jobs = list(jobs)
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name}: the reward pool is closed")
            if not jobs:
                return []
            t0 = time.perf_counter()
            try:
                results = self._run(jobs)
            except BaseException:
                # Interrupted (RewardFatal, KeyboardInterrupt, a key that does not pickle ...): workers still busy
                # with this call's jobs would answer into the next one. End them; they are replaced on demand.
                for w in list(self._workers):
                    if w.outstanding:
                        self._drop(w)
                raise
            finally:
                self._counts["score_seconds"] += time.perf_counter() - t0
            return results

    def warmup(self, timeout: float | None = None) -> None:
        """Waits until every worker has built its reward function; RewardFatal if the factory fails."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name}: the reward pool is closed")
            self._fill()
            deadline = None if timeout is None else time.monotonic() + timeout
            while not all(w.ready for w in self._workers) or len(self._workers) < self.n_workers:
                self._fill()
                wait = self._next_deadline(time.monotonic())
                if deadline is not None:
                    wait = deadline - time.monotonic() if wait is None else min(wait, deadline - time.monotonic())
                    if wait <= 0:
                        raise TimeoutError(f"{self.name}: reward workers not ready after {timeout}s")
                self._poll(wait, None, None, None)
                self._check_start_timeouts()

    def stats(self) -> dict[str, float]:
        """Counters since construction: jobs, ok, errors, timeouts, worker_deaths, workers_started, score_seconds."""
        with self._lock:
            out = dict(self._counts)
            out["workers_alive"] = len(self._workers)
            return out

    @property
    def pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers]

    def close(self) -> None:
        """Ends the workers (end of input, then SIGKILL after 0.2 s). Idempotent; waits for a score() running in
        another thread to return."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for w in self._workers:
                try:
                    self._sel.unregister(w.fd)
                except (KeyError, ValueError):
                    pass
            self._workers.clear()
            self._finalizer()
            self._sel.close()

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --------------------------------------------------------------------------------------------- workers

    def _spawn(self) -> _Worker:
        proc = spawn("rollout_hpc.rewards.worker")
        self._procs.append(proc)
        self._counts["workers_started"] += 1
        w = _Worker(proc)
        self._workers.append(w)
        self._sel.register(w.fd, selectors.EVENT_READ, w)
        if not self._send(w, self._init_msg):
            pass  # it died at once: the EOF on its stdout reports it
        return w

    def _fill(self) -> None:
        while len(self._workers) < self.n_workers:
            self._spawn()

    def _send(self, w: _Worker, data: bytes) -> bool:
        return send(w.proc, data)

    def _drop(self, w: _Worker) -> int | None:
        """Removes a worker from the pool and ends it; returns its exit code."""
        try:
            self._sel.unregister(w.fd)
        except (KeyError, ValueError):
            pass
        if w in self._workers:
            self._workers.remove(w)
        code = reap(w.proc)
        if w.proc in self._procs:
            self._procs.remove(w.proc)
        return code

    def _fatal(self, message: str) -> RewardFatal:
        for w in list(self._workers):
            self._drop(w)
        return RewardFatal(message)

    # ---------------------------------------------------------------------------------------------- engine

    def _next_deadline(self, now: float) -> float | None:
        deadlines = []
        for w in self._workers:
            if w.outstanding:
                deadlines.append(w.head_start + self.timeout_s)
            elif not w.ready:
                deadlines.append(w.started + self.start_timeout_s)
        return None if not deadlines else max(0.0, min(deadlines) - now)

    def _check_start_timeouts(self) -> None:
        now = time.monotonic()
        for w in self._workers:
            if not w.ready and now - w.started > self.start_timeout_s:
                raise self._fatal(
                    f"{self.name}: reward factory '{self.factory}' did not finish within "
                    f"{self.start_timeout_s:g}s in a reward worker"
                )

    def _run(self, jobs: list[tuple[Any, str]]) -> list[RewardResult]:
        n = len(jobs)
        results: list[RewardResult | None] = [None] * n
        pending = deque(range(n))
        remaining = [n]
        self._fill()
        self._counts["jobs"] += n
        while remaining[0]:
            self._dispatch(jobs, pending, results, remaining)
            if not remaining[0]:
                break
            self._poll(self._next_deadline(time.monotonic()), jobs, results, remaining, pending)
            self._check_timeouts(results, remaining, pending)
            self._check_start_timeouts()
            self._fill()
        assert None not in results  # remaining[0] == 0: every job has its result
        return cast("list[RewardResult]", results)

    def _dispatch(self, jobs, pending: deque, results, remaining) -> None:
        idle = [w for w in self._workers if w.ready and not w.outstanding]
        for w in idle:
            if not pending:
                return
            k = max(1, min(_MAX_CHUNK, len(pending) // (2 * self.n_workers)))
            ids = [pending.popleft() for _ in range(min(k, len(pending)))]
            msg = frame(("jobs", [(i, jobs[i][0], jobs[i][1]) for i in ids]))
            w.outstanding.extend(ids)
            w.head_start = time.monotonic()
            if not self._send(w, msg):
                self._on_death(w, results, remaining, pending)

    def _poll(self, wait: float | None, jobs, results, remaining, pending=None) -> None:
        for key, _ in self._sel.select(wait):
            w: _Worker = key.data
            if w not in self._workers:
                continue
            try:
                data = os.read(w.fd, 1 << 16)
            except OSError:
                data = b""
            if not data:
                self._on_death(w, results, remaining, pending)
                continue
            w.buf += data
            now = time.monotonic()
            for msg in w.messages():
                self._on_message(w, msg, now, jobs, results, remaining)

    def _on_message(self, w: _Worker, msg, now: float, jobs, results, remaining) -> None:
        if msg[0] == "ready":
            w.ready = True
            return
        if msg[0] == "fatal":
            if msg[2]:  # the loader's PluginError names the factory and the fix
                raise self._fatal(f"{self.name}: {msg[1]}")
            raise self._fatal(f"{self.name}: reward factory '{self.factory}' failed in the reward worker: {msg[1]}")
        job_id, status, payload = msg
        if not w.outstanding or w.outstanding[0] != job_id or results is None:
            raise self._fatal(
                f"{self.name}: reward worker {w.proc.pid} answered job {job_id} out of turn (protocol error)"
            )
        w.outstanding.popleft()
        w.head_start = now
        remaining[0] -= 1
        try:
            result = job_result(status, payload, self.name, self.factory, jobs[job_id])
        except RewardFatal as exc:
            raise self._fatal(str(exc)) from None
        results[job_id] = result
        self._counts["ok" if result.ok else "errors"] += 1

    def _on_death(self, w: _Worker, results, remaining, pending) -> None:
        was_ready = w.ready
        code = self._drop(w)
        if not was_ready:
            raise self._fatal(
                f"{self.name}: a reward worker for factory '{self.factory}' exited while building the "
                f"reward function ({exit_text(code)}; its stderr is in the rank's log)"
            )
        self._counts["worker_deaths"] += 1
        if w.outstanding and results is not None:
            head = w.outstanding.popleft()
            results[head] = RewardResult(0.0, REWARD_ERROR, exit_text(code))
            self._counts["errors"] += 1
            remaining[0] -= 1
            pending.extendleft(reversed(w.outstanding))
            w.outstanding.clear()

    def _check_timeouts(self, results, remaining, pending) -> None:
        now = time.monotonic()
        for w in list(self._workers):
            if w.outstanding and now - w.head_start >= self.timeout_s:
                self._drop(w)
                head = w.outstanding.popleft()
                results[head] = RewardResult(0.0, REWARD_TIMEOUT, f"timed out after {self.timeout_s:g}s")
                self._counts["timeouts"] += 1
                remaining[0] -= 1
                pending.extendleft(reversed(w.outstanding))
                w.outstanding.clear()
