"""Reward-model throughput for the progress line: every process that scores with rewards.models tells the log writer
how many samples it scored and in how many seconds.

Scoring runs on the generator ranks (nodes: 0, in the reward sender thread) or on the reward group's ranks
(nodes > 0); the log is written by trainer group rank 0. Each scored batch sends one small message (samples,
seconds) on a communicator of its own (a duplicate of the world's, made on every rank), which the log writer takes
once a step, without waiting, into `rm_samples_per_s`: samples per second of scoring, per scoring process (what one
rank sustains while it scores: the group's capacity is that times its ranks; compare it with samples_per_s, what
the run needs). A message that arrives after the step's batch counts in the next step's figure.
"""

from __future__ import annotations

import threading

TAG = 51
METRIC = "rm_samples_per_s"


class RateSender:
    """A scoring process's side: `sent(samples, seconds)` after each scored batch (any thread)."""

    def __init__(self, comm, logger_rank: int):
        self.comm, self.dest = comm, logger_rank
        self.pending: list = []
        self.lock = threading.Lock()

    def sent(self, samples: int, seconds: float) -> None:
        with self.lock:
            self.pending = [r for r in self.pending if not r.Test()]
            self.pending.append(self.comm.isend((int(samples), float(seconds)), dest=self.dest, tag=TAG))

    def close(self) -> None:
        """Before the rank ends: its last reports have left (small messages: they complete without the receiver)."""
        with self.lock:
            for r in self.pending:
                r.Wait()
            self.pending = []


class RateReceiver:
    """The log writer's side: `take()` once a step -> {METRIC: rate} when any report came since the last call."""

    def __init__(self, comm):
        self.comm = comm

    def take(self) -> dict[str, float]:
        from mpi4py import MPI

        samples, seconds = 0, 0.0
        while self.comm.iprobe(source=MPI.ANY_SOURCE, tag=TAG):
            n, s = self.comm.recv(source=MPI.ANY_SOURCE, tag=TAG)
            samples, seconds = samples + n, seconds + s
        return {METRIC: samples / seconds} if samples and seconds > 0 else {}
