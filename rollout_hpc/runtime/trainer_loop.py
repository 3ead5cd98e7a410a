"""The trainer ranks' side of the RL loop.

Per step s: receive the step's P x group_size records (each trainer rank takes
its share from the exchange, then the group allgathers so every rank sees the
whole step), sort them by uid, enforce max_staleness, compute advantages on
the whole batch, train each rank on its slice of prompt groups (gradients are
averaged by the backend), publish weights version s+1, log, and checkpoint at
the step boundary when due or when a signal asked for it.
"""

from __future__ import annotations

import copy
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from rollout_hpc import algos
from rollout_hpc.backends.trainer import make_trainer, score_tokens
from rollout_hpc.envs import load_task
from rollout_hpc.rundir_layout import data_dir
from rollout_hpc.runtime import checkpointing, objective, records, sft, step_plan, watchdog
from rollout_hpc.runtime.critic import Critic, PolicyAndCritic
from rollout_hpc.runtime.evaluation import EvalReceiver, eval_points
from rollout_hpc.runtime.metrics import MetricsSink, batch_metrics
from rollout_hpc.runtime.model_rewards import ModelRewardNorm
from rollout_hpc.runtime.rollout_scheduler import PromptSampler
from rollout_hpc.runtime.step_plan import StepPlan, informative_groups
from rollout_hpc.runtime.trackers import attach_trackers
from rollout_hpc.runtime.world import abort_world, sleeping_barrier
from rollout_hpc.trajectory import TrajectoryBatch


