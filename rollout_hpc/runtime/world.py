"""The MPI world of one run: who am I (generator, trainer or reward), on which node, and the communicators.

One MPI world spans the heterogeneous groups. Under `srun --het-group=0-1`
(0-2 with a reward group) group 0's tasks come first, and the local launcher
starts its MPMD blocks in the same order, so world ranks [0, generator.ranks)
are generators, the next trainer.ranks trainers, and the rest (if any) the
reward group (rewards.models with nodes > 0). Each pair of groups that talks
has an intercommunicator: generators-trainers (weights, and experience without
a reward group), generators-reward and reward-trainers (experience through the
reward group).

The node a rank runs on is SLURMD_NODENAME under Slurm, else ROLLOUT_NODE (the
local launcher sets it per MPMD block to emulate several nodes on one host),
else the hostname. Ranks that share a node name AND a role share a node ring.

MPI is initialised with MPI_THREAD_MULTIPLE because the exchange runs one
forwarding thread per node leader next to the rank's own work (Open MPI 4.1
grants it with the ob1/vader/tcp transports; `init_world` fails clearly if the
library gives less).
"""

from __future__ import annotations

import os
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import mpi4py

if TYPE_CHECKING:  # at run time mpi4py.MPI is imported by _mpi() only (the thread level must be set first)
    from mpi4py import MPI

from rollout_hpc.errors import WorldError

GENERATOR = "generator"
TRAINER = "trainer"
REWARD = "reward"
ENV = "env"
ROLES = (GENERATOR, TRAINER, REWARD, ENV)  # in world-rank order
# The intercommunicators, each with its own tag, created in this order: no group waits on one that waits on it.
_PAIRS = ((GENERATOR, TRAINER), (GENERATOR, REWARD), (REWARD, TRAINER), (GENERATOR, ENV))
_INTERCOMM_TAG = 7001


def _mpi():
    """Import mpi4py.MPI asking for MPI_THREAD_MULTIPLE (only effective before the first import)."""
    mpi4py.rc.thread_level = "multiple"
    from mpi4py import MPI

    return MPI


def node_name_from_env() -> str:
    return os.environ.get("SLURMD_NODENAME") or os.environ.get("ROLLOUT_NODE") or socket.gethostname()


@dataclass(frozen=True)
class RankInfo:
    """What every rank knows about every other rank (allgathered once at start)."""

    rank: int
    role: str
    group_rank: int
    node_name: str
    node_index: int
    local_rank: int


@dataclass
class World:
    comm: MPI.Intracomm  # MPI.COMM_WORLD
    rank: int
    size: int
    role: str  # "generator" | "trainer" | "reward" | "env"
    group_rank: int
    group_size: int
    group_comm: MPI.Intracomm  # the ranks of my role
    inter_comm: MPI.Intercomm  # generators <-> trainers; a reward rank's: to the trainers, an env rank's: to the
    # generators (remote ranks = group ranks)
    node_name: str
    node_index: int  # index of my node within my group, in order of group rank
    n_nodes: int  # nodes in my group
    node_comm: MPI.Intracomm  # ranks of my role on my node
    local_rank: int
    local_size: int
    job_id: str  # SLURM_JOB_ID, or a token unique to this mpirun (names shared-memory segments)
    ranks: list[RankInfo] = field(repr=False, default_factory=list)
    links: dict[str, MPI.Intercomm] = field(repr=False, default_factory=dict)  # intercommunicator per other role

    def link(self, role: str) -> MPI.Intercomm:
        """The intercommunicator to `role`'s group (remote ranks are their group ranks)."""
        return self.links[role]

    def has_role(self, role: str) -> bool:
        return any(r.role == role for r in self.ranks)

    @property
    def is_generator(self) -> bool:
        return self.role == GENERATOR

    @property
    def is_reward(self) -> bool:
        return self.role == REWARD

    @property
    def is_env(self) -> bool:
        return self.role == ENV

    @property
    def is_trainer(self) -> bool:
        return self.role == TRAINER

    @property
    def log_writer(self) -> int:
        """The world rank of trainer group rank 0, which writes the log and prints the progress line."""
        return next(r.rank for r in self.ranks if r.role == TRAINER and r.group_rank == 0)

    @property
    def is_node_leader(self) -> bool:
        return self.local_rank == 0

    def leaders(self, role: str) -> list[RankInfo]:
        """Node leaders of `role`, ordered by node index (their group_rank addresses them over inter_comm)."""
        out = {r.node_index: r for r in self.ranks if r.role == role and r.local_rank == 0}
        return [out[i] for i in sorted(out)]

    def facts(self) -> dict:
        """The plain facts of this rank (what `hello` prints and writes)."""
        return {
            "rank": self.rank,
            "size": self.size,
            "role": self.role,
            "group_rank": self.group_rank,
            "group_size": self.group_size,
            "node": self.node_name,
            "node_index": self.node_index,
            "n_nodes": self.n_nodes,
            "local_rank": self.local_rank,
            "local_size": self.local_size,
            "is_node_leader": self.is_node_leader,
            "inter_remote_size": self.inter_comm.Get_remote_size(),
            "job_id": self.job_id,
        }


