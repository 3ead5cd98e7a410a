"""run.program 'profile': measure, with the config's model, task and backends, what `rollout-hpc plan` predicts from.

`rollout-hpc profile CONFIG --out PROFILE.json` runs this on one generator node and one trainer node of the
config's shape and copies RUN_DIR/profile.json out. Compute is measured one group at a time (the other group waits
at a barrier), so a cost is that of the group alone; the simulation adds contention for the layout it predicts.
Each phase prints a progress line. What is measured, and the cost model each fit belongs to: docs/scale.md.

  generation    generator group rank 0: the task's prompts at the current policy (the response-length distribution),
                then forced lengths L and batch sizes n: t = a + L (b + c n); once more with all the node's cores
  rewards       the same responses scored by the config's reward workers
  training      every trainer rank on the same number of its share's groups (what trainer_loop does), for 1/4,
                1/2 and all of its share: t = a + b tokens; once more with all the node's cores
  log           trainer group rank 0 appends steps to a trajectory log (the HDF5 writes of a step)
  checkpoint    the trainer group saves and loads a real checkpoint of its state (write and read bandwidth)
  MPI, ring     generator rank 0 <-> trainer rank 0 ping-pong; a node ring's push + pop
  broadcast     the weight sync's publish of the real weights, and chunked Bcasts over 2..all ranks
"""

from __future__ import annotations

import os
import platform
import socket
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch

from rollout_hpc.backends.generate_hf import SamplingParams, derive_seed
from rollout_hpc.envs import load_task
from rollout_hpc.envs.base import dataset_item, is_multi_turn
from rollout_hpc.errors import UserError
from rollout_hpc.exchange.forward import Exchange
from rollout_hpc.exchange.ring import Ring, ring_path
from rollout_hpc.exchange.weights import SyncClosed, WeightSync
from rollout_hpc.rundir_layout import data_dir
from rollout_hpc.runtime import checkpointing, records
from rollout_hpc.runtime.critic import PolicyAndCritic
from rollout_hpc.runtime.generator_loop import generate_unscored, make_generator, reward_pool
from rollout_hpc.runtime.metrics import MetricsSink, batch_metrics
from rollout_hpc.runtime.train_program import build_policy, cpu_threads, seed_everything
from rollout_hpc.runtime.trainer_loop import build_learner, learn
from rollout_hpc.runtime.world import sleeping_barrier
from rollout_hpc.scale.profile import PROFILE_FILE, Costs, Machine, Profile, Workload, bcast_stages, fit_linear
from rollout_hpc.store.checkpoint import library_versions
from rollout_hpc.trajectory import TrajectoryBatch

REPEATS = 3  # timed repeats per point (after one untimed warm-up); the median is kept


def say(world, text: str) -> None:
    if world.rank == 0:
        print(f"rollout-hpc profile: {text}", file=sys.stderr, flush=True)


def timed(fn, repeats: int = REPEATS) -> float:
    fn()  # warm-up: allocations, caches, lazy initialisation
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def process_age_s() -> float:
    """Seconds since this process started (its start-up cost once the model and the world are built)."""
    ticks = os.sysconf("SC_CLK_TCK")
    start = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19]) / ticks
    return float(Path("/proc/uptime").read_text().split()[0]) - start


def node_cores() -> int:
    return int(os.environ.get("SLURM_CPUS_ON_NODE", 0)) or len(os.sched_getaffinity(0))