class StepReceiver:
    """Collects exactly one step's records on every trainer rank.

    Records of a step can arrive at any trainer rank of any node (the exchange
    balances batches over trainer nodes, and ranks of a node share its ring),
    and records of later steps can arrive early (max_staleness > 0, or one
    generator running ahead of another). So each rank takes what it has, the
    group allgathers it into a pool that is identical on every rank, and a step
    is handed out once the pool holds all its prompts; later records wait there.
    Which prompts a step has is its StepPlan: with dynamic sampling, the rounds
    are replayed here from the rewards, exactly as the generators decided them.
    """

    # With several trainer ranks each takes what has arrived, waiting at most poll_s, then the group allgathers: a
    # rank's wait ends as soon as records arrive, so poll_s only bounds how long an empty-handed rank holds the others.
    def __init__(self, exchange, world, cfg, poll_s: float = 0.002, sampler: PromptSampler | None = None):
        self.exchange, self.world, self.cfg = exchange, world, cfg
        self.G = cfg.algorithm.group_size
        self.poll_s = poll_s
        self.pool = TrajectoryBatch.empty()
        self.sampler = sampler  # generator.extra_prompts: which prompts each generator rank may send (on-policy)
        self.dynamic = step_plan.uses_dynamic_sampling(cfg)

    def _in(self, prompts) -> np.ndarray:
        return step_plan.in_prompts(self.pool.fixed["prompt_id"], prompts)

    def _wait_for(
        self, step: int, prompts, need: int | None = None, complete: Callable[[], bool] | None = None
    ) -> None:
        """Until the pool holds `need` records (default: whole groups of all of `prompts`) of `prompts`, or with
        `complete` until it says so (the count is not known: whole batches are taken as they come)."""
        if complete is not None:
            need = 1 << 40
        need = len(prompts) * self.G if need is None else need
        while (have := int(self._in(prompts).sum())) < need and not (complete is not None and complete()):
            # In slices: a stop signal or another rank's hang report ends the wait (watchdog.Interrupted), on
            # every trainer rank at the same round (the group agrees in the allgather).
            why = watchdog.interruption()
            if self.world.group_size == 1:
                if why is not None:
                    raise why
                try:
                    if complete is None:
                        new = [self.exchange.get(need - have, timeout=watchdog.WAIT_SLICE_S)]
                    else:
                        new = [self.exchange.get_available(need, timeout=watchdog.WAIT_SLICE_S)]
                except TimeoutError:  # what arrived stays in the exchange for the next call
                    new = []
            else:
                mine = self.exchange.get_available(need, timeout=self.poll_s)
                sleeping_barrier(self.world.group_comm)  # a rank done early sleeps instead of spinning
                got = self.world.group_comm.allgather((why and (why.kind, str(why)), bytes(mine.pack())))
                new = [TrajectoryBatch.unpack(b) for _, b in got]
                reasons = sorted(r for r, _ in got if r)  # "hang" before "stop": every rank raises the same
                if reasons:
                    self.pool = TrajectoryBatch.concat([self.pool, *new])
                    raise watchdog.Interrupted(*reasons[0])
            watchdog.waiting()
            if not sum(len(b) for b in new) and self.exchange.ended:
                wanted = "" if complete is not None else f" of the {need}"
                raise records.StalenessError(
                    f"step {step}: the generators ended the stream with {have}{wanted} records of prompts "
                    f"{step_plan.describe(prompts)} sent"
                )
            self.pool = TrajectoryBatch.concat([self.pool, *new])

    def _get_scheduled(self, step: int) -> tuple[TrajectoryBatch, ScheduledStep]:
        """generator.extra_prompts: the step is whatever groups the generators chose among their candidates
        (on-policy, so every record that arrives now is this step's); the sampler checks the choice and moves on."""
        assert self.sampler is not None
        s = self.sampler
        mine = [np.concatenate(s.candidates(r)) for r in range(s.n_ranks)]
        candidates = np.sort(np.concatenate(mine))
        if self.dynamic:  # a rank's share is its informative groups and those dropped before them: count them
            self._wait_for(
                step, candidates, complete=lambda: all(self._share_complete(r, mine[r]) for r in range(s.n_ranks))
            )
        else:
            self._wait_for(step, candidates, need=sum(s.quotas) * self.G)
        rows = self._in(candidates)
        batch, self.pool = self.pool.select(rows), self.pool.select(~rows)
        f = batch.fixed
        by_rank = {r: batch.select(f["gen_rank"] == r) for r in range(s.n_ranks)}  # generators: world ranks [0, R)
        trained = {r: b.fixed["prompt_id"] for r, b in by_rank.items()}
        informative = {r: self._informative(b) for r, b in by_rank.items()} if self.dynamic else None
        retried = sum(len(r) for r in s.retries)
        deferred = s.advance(trained, informative)
        return batch, ScheduledStep(np.unique(f["prompt_id"].astype(np.int64)), retried, deferred)

    def _whole_groups(self, batch: TrajectoryBatch) -> TrajectoryBatch:
        ids, counts = np.unique(batch.fixed["prompt_id"], return_counts=True)
        return batch.select(np.isin(batch.fixed["prompt_id"], ids[counts == self.G]))

    def _informative(self, batch: TrajectoryBatch):
        """Informative groups among the whole groups of `batch` (dynamic sampling's test): a count, or one per source
        of a mixed dataset."""
        return informative_groups(self.cfg, self._whole_groups(batch))

    def _share_complete(self, rank: int, candidates: np.ndarray) -> bool:
        """Whether the pool holds all that generator rank `rank` sends at this step (generator.extra_prompts with
        dynamic sampling): PromptSampler.share_complete of the whole groups held."""
        assert self.sampler is not None
        got = self._whole_groups(self.pool.select(self._in(candidates) & (self.pool.fixed["gen_rank"] == rank)))
        held = np.unique(got.fixed["prompt_id"]).astype(np.int64)
        return self.sampler.share_complete(rank, held, informative_groups(self.cfg, got))

    def get(self, step: int) -> tuple[TrajectoryBatch, StepPlan | ScheduledStep]:
        if self.sampler is not None:
            return self._get_scheduled(step)
        plan = StepPlan.for_step(self.cfg, step)
        while True:
            self._wait_for(step, plan.round)
            if plan.done or not plan.advance(informative_groups(self.cfg, self.pool.select(self._in(plan.round)))):
                break
        rows = self._in(plan.prompts)
        batch, self.pool = self.pool.select(rows), self.pool.select(~rows)
        return batch, plan


@dataclass
class ScheduledStep:
    """What a step trained on with generator.extra_prompts (the StepPlan of the other runs)."""

    prompts: np.ndarray
    retried: int  # prompts deferred by the step before, trained now
    deferred: int  # prompts this step aborted, retried at the next
    rounds: int = 1
    max_rounds: int = 1


