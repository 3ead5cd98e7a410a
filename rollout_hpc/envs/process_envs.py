"""ProcessEnvs: a generator rank's environments in worker processes on its node (`envs.workers: N`).

For environments whose step is expensive or fragile (a simulator, a browser, a native library): their Python runs
in N processes beside the rank, not in the rank's threads, so their CPU work does not contend for the rank's GIL,
and a crash takes down a worker, not the rank. Each episode's environment lives in one worker (the one with the
fewest open environments when the episode starts); every turn the rank sends each worker one message with the calls
of its episodes and reads one message back (envs/env_worker.py; inside, each environment runs in a thread under
task.env.step_timeout, as in the rank).

What can go wrong, and what it costs:
- an environment raises, hangs past step_timeout, or returns no text: its episode ends as an error (the worker's
  ThreadEnvs says so), the worker goes on;
- a worker dies (segfault, os._exit, the OOM killer): every episode it held ends with EPISODE_ERROR and the exit
  code as the reason; a worker that does not answer within step_timeout + worker_grace (a hang that holds the
  GIL, which a thread deadline cannot escape) is killed and its episodes end with EPISODE_TIMEOUT. Either way a new
  worker takes the next episodes, and the run goes on;
- the task cannot be built in a worker (it could in the rank): TaskError, the run ends with the worker's message.
"""

from __future__ import annotations

import os
import selectors
import sys
import time
import weakref
from collections.abc import Hashable
from dataclasses import dataclass, field
from pathlib import Path
from subprocess import Popen
from typing import Any

from rollout_hpc.envs.hosts import Call, Reply, failed
from rollout_hpc.errors import TaskError
from rollout_hpc.trajectory import EPISODE_ERROR, EPISODE_TIMEOUT
from rollout_hpc.worker_process import exit_text, frame, reap, send, shutdown, spawn, split_messages


def worker_grace(timeout: float) -> float:
    """How long past step_timeout a worker may take to answer (its own deadline has fired; the answer is on its
    way): half the step timeout, 1 to 10 s."""
    return min(10.0, max(1.0, timeout / 2))


START_TIMEOUT_S = 300.0  # a new worker imports the task (gymnasium, a simulator) before it answers


@dataclass
class _Worker:
    proc: Popen
    ready: bool = False
    buf: bytearray = field(default_factory=bytearray)

    @property
    def fd(self) -> int:
        assert self.proc.stdout is not None  # started with stdout=PIPE
        return self.proc.stdout.fileno()


