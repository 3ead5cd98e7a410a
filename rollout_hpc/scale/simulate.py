"""A discrete-event simulation (simpy) of one layout of the RL loop, driven by a profile's costs.

Three processes run as the real loop does (runtime/generator_loop.py, trainer_loop.py): the generator group
generates step s once it holds weights of version >= s - max_staleness; the reward sender scores the batch and
moves it to the trainers (bounded queues: backpressure); the trainer group trains, logs, broadcasts the new
weights and checkpoints every checkpoint_every steps. Groups are simulated as a whole: the group's step ends
with its slowest rank, so the step's generation takes as long as the longest of all its responses (drawn from
the profile's length distribution as the maximum of S draws: exact for independent lengths), not the mean.
Allocation limits and node failures are added in closed form (expected lost work per interruption), which is
exact in expectation. What the model leaves out: docs/scale.md.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
import simpy

from rollout_hpc.scale.profile import Profile, bcast_stages

SCORE_QUEUE_STEPS = 4  # the reward sender's queue (runtime/generator_loop.RewardWorkers)


@dataclass(frozen=True)
class Layout:
    placement: str  # "disaggregated" or "colocated" (same nodes, phases take turns: on-policy only)
    generator_nodes: int
    trainer_nodes: int
    max_staleness: int
    gen_tasks_per_node: int
    train_tasks_per_node: int

    @property
    def gen_ranks(self) -> int:
        return self.generator_nodes * self.gen_tasks_per_node

    @property
    def train_ranks(self) -> int:
        return self.trainer_nodes * self.train_tasks_per_node

    @property
    def nodes(self) -> int:
        return self.generator_nodes if self.placement == "colocated" else self.generator_nodes + self.trainer_nodes

    def overrides(self) -> list[str]:
        """The `--set` options that give a config this layout."""
        return [
            f"placement={self.placement}",
            f"generator.nodes={self.generator_nodes}",
            f"trainer.nodes={self.trainer_nodes}",
            f"exchange.max_staleness={self.max_staleness}",
        ]


@dataclass(frozen=True)
class RunShape:
    """What the config fixes besides the layout."""

    prompts_per_step: int
    group_size: int
    steps: int
    checkpoint_every: int  # steps; 0 = none
    checkpoint_writers_per_rank: bool  # ZeRO / Megatron: every trainer rank writes its shard; else one writer
    uses_gpus: bool
    ring_bytes: int
    max_inflight_bytes: int
    time_limit_s: float  # one allocation (slurm.time)
    signal_lead_s: float
    requeue_wait_s: float = 300.0  # queue wait of a requeued job: an assumption (docs/scale.md)
    node_mtbf_h: float = 50_000.0  # mean time between failures of one node: an assumption


@dataclass
class Prediction:
    layout: Layout
    step_s: float  # mean wall time of one RL step (the trainer's period), checkpoints included
    samples_per_s: float  # steady state, without interruptions
    tokens_per_s: float
    effective_samples_per_s: float  # with allocation ends and node failures (expected)
    gen_idle: float  # share of the wall time the generator group waits
    train_idle: float
    staleness: float  # mean (step - policy version it was generated with)
    gen_s: float  # one step's parts, in the simulated mean
    handoff_s: float
    train_s: float
    sync_s: float
    checkpoint_s: float  # one checkpoint
    ring_bytes_needed: int  # per generator node: the experience of the steps that can be in flight
    inflight_bytes_needed: int
    interruptions: float  # expected over the run: allocation ends + node failures
    lost_s_per_interruption: float

    def row(self) -> dict:
        out = asdict(self)
        out.update(out.pop("layout"))
        return out


class StepCosts:
    """The profile's costs for one layout and run shape: one call per step part."""

    def __init__(self, profile: Profile, layout: Layout, shape: RunShape, rng: np.random.Generator):
        self.p, self.layout, self.shape, self.rng = profile, layout, shape, rng
        c, w, m = profile.costs, profile.workload, profile.machine
        P, G = shape.prompts_per_step, shape.group_size
        self.samples = P * G
        self.gen_active = min(layout.gen_ranks, P)  # ranks with prompts (a prompt's group stays on one rank)
        self.per_gen_rank = math.ceil(P / layout.gen_ranks) * G
        self.train_active = min(layout.train_ranks, P)
        lengths = np.sort(np.asarray(w.response_lengths or [w.max_new_tokens], float))
        self.lengths = np.minimum(lengths, w.max_new_tokens)
        self.resp_mean = float(self.lengths.mean())
        self.tokens_per_sample = w.prompt_len_mean + self.resp_mean
        self.sample_bytes = profile.record_bytes(self.tokens_per_sample)
        self.gen_speed, self.train_speed = self._speeds(c, m)

    def _speeds(self, c, m) -> tuple[float, float]:
        """Compute speed of each phase relative to the profile's measurement: more threads for a colocated rank
        on a CPU, less when the phase's ranks oversubscribe the cores (all ranks on one host, or on one node)."""
        lay = self.layout
        if self.shape.uses_gpus:
            return 1.0, 1.0
        cores = m.cores_per_node
        tg, tt = m.gen_threads, m.train_threads
        gen_up = train_up = 1.0
        if lay.placement == "colocated":  # each role's ranks of a node share its cores in their phase
            tg, tt = max(1, cores // lay.gen_tasks_per_node), max(1, cores // lay.train_tasks_per_node)
            gen_up = _interpolate(tg, m.gen_threads, cores, c.gen_speedup_all_cores)
            train_up = _interpolate(tt, m.train_threads, cores, c.train_speedup_all_cores)
        if m.shared_host:  # every rank of the layout on one machine's cores
            gen_load, train_load = self.gen_active * tg, self.train_active * tt
        else:
            gen_load, train_load = lay.gen_tasks_per_node * tg, lay.train_tasks_per_node * tt
        if lay.max_staleness > 0 and lay.placement != "colocated" and m.shared_host:
            gen_load = train_load = gen_load + train_load  # both groups compute at once
        return gen_up / max(1.0, gen_load / cores), train_up / max(1.0, train_load / cores)

    def longest_response(self) -> float:
        """The longest of the step's S responses: the inverse CDF at U^(1/S), U uniform (max of S draws)."""
        u = self.rng.random() ** (1.0 / self.samples)
        return float(self.lengths[min(len(self.lengths) - 1, int(u * len(self.lengths)))])

    def gen(self) -> float:
        c = self.p.costs
        L = self.longest_response()
        n = self.per_gen_rank
        compute = (c.gen_fixed_s + c.gen_row_s * n + L * (c.gen_token_s + c.gen_token_row_s * n)) / self.gen_speed
        return compute + c.gen_row_overhead_s * n

    def handoff(self) -> float:
        """Reward scoring on each generator rank's workers, then the batch over MPI to the trainer nodes."""
        c, lay = self.p.costs, self.layout
        per_gen_node = self.sample_bytes * self.per_gen_rank * lay.gen_tasks_per_node
        per_train_node = self.sample_bytes * self.samples / max(1, min(lay.trainer_nodes, self.train_active))
        wire = max(per_gen_node, per_train_node) / (c.mpi_gb_per_s * 1e9) + c.mpi_alpha_s
        ring = per_gen_node / (c.ring_gb_per_s * 1e9)
        return c.reward_s_per_sample * self.per_gen_rank + ring + wire

    def train(self) -> float:
        c = self.p.costs
        tokens = self.tokens_per_sample * self.samples / self.train_active
        compute = (c.train_fixed_s + c.train_token_s * tokens) / self.train_speed
        return compute + self.allreduce() + c.log_s_per_sample * self.samples + c.step_overhead_s

    def allreduce(self) -> float:
        """Data-parallel gradient all-reduce (ring algorithm): 2 (p-1)/p of the gradient bytes per link."""
        p = self.train_active
        if p <= 1:
            return 0.0
        c = self.p.costs
        grad = self.p.workload.weight_bytes
        return 2 * (p - 1) / p * grad / (c.mpi_gb_per_s * 1e9) + 2 * math.ceil(math.log2(p)) * c.mpi_alpha_s

    def sync(self) -> float:
        """The chunked weight broadcast: every chunk passes the binomial tree's log2(p) stages."""
        c, w = self.p.costs, self.p.workload
        chunks = max(1, math.ceil(w.weight_bytes / w.weight_chunk_bytes))
        stages = bcast_stages(self.layout.gen_ranks + 1)
        return stages * (chunks * c.bcast_alpha_s + w.weight_bytes / (c.bcast_gb_per_s * 1e9))

    def checkpoint(self) -> float:
        c, w = self.p.costs, self.p.workload
        writers = self.layout.train_ranks if self.shape.checkpoint_writers_per_rank else 1
        per_writer = c.fs_write_gb_per_s * 1e9
        if c.fs_aggregate_gb_per_s > 0:
            per_writer = min(per_writer, c.fs_aggregate_gb_per_s * 1e9 / writers)
        return w.checkpoint_bytes / writers / per_writer

    def restart(self) -> float:
        """A rank's start-up plus reading the checkpoint back."""
        c, w = self.p.costs, self.p.workload
        return c.startup_s + w.checkpoint_bytes / (c.fs_read_gb_per_s * 1e9)


def _interpolate(threads: int, measured: int, cores: int, speedup_all: float) -> float:
    """Speed at `threads` relative to `measured` threads, linear between (measured, 1) and (cores, speedup_all)."""
    if cores <= measured:
        return 1.0
    frac = (min(threads, cores) - measured) / (cores - measured)
    return max(0.1, 1.0 + frac * (speedup_all - 1.0))


def simulate(profile: Profile, layout: Layout, shape: RunShape, seed: int = 0) -> Prediction:
    rng = np.random.default_rng(seed)
    costs = StepCosts(profile, layout, shape, rng)
    k = layout.max_staleness
    env = simpy.Environment()
    # Steps in flight between generation and training: the staleness bound, and the rings' and MPI's bytes.
    step_bytes = costs.sample_bytes * costs.samples
    by_bytes = max(1, int((shape.ring_bytes * max(1, layout.trainer_nodes) + shape.max_inflight_bytes) // step_bytes))
    scored: simpy.Store = simpy.Store(env, capacity=SCORE_QUEUE_STEPS)
    exchange: simpy.Store = simpy.Store(env, capacity=max(1, min(k + 1, by_bytes)))
    state = {"version": 0, "published": env.event()}
    busy = {"gen": 0.0, "train": 0.0}
    parts = {"gen": 0.0, "handoff": 0.0, "train": 0.0, "sync": 0.0, "checkpoint": 0.0}
    stale: list[int] = []
    colocated = layout.placement == "colocated"

    def generators():
        for s in range(shape.steps):
            while state["version"] < s - k:
                yield state["published"]
            version = state["version"]
            t = costs.gen()
            busy["gen"] += t
            parts["gen"] += t
            yield env.timeout(t)
            yield scored.put((s, version))

    def reward_sender():
        for _ in range(shape.steps):
            s, version = yield scored.get()
            t = costs.handoff()
            parts["handoff"] += t
            yield env.timeout(t)
            yield exchange.put((s, version))

    def trainers():
        for s in range(shape.steps):
            _, version = yield exchange.get()
            stale.append(s - version)
            t = costs.train()
            sync = costs.sync()
            busy["train"] += t
            parts["train"] += t
            parts["sync"] += sync
            yield env.timeout(t + sync)
            state["version"] = s + 1
            done, state["published"] = state["published"], env.event()
            done.succeed()
            if shape.checkpoint_every and (s + 1) % shape.checkpoint_every == 0 and s + 1 < shape.steps:
                t = costs.checkpoint()
                parts["checkpoint"] += t
                yield env.timeout(t)

    env.process(generators())
    env.process(reward_sender())
    finished = env.process(trainers())
    env.run(until=finished)
    wall = max(env.now, 1e-12)
    n = shape.steps
    step_s = wall / n
    samples_per_s = costs.samples / step_s
    ckpt = costs.checkpoint()
    interruptions, lost = _interruptions(shape, layout, costs, step_s, wall, ckpt)
    effective_wall = wall + interruptions * lost
    inflight_steps = (k + 1) if not colocated else 1
    return Prediction(
        layout=layout,
        step_s=step_s,
        samples_per_s=samples_per_s,
        tokens_per_s=samples_per_s * costs.tokens_per_sample,
        effective_samples_per_s=costs.samples * n / effective_wall,
        gen_idle=max(0.0, 1.0 - busy["gen"] / wall),
        train_idle=max(0.0, 1.0 - busy["train"] / wall),
        staleness=float(np.mean(stale)) if stale else 0.0,
        gen_s=parts["gen"] / n,
        handoff_s=parts["handoff"] / n,
        train_s=parts["train"] / n,
        sync_s=parts["sync"] / n,
        checkpoint_s=ckpt,
        ring_bytes_needed=int(costs.sample_bytes * costs.per_gen_rank * layout.gen_tasks_per_node * inflight_steps),
        inflight_bytes_needed=int(step_bytes * inflight_steps),
        interruptions=interruptions,
        lost_s_per_interruption=lost,
    )


def _interruptions(shape: RunShape, layout: Layout, costs: StepCosts, step_s, wall, ckpt) -> tuple[float, float]:
    """Expected interruptions of the run and the mean wall time each costs.

    An allocation's end is signalled (slurm.signal_lead_seconds): the ranks checkpoint at once and the job is
    requeued: it loses the step in progress (half a step on average), the checkpoint, the queue wait and a
    restart. A node failure gives no warning: it loses the work since the last checkpoint (half an interval on
    average) plus the queue wait and a restart."""
    restart = costs.restart() + shape.requeue_wait_s
    usable = max(step_s, shape.time_limit_s - costs.p.costs.startup_s - shape.signal_lead_s)
    ends = max(0.0, math.ceil(wall / usable) - 1) if shape.time_limit_s > 0 else 0.0
    interval = (shape.checkpoint_every or shape.steps) * step_s
    failures = wall * layout.nodes / (shape.node_mtbf_h * 3600.0)
    per_end = step_s / 2 + ckpt + restart
    per_failure = min(interval, wall) / 2 + restart
    total = ends + failures
    if total <= 0:
        return 0.0, 0.0
    return total, (ends * per_end + failures * per_failure) / total