class Reference:
    """The frozen initial policy, for KL to reference (only built when algorithm.kl_coef > 0)."""

    def __init__(self, model: torch.nn.Module, device: torch.device, cfg):
        self.model = model.to(device).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.cfg = cfg

    def logprobs(self, input_ids, attention_mask, response_mask=None) -> torch.Tensor:
        # micro-batched and chunked like the trainer (backends/trainer.py), response tokens only
        return score_tokens(self.model, input_ids, attention_mask, self.cfg, response_mask)


def _checkpoint(ckpt, sink, checkpointed, steps_done: int, total: int) -> bool:
    """Checkpoint after `steps_done` steps when due (collective); True when a stop signal asks the run to end here."""
    if not ckpt.due(steps_done):
        return False
    if sink is not None:  # the log must hold every step the checkpoint covers: a resume continues after it
        sink.log.flush()
    ckpt.save(checkpointed, steps_done)
    return ckpt.stop_requested and steps_done < total


def _stop_waiting(ckpt, sink, checkpointed, steps_done: int, why: watchdog.Interrupted, world) -> int:
    """The trainers gave up waiting for a step's experience (a stop signal, or a hang on another rank): checkpoint the
    `steps_done` steps trained (unless that checkpoint exists) and stop. Collective over the trainer group."""
    have = [c.step for c in ckpt.store.list_checkpoints(ckpt.run_dir)] if world.group_rank == 0 else []
    if not world.group_comm.bcast(steps_done in have, root=0):
        if sink is not None:  # the log must hold every step the checkpoint covers
            sink.log.flush()
        ckpt.stop_requested = why.stop  # its "saved ...; a resume continues from there" line
        ckpt.save(checkpointed, steps_done)
    elif why.stop and world.group_rank == 0:
        print(
            f"rollout-hpc: stop requested: the checkpoint after step {steps_done} is saved; a resume continues from there",
            file=sys.stderr,
        )
    if not why.stop:  # a hang: nothing more can be done here
        # Every trainer's stacks are on disk before any of them ends the job: a rank may have heard of the hang from
        # a peer (the allgather) before its own watchdog thread answered the report, and MPI_Abort would cut it off.
        watchdog.record_stacks(f"the trainers end the job after a hang: {why}")
        world.group_comm.Barrier()
        if world.group_rank == 0:
            print(
                f"rollout-hpc: saved the checkpoint after step {steps_done} before ending the hung job", file=sys.stderr
            )
        abort_world(f"hang: {why}; ending the job", watchdog.EXIT_HANG)
    return checkpointing.EXIT_PREEMPTED


class SFTPhase:
    """The warm-up's steps on the trainer ranks (runtime/sft.py): each rank trains its share of the step's pairs."""

    def __init__(self, cfg, world, trainer, tokenizer, run_dir: Path, sink):
        self.task = load_task(cfg.task, data_dir=data_dir(run_dir))
        self.cfg, self.world, self.trainer, self.tokenizer, self.sink = cfg, world, trainer, tokenizer, sink
        self.stream = sft.sft_stream(self.task, cfg.run.seed)
        self.loss_fn = sft.make_sft_loss_fn(cfg)
        self.eval_points = set(eval_points(cfg)) if cfg.eval else set()
        self.publish_at = {cfg.warmup.sft_steps} | self.eval_points

    def step(self, step: int) -> None:
        t0 = time.perf_counter()
        batch = sft.sft_batch(self.cfg, self.task, self.tokenizer, self.stream, step)
        tensors = records.collate(batch, self.tokenizer.pad_id)
        rows = sft.my_rows(len(batch), self.world.group_rank, self.world.group_size)
        mine = records.select_rows(tensors, rows) if len(rows) else records.empty_like(tensors)
        with self.trainer.fixed_lr(self.cfg.warmup.lr or self.cfg.algorithm.lr):
            stats = self.trainer.train_step(mine, self.loss_fn, agg=self.cfg.algorithm.loss_agg)
        if self.sink is not None:
            period = time.perf_counter() - t0
            f = batch.fixed
            stats.update(
                samples=float(len(batch)),
                response_len_mean=float(f["response_len"].mean()),
                train_time=period,
                step_time=period,
                policy_version=float(step + 1),
                tokens_per_s=float(f["response_len"].sum() + f["prompt_len"].sum()) / max(period, 1e-9),
            )
            self.sink.write_metrics(step, self.cfg.total_steps, stats, label="sft step")