class ProcessEnvs:
    """The EnvHost of envs/hosts.py with `workers` processes; task_cfg (the config's task section) builds the task
    in each, data_dir as the rank's (a dataset task's files)."""

    def __init__(self, task_cfg: Any, data_dir: Path | None, workers: int, timeout: float) -> None:
        if workers < 1:
            raise ValueError(f"envs.workers must be >= 1 for worker processes, got {workers}")
        self.timeout, self.grace = timeout, worker_grace(timeout)
        self.init_msg = frame(("init", task_cfg, data_dir, timeout, list(sys.path)))
        self.workers: list[_Worker | None] = [None] * workers  # started when first needed
        self.where: dict[Hashable, int] = {}  # episode key -> its worker
        self.lost: dict[Hashable, Reply] = {}  # open episodes whose worker died between their calls
        self.deaths = 0
        self._procs: list[Popen] = []  # shared with the finalizer (which must not reference self)
        self._finalizer = weakref.finalize(self, shutdown, self._procs, os.getpid())

    # --- the host's contract -------------------------------------------------------------------------------------

    def run(self, calls: list[Call]) -> dict[Hashable, Reply]:
        out: dict[Hashable, Reply] = {}
        batches: dict[int, list[Call]] = {}
        for key, method, arg in calls:
            if method == "reset":
                self._forget(key)
                self.where[key] = self._least_loaded()
            elif key in self.lost:
                reply = self.lost.pop(key)
                if method != "close":
                    out[key] = reply
                continue
            w = self.where.get(key)
            if method == "close":
                self.where.pop(key, None)
            if w is None:
                if method != "close":
                    out[key] = failed(EPISODE_ERROR, f"{method}() on an environment that is closed")
                continue
            batches.setdefault(w, []).append((key, method, arg))
        waiting: dict[int, list[Hashable]] = {}
        for w, batch in batches.items():
            worker = self._worker(w)
            send(worker.proc, frame(("calls", batch)))  # a dead worker: its EOF is read below
            waiting[w] = [key for key, method, _ in batch if method != "close"]
        self._collect(waiting, out)
        for key, reply in out.items():
            if not reply.ok:  # the environment is closed (the worker's host closed it, or the worker is gone)
                self.where.pop(key, None)
        return out

    def close(self) -> None:
        self.where.clear()
        self.lost.clear()
        self.workers = [None] * len(self.workers)
        self._finalizer()

    # --- workers -------------------------------------------------------------------------------------------------

    def _least_loaded(self) -> int:
        load = [0] * len(self.workers)
        for w in self.where.values():
            load[w] += 1
        return min(range(len(load)), key=load.__getitem__)

    def _worker(self, w: int) -> _Worker:
        worker = self.workers[w]
        if worker is None:
            proc = spawn("rollout_hpc.envs.env_worker")
            self._procs.append(proc)
            send(proc, self.init_msg)
            worker = self.workers[w] = _Worker(proc)
        return worker

    def _forget(self, key: Hashable) -> None:
        self.lost.pop(key, None)
        self.where.pop(key, None)

    def _collect(self, waiting: dict[int, list[Hashable]], out: dict[Hashable, Reply]) -> None:
        """Read each waiting worker's replies; a worker that ends or is past its deadline loses its episodes."""
        now = time.monotonic()
        deadline = {w: now + self.timeout + self.grace + (0 if self._ready(w) else START_TIMEOUT_S) for w in waiting}
        with selectors.DefaultSelector() as sel:
            for w in waiting:
                sel.register(self._running(w).fd, selectors.EVENT_READ, w)
            while waiting:
                wait = max(0.0, min(deadline[w] for w in waiting) - time.monotonic())
                for sk, _ in sel.select(timeout=wait):
                    w = sk.data
                    data = os.read(sk.fd, 1 << 20)
                    if not data:
                        sel.unregister(sk.fd)
                        self._lose(w, waiting.pop(w), out, EPISODE_ERROR, "")
                        continue
                    worker = self._running(w)
                    worker.buf += data
                    for msg in split_messages(worker.buf):
                        if msg[0] == "fatal":
                            self.close()
                            raise TaskError(f"an environment worker process could not build the task: {msg[1]}")
                        if msg[0] == "ready":
                            worker.ready = True
                            deadline[w] = time.monotonic() + self.timeout + self.grace
                        elif msg[0] == "replies":
                            out.update(msg[1])
                            waiting.pop(w, None)
                            sel.unregister(sk.fd)
                now = time.monotonic()
                for w in [w for w in waiting if deadline[w] <= now]:
                    sel.unregister(self._running(w).fd)
                    why = f"did not answer within task.env.step_timeout={self.timeout:g}s + {self.grace:g}s (killed)"
                    self._lose(w, waiting.pop(w), out, EPISODE_TIMEOUT, why)

    def _ready(self, w: int) -> bool:
        worker = self.workers[w]
        return worker is not None and worker.ready

    def _running(self, w: int) -> _Worker:
        """Worker w, started (it may not have answered "ready" yet)."""
        worker = self.workers[w]
        assert worker is not None
        return worker

    def _lose(self, w: int, keys: list[Hashable], out: dict[Hashable, Reply], status: int, why: str) -> None:
        """Worker w is gone (or killed now): the calls it was running fail; its other open episodes fail at their
        next call; the next episodes get a new worker."""
        worker = self._running(w)
        self.workers[w] = None
        code = reap(worker.proc)
        if worker.proc in self._procs:
            self._procs.remove(worker.proc)
        self.deaths += 1
        why = f"the environment's worker process {why or exit_text(code).removeprefix('worker ')}"
        print(f"rollout-hpc: {why}; its {len(keys)} episode(s) end, a new worker takes the next", file=sys.stderr)
        for key in keys:
            out[key] = failed(status, why)
        for key in [k for k, where in self.where.items() if where == w and k not in out]:
            self.lost[key] = failed(EPISODE_ERROR, why)
            del self.where[key]