def main(world, cfg, run_dir: Path) -> int:
    checkpointing.install_stop_handlers()
    threads = cpu_threads(cfg, world)
    torch.set_num_threads(threads)
    seed_everything(cfg, world)
    model, tokenizer = build_policy(cfg)
    # The exchange runs as in a real job (its forwarder and receiver threads poll MPI): the weight broadcast is
    # measured beside them, since a step's sync shares the MPI library with them.
    exchange = Exchange(world, cfg)
    weights = WeightSync(world, cfg, poll_interval=0.0005 if cfg.exchange.max_staleness else 0.02)
    startup = world.comm.allreduce(process_age_s(), op=_max())
    comm = world.comm
    trainer0 = next(r.rank for r in world.ranks if r.role == "trainer")
    out: dict = {"startup_s": startup}

    # Generation (generator group rank 0 alone), then its batch goes to the trainers for everything after.
    say(world, "generation: response lengths at the current policy, then batch sizes x lengths")
    gen_part = _generation(world, cfg, model, tokenizer, run_dir, threads) if world.rank == 0 else None
    sleeping_barrier(comm)
    batch_bytes = comm.bcast(gen_part.pop("batch") if gen_part else None, root=0)
    batch = TrajectoryBatch.unpack(batch_bytes)

    say(world, "training: the trainer ranks on 1/4, 1/2 and all of a rank's share")
    train_part = _training(world, cfg, model, batch, run_dir, threads) if world.is_trainer else None
    sleeping_barrier(comm)

    say(world, "links: MPI ping-pong, the node ring, the weight broadcast")
    link_part = _links(world, cfg, trainer0)
    sync_part = _weight_sync(world, weights, model)
    ring_part = _ring(world, cfg, batch_bytes) if world.rank == 0 else None
    sleeping_barrier(comm)

    parts = comm.gather((gen_part, train_part, ring_part, socket.gethostname(), world.node_name), root=0)
    if world.rank == 0:
        gen = next(p[0] for p in parts if p[0])
        train = next(p[1] for p in parts if p[1])
        ring = next(p[2] for p in parts if p[2])
        profile = _assemble(world, cfg, out, gen, train, ring, link_part, sync_part, batch, parts)
        profile.save(run_dir / PROFILE_FILE)
        say(world, f"wrote {run_dir / PROFILE_FILE}")
    if world.is_generator:  # as in train_program: take part in broadcasts until the trainers close the stream
        try:
            while True:
                weights.receive(1 << 62)
        except SyncClosed:
            pass
    weights.close()
    exchange.close()
    return 0


def _max():
    from mpi4py import MPI

    return MPI.MAX