def build_learner(cfg, model: torch.nn.Module, world):
    """What learn() needs: (backend trainer, frozen reference policy or None, critic or None, loss function).
    Collective over the trainer group (the backend's set-up)."""
    spec = algos.get_algorithm(cfg.algorithm.name)
    initial = copy.deepcopy(model) if cfg.algorithm.kl_coef > 0 else None  # before a backend shards or moves it
    critic = Critic(cfg, model, world) if spec.needs_critic else None  # from the initial policy, like `initial`
    trainer = make_trainer(cfg, model, world)
    reference = Reference(initial, trainer.device, cfg) if initial is not None else None
    return trainer, reference, critic, objective.make_loss_fn(cfg)


def learn(cfg, world, trainer, reference, critic, loss_fn, batch: TrajectoryBatch) -> tuple[dict, dict]:
    """One step's update from its complete batch (sorted by uid): advantages over the whole batch, then this rank's
    share of the trainable groups. Collective over the trainer group. Returns (advantage stats, update stats)."""
    a = cfg.algorithm
    tensors = records.collate(batch)
    ref_lp = reference.logprobs(tensors["input_ids"], tensors["attention_mask"], tensors["mask"]) if reference else None
    values = critic.values(tensors["input_ids"], tensors["attention_mask"]) if critic else None
    turns = records.turn_table(batch, a.gamma) if a.step_advantage_weight else None
    adv_stats = objective.add_advantages(cfg, tensors, ref_lp, values, turns)
    groups = records.trainable_groups(tensors["mask"], a.group_size)
    if not len(groups):  # every group of every round had equal rewards: the policy stays as it is
        return adv_stats, {}
    rows = records.shard_groups(groups, a.group_size, world.group_rank, world.group_size)
    # Fewer groups than trainer ranks: a rank without any still joins the step's collectives.
    mine = records.select_rows(tensors, rows) if len(rows) else records.empty_like(tensors)
    return adv_stats, objective.train_updates(cfg, trainer, critic, mine, loss_fn)