def init_world(cfg, comm=None) -> World:
    """Learn this rank's role and node from the launch, and build the communicators.

    Collective over `comm` (default COMM_WORLD)."""
    MPI = _mpi()
    comm = comm if comm is not None else MPI.COMM_WORLD
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        raise WorldError(
            f"the MPI library gave thread level {MPI.Query_thread()}, rollout-hpc needs MPI_THREAD_MULTIPLE "
            "(import rollout_hpc.runtime.world before anything imports mpi4py.MPI, or use an MPI built with threads)"
        )
    sections = _sections(cfg)
    if comm.Get_size() != cfg.world_size:
        sizes = " + ".join(
            f"{_key(cfg, role)} ranks {s.ranks} (nodes {s.nodes} x tasks_per_node {s.tasks_per_node})"
            for role, s in sections
        )
        raise WorldError(
            f"the MPI world has {comm.Get_size()} ranks, but the config needs {sizes} = {cfg.world_size}; "
            "launch with `rollout-hpc submit` (or mpirun -np matching), or fix the group sizes in the config"
        )
    rank = comm.Get_rank()
    first, start = {}, 0  # the world rank of each group's first rank (its leader in the intercommunicators)
    for role, section in sections:
        first[role], start = start, start + section.ranks
    role = max((r for r, _ in sections if first[r] <= rank), key=lambda r: first[r])
    group_comm = comm.Split(ROLES.index(role), rank)
    links = {}
    for tag, (a, b) in enumerate(_PAIRS, _INTERCOMM_TAG):
        if role in (a, b) and a in first and b in first:
            other = b if role == a else a
            links[other] = group_comm.Create_intercomm(0, comm, first[other], tag)
    inter_comm = links[TRAINER if role in (GENERATOR, REWARD) else GENERATOR]

    node_name = node_name_from_env()
    names = group_comm.allgather(node_name)
    order = list(dict.fromkeys(names))  # nodes in order of their first group rank
    node_index = order.index(node_name)
    node_comm = group_comm.Split(node_index, group_comm.Get_rank())

    job_id = os.environ.get("SLURM_JOB_ID") or f"local{os.getpid()}x{os.urandom(3).hex()}"
    job_id = comm.bcast(job_id, root=0)
    me = RankInfo(rank, role, group_comm.Get_rank(), node_name, node_index, node_comm.Get_rank())
    ranks = comm.allgather(me)
    _check_nodes(cfg, ranks)
    return World(
        comm=comm,
        rank=rank,
        size=comm.Get_size(),
        role=role,
        group_rank=group_comm.Get_rank(),
        group_size=group_comm.Get_size(),
        group_comm=group_comm,
        inter_comm=inter_comm,
        links=links,
        node_name=node_name,
        node_index=node_index,
        n_nodes=len(order),
        node_comm=node_comm,
        local_rank=node_comm.Get_rank(),
        local_size=node_comm.Get_size(),
        job_id=job_id,
        ranks=ranks,
    )


def _sections(cfg) -> list[tuple[str, Any]]:
    """(role, its GroupSection) of each group of the run, in world-rank order."""
    return [(role, group) for role, group, _ in cfg.het_groups]


def _key(cfg, role: str) -> str:
    """Where the config sets a group's layout."""
    return next(key for r, _, key in cfg.het_groups if r == role)


def _check_nodes(cfg, ranks: list[RankInfo]) -> None:
    """A group's node count must match the config: node rings and balancing depend on it."""
    for role, section in _sections(cfg):
        nodes = {r.node_name for r in ranks if r.role == role}
        if len(nodes) != section.nodes:
            raise WorldError(
                f"{_key(cfg, role)}.nodes is {section.nodes} but the {role} ranks run on {len(nodes)} node(s) {sorted(nodes)}; "
                f"launch with {section.tasks_per_node} task(s) per node (srun --ntasks-per-node, or ROLLOUT_NODE per "
                "MPMD block under mpirun)"
            )


def free_world(world: World) -> None:
    """Release the communicators (before MPI finalises at exit)."""
    for c in (*world.links.values(), world.node_comm, world.group_comm):
        c.Free()


def abort_world(message: str, code: int = 2) -> None:
    """From any thread of any rank: say why, then end every rank of the job (MPI_Abort). For errors found off the
    main thread (a reward worker's fatal result): raising there would only end that thread while the main thread
    waits for weights that never come."""
    rank = os.environ.get("OMPI_COMM_WORLD_RANK") or os.environ.get("PMIX_RANK") or os.environ.get("SLURM_PROCID", "?")
    print(f"rollout-hpc: rank {rank}: error: {message}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    _mpi().COMM_WORLD.Abort(code)


def sleeping_barrier(comm, interval: float = 0.0002) -> None:
    """A barrier whose wait sleeps. A blocking MPI wait (Barrier, a collective entered early) spins its core
    until the last rank arrives; where ranks share cores (colocated, a shared host, a node with more ranks than
    cores) that spin takes CPU from the ranks everyone waits for. Enter a collective after this one instead."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(interval)