def _generation(world, cfg, model, tokenizer, run_dir: Path, threads: int) -> dict:
    task = load_task(cfg.task, data_dir=data_dir(run_dir))
    if is_multi_turn(task):
        raise UserError(
            f"rollout-hpc profile measures single-turn generation; task {cfg.task.name!r} is multi-turn (episodes): "
            "profile a single-turn task with the same model and backends (e.g. --set task.name=arithmetic)"
        )
    dataset = task.prompts(cfg.run.seed)
    gen = make_generator(cfg, model, tokenizer, task)
    a = cfg.algorithm
    share = max(1, -(-a.prompts_per_step // cfg.generator.ranks))  # prompts of one rank's step share
    prompts = np.arange(min(a.prompts_per_step, max(share, 8)))
    batch, keys, texts = generate_unscored(gen, dataset, prompts, a.group_size, 0, 0)
    lengths = [int(x) for x in batch.fixed["response_len"]]
    pool = reward_pool(cfg, task, run_dir)
    try:
        pool.score(list(zip(keys, texts))[: a.group_size])  # warm-up: worker start-up is not per-sample cost
        t0 = time.perf_counter()
        results = pool.score(list(zip(keys, texts)))
        reward_s = (time.perf_counter() - t0) / max(1, len(keys))
    finally:
        pool.close()
    batch.fixed["reward"] = [r.value for r in results]
    # Forced lengths (no stop tokens): t = a + L * (b + c * n)
    tokens = [gen.encode_prompt(dataset_item(dataset, int(i))) for i in prompts]
    max_len = a.max_new_tokens
    rows_per_rank = share * a.group_size
    sizes = sorted({1, max(1, rows_per_rank // 4), max(1, rows_per_rank // 2), rows_per_rank})
    lens = sorted({max(1, max_len // 4), max(1, max_len // 2), max_len})
    points = []
    for n in sizes:
        for L in lens:
            params = SamplingParams(max_new_tokens=L, temperature=a.temperature, top_p=a.top_p)
            batch_prompts = [tokens[i % len(tokens)] for i in range(n)]
            seeds = [derive_seed(cfg.run.seed, i, 0) for i in range(n)]
            points.append((n, L, timed(partial(gen.generate, batch_prompts, seeds, params))))
    fixed, per_row, per_token, per_token_row = fit_linear(
        [[n, L, L * n] for n, L, _ in points], [t for *_, t in points]
    )
    speedup = _all_cores_speedup(
        threads,
        lambda: gen.generate(
            [tokens[i % len(tokens)] for i in range(rows_per_rank)],
            [derive_seed(cfg.run.seed, i, 0) for i in range(rows_per_rank)],
            SamplingParams(max_new_tokens=max_len, temperature=a.temperature, top_p=a.top_p),
        ),
    )
    return {
        "fit": [fixed, per_row, per_token, per_token_row],
        "points": points,
        "lengths": lengths,
        "prompt_len_mean": float(np.mean(batch.fixed["prompt_len"])),
        "reward_s": reward_s,
        "speedup": speedup,
        "batch": bytes(batch.pack()),
    }


def _all_cores_speedup(threads: int, work, pairs: int = 5) -> float:
    """Speed with every core of the node over speed with `threads` (1.0 when the rank already has them all):
    the median of interleaved pairs, since one busy moment of the machine can slow a many-thread run tenfold."""
    cores = node_cores()
    if cores <= threads:
        return 1.0
    work()
    ratios = []
    for _ in range(pairs):
        base = timed(work, repeats=1)
        torch.set_num_threads(cores)
        try:
            ratios.append(base / max(timed(work, repeats=1), 1e-9))
        finally:
            torch.set_num_threads(threads)
    return statistics.median(ratios)


def _training(world, cfg, model, batch: TrajectoryBatch, run_dir: Path, threads: int) -> dict:
    """Every trainer rank trains the same number of groups, like a step's share; rank 0 also logs and checkpoints."""
    a = cfg.algorithm
    trainer, reference, critic, loss_fn = build_learner(cfg, model, world)
    rng = np.random.default_rng(cfg.run.seed)
    batch = batch.select(np.arange(len(batch)))  # a writable copy (unpacked batches view the message)
    batch.fixed["reward"] = rng.random(len(batch))  # distinct rewards: every group is trainable
    batch = records.sort_by_uid(batch, a.group_size)
    groups_in_batch = len(batch) // a.group_size
    share = max(1, -(-a.prompts_per_step // cfg.trainer.ranks))  # groups of one rank's step share
    points = []
    for n_groups in sorted({max(1, share // 4), max(1, share // 2), share}):
        # The batch may be smaller than a share: repeat its groups (a uid-sorted batch of whole groups).
        rows = np.concatenate([np.arange(a.group_size) + (g % groups_in_batch) * a.group_size for g in range(n_groups)])
        part = batch.select(rows)
        part.fixed["prompt_id"] = np.repeat(np.arange(n_groups), a.group_size)
        # learn() shards the groups over the trainer ranks: give it every rank's copy, so each trains n_groups.
        whole = TrajectoryBatch.concat([_renumbered(part, r * n_groups, a.group_size) for r in range(world.group_size)])
        tokens = float(part.fixed["prompt_len"].sum() + part.fixed["response_len"].sum())
        points.append((tokens, timed(partial(learn, cfg, world, trainer, reference, critic, loss_fn, whole))))
    fixed, per_token = fit_linear([[tok] for tok, _ in points], [t for _, t in points])
    full = points[-1]
    speedup = _all_cores_speedup(threads, partial(learn, cfg, world, trainer, reference, critic, loss_fn, whole))
    log_s = _log_cost(world, cfg, run_dir, batch) if world.group_rank == 0 else 0.0
    ckpt = _checkpoint_cost(world, cfg, run_dir, PolicyAndCritic(trainer, critic) if critic else trainer)
    if critic:
        critic.close()
    trainer.close()
    return {
        "fit": [fixed, per_token],
        "points": points,
        "full_share_tokens": full[0],
        "speedup": speedup,
        "log_s": log_s,
        "train_ranks": world.group_size,
        **ckpt,
    }


def _renumbered(batch: TrajectoryBatch, first_prompt: int, group_size: int) -> TrajectoryBatch:
    out = batch.select(np.arange(len(batch)))
    out.fixed["prompt_id"] = first_prompt + np.repeat(np.arange(len(batch) // group_size), group_size)
    return out


def _log_cost(world, cfg, run_dir: Path, batch: TrajectoryBatch) -> float:
    """Seconds per sample of the trainer's step logging (trajectories and metrics into the HDF5 log)."""
    profile_dir = run_dir / "profile-log"
    profile_dir.mkdir(exist_ok=True)
    sink = MetricsSink(profile_dir, cfg, steps_done=0, quiet=True)
    steps = 12  # past MetricsSink.FLUSH_EVERY: its periodic flush is part of the cost
    try:
        t0 = time.perf_counter()
        for s in range(steps):
            sink.write(s, steps, batch, batch_metrics(batch, s))
        elapsed = time.perf_counter() - t0
    finally:
        sink.close()
    return elapsed / (steps * max(1, len(batch)))


def _checkpoint_cost(world, cfg, run_dir: Path, trainer) -> dict:
    """A real checkpoint of the trainer's state, saved and loaded (collective over the trainer group)."""
    ckpt = checkpointing.Checkpointer(world, cfg, run_dir)
    t0 = time.perf_counter()
    ckpt.save(trainer, 1)
    write_s = time.perf_counter() - t0
    size = sum(f.stat().st_size for f in (run_dir / "checkpoints").rglob("*") if f.is_file())
    t0 = time.perf_counter()
    ckpt.resume(trainer)
    read_s = time.perf_counter() - t0
    return {"checkpoint_bytes": size, "checkpoint_write_s": write_s, "checkpoint_read_s": read_s}


def _links(world, cfg, trainer0: int) -> dict:
    """Ping-pong between generator rank 0 and the first trainer rank (different nodes): t = alpha + bytes / bw."""
    comm = world.comm
    points = []

    def pingpong(buf):
        if world.rank == 0:
            comm.Send(buf, dest=trainer0, tag=7)
            comm.Recv(buf, source=trainer0, tag=7)
        elif world.rank == trainer0:
            comm.Recv(buf, source=0, tag=7)
            comm.Send(buf, dest=0, tag=7)

    for nbytes in (1 << 10, 1 << 16, 1 << 20, 1 << 24):
        sleeping_barrier(comm)
        points.append((nbytes, timed(partial(pingpong, np.zeros(nbytes, np.uint8)), repeats=5) / 2))
    alpha, per_byte = fit_linear([[b] for b, _ in points], [t for _, t in points])
    return {"alpha": alpha, "gb_per_s": 1e-9 / max(per_byte, 1e-15), "points": points}


def _weight_sync(world, weights: WeightSync, model) -> dict:
    """The real publish of the model's weights, then chunked Bcasts over 2..all ranks to fit a tree stage."""
    comm = world.comm
    tensors = {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}
    nbytes = sum(a.nbytes for a in tensors.values())
    publish = []
    for version in range(1, 1 + 1 + REPEATS):
        sleeping_barrier(comm)
        t0 = time.perf_counter()
        if world.is_trainer:
            weights.publish(version, tensors if world.group_rank == 0 else None)
        else:
            weights.receive(version)
        publish.append(time.perf_counter() - t0)
    publish_s = comm.allreduce(statistics.median(publish[1:]), op=_max())
    chunk = weights.chunk_bytes
    points = []

    def bcast(sub, member: bool, buf: np.ndarray):
        if member:
            for lo in range(0, buf.nbytes, chunk):
                sub.Bcast(buf[lo : lo + chunk], root=0)

    for size in sorted({2, world.size}):
        sub = comm.Split(0 if world.rank < size else 1, world.rank)
        for total in (1 << 20, 1 << 24):
            sleeping_barrier(comm)
            t = comm.allreduce(timed(partial(bcast, sub, world.rank < size, np.zeros(total, np.uint8))), op=_max())
            points.append((size, total, -(-total // chunk), t))
        sub.Free()
    # t = stages * (chunks * alpha + bytes / bw)
    alpha, per_byte = fit_linear(
        [[bcast_stages(p) * c, bcast_stages(p) * b] for p, b, c, _ in points], [t for *_, t in points]
    )[1:]
    return {
        "publish_s": publish_s,
        "weight_bytes": nbytes,
        "alpha": alpha,
        "gb_per_s": 1e-9 / max(per_byte, 1e-15),
        "points": points,
    }


def _ring(world, cfg, record: bytes) -> dict:
    """One producer's push + pop of trajectory records through a node ring (both ends in this process)."""
    path = ring_path(cfg.exchange.ring_dir, f"{cfg.run.name}-profile", world.job_id, world.node_name, "profile")
    ring = Ring.create(path, max(cfg.exchange.ring_bytes, 4 * len(record) + 4096))
    try:
        n = max(1, min(64, (ring.capacity // 2) // max(1, len(record) + 64)))

        def through():
            for _ in range(n):
                ring.push(record)
            for _ in range(n):
                ring.pop()

        t = timed(through)
    finally:
        ring.unlink()
    return {"gb_per_s": n * len(record) / max(t, 1e-12) / 1e9}


def _assemble(world, cfg, out, gen, train, ring, link, sync, batch: TrajectoryBatch, parts) -> Profile:
    hosts = {p[3] for p in parts}
    nodes = {p[4] for p in parts}
    tokens = batch.fixed["prompt_len"].astype(float) + batch.fixed["response_len"].astype(float)
    rec_fixed, rec_per_token = _record_bytes(batch, tokens)
    train_fixed, train_token = train["fit"]
    costs = Costs(
        gen_fixed_s=gen["fit"][0],
        gen_row_s=gen["fit"][1],
        gen_token_s=gen["fit"][2],
        gen_token_row_s=gen["fit"][3],
        train_fixed_s=train_fixed,
        train_token_s=train_token,
        reward_s_per_sample=gen["reward_s"],
        log_s_per_sample=train["log_s"],
        mpi_alpha_s=link["alpha"],
        mpi_gb_per_s=link["gb_per_s"],
        bcast_alpha_s=sync["alpha"],
        bcast_gb_per_s=sync["gb_per_s"],
        ring_gb_per_s=ring["gb_per_s"],
        fs_write_gb_per_s=train["checkpoint_bytes"] / max(train["checkpoint_write_s"], 1e-9) / 1e9,
        fs_read_gb_per_s=train["checkpoint_bytes"] / max(train["checkpoint_read_s"], 1e-9) / 1e9,
        startup_s=out["startup_s"],
        gen_speedup_all_cores=gen["speedup"],
        train_speedup_all_cores=train["speedup"],
    )
    workload = Workload(
        response_lengths=gen["lengths"],
        prompt_len_mean=gen["prompt_len_mean"],
        max_new_tokens=cfg.algorithm.max_new_tokens,
        record_bytes_per_token=rec_per_token,
        record_fixed_bytes=rec_fixed,
        weight_bytes=sync["weight_bytes"],
        checkpoint_bytes=train["checkpoint_bytes"],
        weight_chunk_bytes=cfg.exchange.weight_chunk_bytes,
    )
    shared = len(hosts) == 1
    machine = Machine(
        hostname=sorted(hosts)[0] if shared else ",".join(sorted(hosts)),
        cores_per_node=len(os.sched_getaffinity(0)) if shared else node_cores(),
        gpus_per_node=torch.cuda.device_count(),
        gen_threads=cpu_threads(cfg, _as_role(world, "generator")),
        train_threads=cpu_threads(cfg, _as_role(world, "trainer")),
        shared_host=shared,
        nodes_measured=len(nodes),
        ranks_measured=world.size,
    )
    versions = {"python": platform.python_version(), **library_versions()}
    return Profile(
        costs=costs,
        workload=workload,
        machine=machine,
        source="measured",
        config_digest=cfg.digest(),
        created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        versions=versions,
        measurements={
            "generation_points": gen["points"],
            "train_points": train["points"],
            "train_ranks": train["train_ranks"],
            "mpi_points": link["points"],
            "bcast_points": sync["points"],
            "publish_s": sync["publish_s"],
            "checkpoint_write_s": train["checkpoint_write_s"],
            "checkpoint_read_s": train["checkpoint_read_s"],
            "startup_s": out["startup_s"],
        },
    )


def _record_bytes(batch: TrajectoryBatch, tokens: np.ndarray) -> tuple[float, float]:
    """Packed bytes of a record: fixed + per token (fitted over the batch's records, one at a time)."""
    sizes = [len(batch.select(np.array([i])).pack()) for i in range(min(len(batch), 32))]
    fixed, per_token = fit_linear([[t] for t in tokens[: len(sizes)]], sizes)
    return fixed, per_token


class _as_role:
    """The thread count a rank of `role` gets (cpu_threads reads only these attributes)."""

    def __init__(self, world, role: str):
        self.role = role
        self.local_size = world.local_size