def run_trainer(
    world,
    cfg,
    run_dir: Path,
    model: torch.nn.Module,
    exchange,
    weights,
    quiet: bool = False,
    eval_comm=None,
    tokenizer=None,
    rates=None,
) -> int:
    a = cfg.algorithm
    trainer, reference, critic, loss_fn = build_learner(cfg, model, world)
    reward_norm = ModelRewardNorm(cfg) if cfg.rewards.models else None  # its statistics are checkpointed
    extras: dict = {ModelRewardNorm.CHECKPOINT_KEY: reward_norm} if reward_norm else {}
    # generator.extra_prompts: which prompts were deferred is run state (checkpointed, sent with the weights)
    sampler = PromptSampler.for_config(cfg) if cfg.generator.extra_prompts else None
    if sampler is not None:
        extras[PromptSampler.CHECKPOINT_KEY] = sampler
    meta = (lambda: {"sampler": sampler.meta()}) if sampler is not None else (lambda: None)
    ckpt = checkpointing.Checkpointer(world, cfg, run_dir, extras=extras)
    checkpointed = PolicyAndCritic(trainer, critic) if critic else trainer
    start = ckpt.resume(checkpointed)  # 0 for a fresh run
    is_logger = world.group_rank == 0
    sink = MetricsSink(run_dir, cfg, steps_done=start, quiet=quiet) if is_logger else None
    if sink is not None:  # logging.trackers (TensorBoard, W&B, MLflow) follow the log's rows
        attach_trackers(sink.log, cfg, run_dir, start)
    receiver = StepReceiver(exchange, world, cfg, sampler=sampler)
    evals = EvalReceiver(eval_comm, source=0, quiet=quiet) if is_logger and eval_comm is not None else None
    sync = weights.publish(start, trainer.full_weights(), meta=meta())  # generators start from exactly these weights
    warmup, total = cfg.warmup.sft_steps, cfg.total_steps
    warm = SFTPhase(cfg, world, trainer, tokenizer, run_dir, sink) if start < warmup else None
    exit_code = 0
    watchdog.beat(start)  # start-up is over: from here a rank that stops making progress is hung
    try:
        if warm and evals and start in warm.eval_points:
            assert sink is not None  # evals and sink: both the logger's
            evals.wait_for(sink.log, start)
        t_prev = time.perf_counter()
        for step in range(start, total):
            t0 = time.perf_counter()
            if step < warmup:
                assert warm is not None  # made whenever the run starts inside the warm-up
                warm.step(step)
                if step + 1 in warm.publish_at:  # the generators wait for these: an eval point, the start of RL
                    weights.publish(step + 1, trainer.full_weights(), meta=meta())
                # The generators are idle during warm-up: an eval point is evaluated on exactly its weights while
                # the trainers wait (the other ranks wait in the next step's collectives), never left in flight.
                if evals and step + 1 in warm.eval_points:
                    assert sink is not None  # evals and sink: both the logger's
                    evals.wait_for(sink.log, step + 1)
                t_prev = time.perf_counter()
                if _checkpoint(ckpt, sink, checkpointed, step + 1, total):
                    exit_code = checkpointing.EXIT_PREEMPTED
                    break
                watchdog.beat(step + 1)
                continue
            try:
                batch, plan = receiver.get(step - warmup)  # RL steps count their prompts from 0
            except watchdog.Interrupted as why:
                exit_code = _stop_waiting(ckpt, sink, checkpointed, step, why, world)
                break
            t_got, t_got_wall = time.perf_counter(), time.time()
            batch = records.sort_by_uid(batch, a.group_size)
            records.check_complete(batch, step, plan.prompts, a.group_size)
            records.check_staleness(batch, step, cfg.exchange.max_staleness)

            stats = {"generation_rounds": float(plan.rounds)} if plan.max_rounds > 1 else {}
            if isinstance(plan, ScheduledStep):
                stats.update(retried_prompts=float(plan.retried), deferred_prompts=float(plan.deferred))
            if reward_norm is not None:  # rule + normalized model scores (every trainer rank: the same batch)
                stats.update(reward_norm.apply(batch))
            adv_stats, update_stats = learn(cfg, world, trainer, reference, critic, loss_fn, batch)
            stats.update(update_stats)
            t_trained = time.perf_counter()

            sync = weights.publish(step + 1, trainer.full_weights(), meta=meta())
            t_synced = time.perf_counter()

            if is_logger:
                assert sink is not None  # the logger's
                m = batch_metrics(batch, step)
                m.update(adv_stats)
                m.update(stats)
                if rates is not None:  # runtime.scoring_rate: the reward models' samples per second of scoring
                    m.update(rates.take())
                period = t_synced - t_prev  # the whole loop iteration, logging and checkpointing of the last included
                m.update(
                    idle_time=t_got - t0,  # waiting for the step's experience
                    # last record scored -> step complete on the trainer (reward sender, exchange, pooling)
                    handoff_time=max(0.0, t_got_wall - float(batch.fixed["t_end"].max())),
                    train_time=t_trained - t_got,
                    sync_time=t_synced - t_trained,
                    step_time=period,
                    tokens_per_s=m["tokens"] / max(period, 1e-9),
                    samples_per_s=len(batch) / max(period, 1e-9),
                    sync_bytes=float(sync.get("bytes", 0)),
                    policy_version=float(step + 1),
                )
                sink.write(step, total, batch, m)
                if evals:
                    evals.poll(sink.log)
            t_prev = t_synced
            if _checkpoint(ckpt, sink, checkpointed, step + 1, total):
                exit_code = checkpointing.EXIT_PREEMPTED
                break
            watchdog.beat(step + 1)
        if evals and exit_code == 0:  # the final eval runs on the last step's weights, published above
            assert sink is not None  # evals and sink: both the logger's
            evals.wait_for(sink.log, total, lambda: checkpointing.stop_signalled())
    finally:
        if sink is not None:
            sink.close()
        if critic:
            critic.close()
        trainer.close()
    return exit_code
