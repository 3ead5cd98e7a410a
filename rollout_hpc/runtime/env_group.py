"""The environment group (envs.nodes > 0): ranks of a het component of their own that host the generators'
environments, and the generator's side of it.

    generator rank g --one message per turn: [(key, method, arg), ...]--> environment rank g mod E
        runs them on its host (threads, or envs.workers processes: envs/hosts.py) --{key: Reply}--> generator rank g

The calls and replies are text and small numbers: pickled point-to-point messages on the generator <-> environment
intercommunicator (world.link), polled with short sleeps on both sides (a blocking MPI receive would spin a core that
the ranks sharing the node need). An environment rank serves the generators mapped to it in the order their turns
arrive, and ends once each of them has said BYE (when its loop ends, after a stop too).

An environment rank holds no state of the run: an episode still being played at a stop is replayed from its seed
after the resume (backends/episodes.py), wherever its environment lives. An environment that raises, hangs or crashes
ends its episode (with envs.workers, a crash of the native code ends the worker process, not the rank); an environment
rank that dies ends the job like any rank (MPI), and the run resumes from its last checkpoint.
"""

from __future__ import annotations

import time
from collections.abc import Hashable
from pathlib import Path

from rollout_hpc.envs import load_task
from rollout_hpc.envs.hosts import Call, EnvHost, Reply, ThreadEnvs
from rollout_hpc.envs.process_envs import ProcessEnvs
from rollout_hpc.rundir_layout import data_dir
from rollout_hpc.runtime import watchdog
from rollout_hpc.runtime.world import ENV, GENERATOR

CALLS_TAG, REPLIES_TAG = 7301, 7302
BYE = "bye"
POLL_S = 0.0002


def _wait_for(comm, source: int, tag: int, status=None) -> None:
    """Return once a message from `source` (may be ANY_SOURCE) with `tag` can be received; sleeps between probes."""
    while not comm.Iprobe(source=source, tag=tag, status=status):
        time.sleep(POLL_S)


def local_host(cfg, task, run_dir: Path) -> EnvHost:
    """The host of the environments this rank runs itself: envs.workers processes, or threads of the rank."""
    timeout = cfg.task.env.step_timeout
    if cfg.envs.workers:
        return ProcessEnvs(cfg.task, data_dir(run_dir), cfg.envs.workers, timeout)
    return ThreadEnvs(lambda key: task.make_env(), timeout)


class RemoteEnvs:
    """A generator rank's EnvHost on its environment rank (over the generator <-> environment intercommunicator)."""

    def __init__(self, comm, dest: int) -> None:
        self.comm, self.dest, self.open = comm, dest, True

    def run(self, calls: list[Call]) -> dict[Hashable, Reply]:
        self.comm.send(calls, dest=self.dest, tag=CALLS_TAG)
        _wait_for(self.comm, self.dest, REPLIES_TAG)
        return self.comm.recv(source=self.dest, tag=REPLIES_TAG)

    def close(self) -> None:
        if self.open:
            self.open = False
            self.comm.send(BYE, dest=self.dest, tag=CALLS_TAG)


def generator_host(world, cfg, task, run_dir: Path) -> EnvHost | None:
    """Where a generator rank's environments live: its environment rank, its worker processes, or (None) its
    threads (the episode loop's default)."""
    if world.has_role(ENV):
        link = world.link(ENV)
        return RemoteEnvs(link, world.group_rank % link.Get_remote_size())
    if cfg.envs.workers:
        return local_host(cfg, task, run_dir)
    return None


def serve_environments(world, cfg, run_dir: Path) -> int:
    """An environment rank's loop: run each turn's calls of its generators until every one has said BYE."""
    from mpi4py import MPI

    task = load_task(cfg.task, data_dir=data_dir(run_dir))
    host = local_host(cfg, task, run_dir)
    comm = world.link(GENERATOR)  # remote ranks: the generators' group ranks
    mine = {g for g in range(comm.Get_remote_size()) if g % world.group_size == world.group_rank}
    status = MPI.Status()
    watchdog.beat(0)
    try:
        while mine:
            if not comm.Iprobe(source=MPI.ANY_SOURCE, tag=CALLS_TAG, status=status):
                watchdog.waiting()  # waiting for the generators is not a hang of this rank
                time.sleep(POLL_S)
                continue
            source = status.Get_source()
            calls = comm.recv(source=source, tag=CALLS_TAG)
            if calls == BYE:
                mine.discard(source)
                continue
            replies = host.run([((source, key), method, arg) for key, method, arg in calls])
            comm.send({key[1]: reply for key, reply in replies.items()}, dest=source, tag=REPLIES_TAG)  # type: ignore[index]
            watchdog.beat()
    finally:
        host.close()
    return 0
