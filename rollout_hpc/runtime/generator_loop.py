"""The generator ranks' side of the RL loop.

Per step s: make sure the policy is recent enough (version >= s - max_staleness;
with 0 the generator waits for exactly the weights trained on step s-1), pick
up newer weights if any arrived, sample group_size responses for this rank's
share of the step's prompts, and hand the result to the reward workers, which
score it off the generation path and put the finished batch into the exchange
while the next step is being generated.

Prompts of step s are [s*P, (s+1)*P) (with dynamic sampling, the rounds of
runtime.step_plan), split into contiguous runs across the generator ranks; sample k of prompt i is seeded from (run.seed, i, k) only, so
what is generated does not depend on the number of ranks, on timing, or on a
restart.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from pathlib import Path

from rollout_hpc.backends.episodes import EpisodeSettings
from rollout_hpc.backends.generate_hf import HFGenerator, SamplingParams, derive_seed, trajectory_batch
from rollout_hpc.backends.generate_vllm import VLLMGenerator
from rollout_hpc.envs import load_task
from rollout_hpc.envs.base import dataset_item, is_multi_turn
from rollout_hpc.envs.registry import eval_prompts
from rollout_hpc.envs.scoring import reward_name
from rollout_hpc.errors import RewardFatal
from rollout_hpc.exchange.faults import fault_point
from rollout_hpc.exchange.weights import SyncClosed
from rollout_hpc.rewards import REWARD_ERROR, REWARD_OK, RewardPool
from rollout_hpc.rewards.inline import InlineScorer
from rollout_hpc.rundir_layout import data_dir
from rollout_hpc.runtime import watchdog
from rollout_hpc.runtime.env_group import generator_host
from rollout_hpc.runtime.evaluation import EvalSchedule, Evaluator
from rollout_hpc.runtime.model_rewards import ModelScorer
from rollout_hpc.runtime.rollout_scheduler import PromptSampler, RankShare, scheduled_episodes, scheduled_rollout
from rollout_hpc.runtime.step_plan import (
    Informative,
    StepPlan,
    group_informative,
    informative_groups,
    rank_share,
    stamp_domains,
    uses_dynamic_sampling,
)


class RewardWorkers:
    """Scores generated batches in reward worker processes and puts them into the exchange in order.

    The generator thread submits unscored samples and goes on; a sender thread has each batch scored by
    the pool (rollout_hpc.rewards.RewardPool: separate processes, a timeout per sample) and puts batches
    in submission order, so the trainer's input never depends on thread timing. A sample whose reward
    raised or timed out scores 0 with its reward_status set (logged, counted per step). A reward that
    returns a non-number (NaN, inf, a string), or raises on ERROR_STREAK_FATAL samples in a row, ends the
    whole job at once with a message naming the reward: a broken reward would silently train on garbage.
    """

    ERROR_STREAK_FATAL = 64  # rewards in a row that raised: the reward is broken, not one odd sample

    def __init__(self, exchange, pool, models=None, rate=None) -> None:
        self.exchange, self.pool = exchange, pool
        self.models = models  # runtime.model_rewards.ModelScorer (rewards.models), scored after the rule reward
        self.rate = rate  # runtime.scoring_rate.RateSender: the models' scoring time, for the progress line
        self.error_streak = 0
        self.lock = threading.Lock()  # one caller of the pool at a time (sender thread, eval, refills)
        self.queue: queue.Queue = queue.Queue(maxsize=4)  # bound the work in flight
        self.sender = threading.Thread(target=self._send_loop, name="reward-sender", daemon=True)
        self.sender.start()

    def score(self, jobs: list) -> list:
        """[(key, text)] -> [RewardResult], in order (blocks)."""
        with self.lock:
            results = self.pool.score(jobs)
            for r in results:
                if r.status == REWARD_OK:
                    self.error_streak = 0
                elif r.status == REWARD_ERROR and not r.sample_fault:  # timeouts, sandbox violations: neither
                    self.error_streak += 1
                    if self.error_streak >= self.ERROR_STREAK_FATAL:
                        raise RewardFatal(
                            f"{self.pool.name} raised on the last {self.error_streak} samples in a row (the last: "
                            f"{r.error}); a reward that fails on every sample trains nothing: fix it and resume"
                        )
            return results

    def _scored(self, batch, keys: list, texts: list[str], results: list | None = None):
        if results is None:
            results = self.score(list(zip(keys, texts)))
        batch.fixed["reward"] = [r.value for r in results]
        batch.fixed["reward_status"] = [r.status for r in results]
        if self.models is not None:
            t0 = time.perf_counter()
            batch = self.models.apply(batch, keys, texts)
            if self.rate is not None and self.models.models:  # not when the reward group scores every model
                self.rate.sent(len(batch), time.perf_counter() - t0)
        batch.fixed["t_end"] = time.time()
        return batch

    def submit(self, batch, keys: list, texts: list[str], results: list | None = None) -> None:
        """`batch` rows are (prompt, sample) ordered; keys/texts per row. Rewards fill batch.fixed['reward'] (from
        `results` where the rows were scored already: runtime.rollout_scheduler scores samples as they finish)."""
        self.queue.put((batch, keys, texts, results))

    def score_now(self, batch, keys: list, texts: list[str]):
        """Score and wait (dynamic sampling must see rewards before it decides on a refill)."""
        return self._scored(batch, keys, texts)

    def _send_loop(self) -> None:
        while True:
            job = self.queue.get()
            if job is None:
                return
            fault_point("reward-sender")
            # A failure here ends the whole job (runtime.watchdog's threading.excepthook), not only this thread.
            self.exchange.put(self._scored(*job))

    def close(self) -> None:
        """Wait until everything submitted is scored and in the exchange."""
        self.queue.put(None)
        self.sender.join()
        self.pool.close()
        if self.rate is not None:
            self.rate.close()


def receive_weights(weights, min_version: int):
    """weights.receive(min_version), in slices: waiting for the trainers is not a hang of this rank."""
    while True:
        try:
            return weights.receive(min_version, timeout=watchdog.WAIT_SLICE_S)
        except TimeoutError:
            watchdog.waiting()


def make_generator(cfg, model, tokenizer, task):
    sampling = SamplingParams.from_config(cfg.algorithm, tokenizer)
    gen = _backend(cfg, model, tokenizer, task, sampling)
    gen.episodes = EpisodeSettings.from_config(cfg.task.env)  # how a multi-turn task's episodes are played
    gen.max_tokens_per_turn = cfg.task.env.max_tokens_per_turn
    return gen


def _backend(cfg, model, tokenizer, task, sampling):
    if cfg.generator.backend == "vllm":
        return VLLMGenerator(
            cfg.model,
            tokenizer,
            task,
            sampling,
            cfg.run.seed,
            cfg.generator.tensor_parallel,
            model=model if cfg.model.path is None else None,
        )
    return HFGenerator(model, tokenizer, task, sampling, seed=cfg.run.seed, partial_weights=cfg.model.lora is not None)


def generate_unscored(gen, dataset, prompt_indices, group_size: int, gen_rank: int, version: int):
    """Single-turn sampling without rewards: (batch with reward 0, reward keys, response texts).

    The same rows and seeds as Generator.rollout, which scores inline; here the
    reward workers score it, by key ("train", prompt index)."""

    t_start = time.time()
    # Each prompt is built and tokenized once; its group_size rows share the token list.
    tokens = {int(i): gen.encode_prompt(dataset_item(dataset, int(i))) for i in prompt_indices}
    rows = [(i, s) for i in tokens for s in range(group_size)]
    prompts = [tokens[i] for i, _ in rows]
    out = gen.generate(prompts, [derive_seed(gen.seed, i, s) for i, s in rows])
    batch = trajectory_batch(
        prompts,
        out.response_ids,
        out.logprobs,
        [0.0] * len(rows),
        truncated=out.truncated,
        prompt_index=[r[0] for r in rows],
        sample_idx=[r[1] for r in rows],
        gen_rank=gen_rank,
        policy_version=version,
        t_start=t_start,
        t_end=t_start,
    )
    return (
        stamp_domains(batch, dataset),
        [("train", i) for i, _ in rows],
        [gen.tokenizer.decode(ids) for ids in out.response_ids],
    )


def generate_with_refills(world, cfg, plan, gen, dataset, exchange, workers, version: int) -> None:
    """Dynamic sampling: generate the plan's rounds until enough groups are informative. Each round is
    scored before the next is decided; the generator group agrees on its informative-group count."""
    G = cfg.algorithm.group_size
    while True:
        ids = rank_share(plan.round, world.group_rank, world.group_size)
        informative: Informative = 0  # summed over the group: an int, or per source for a mixed dataset
        if len(ids):
            if workers is None:  # multi-turn: episodes score themselves
                batch = gen.rollout(dataset, ids, G, world.rank, version)
            else:
                batch = workers.score_now(*generate_unscored(gen, dataset, ids, G, world.rank, version))
            informative = informative_groups(cfg, batch)
            exchange.put(batch)  # dropped groups too: the trainer logs every sample and replays the same plan
        if not plan.advance(world.group_comm.allreduce(informative)):
            return


def reward_pool(cfg, task, run_dir: Path) -> RewardPool | InlineScorer:
    """The reward worker processes of this generator rank (they rebuild the task from its config); with
    task.reward_workers 0 the same scoring in this process."""

    data = data_dir(run_dir)
    args = (cfg.task.model_dump(mode="json"), cfg.run.seed, str(data) if data is not None else None)
    if cfg.task.reward_workers == 0:
        return InlineScorer("rollout_hpc.envs.scoring:task_scorer", args, name=reward_name(task, cfg.task))
    return RewardPool(
        "rollout_hpc.envs.scoring:task_scorer",
        args,
        n_workers=cfg.task.reward_workers,
        timeout_s=cfg.task.reward_timeout,
        name=reward_name(task, cfg.task),
    )


def make_evaluator(world, cfg, gen, task, workers, eval_comm):
    rows = eval_prompts(task, cfg.run.seed)
    if rows is None or (workers is None and not is_multi_turn(task)):
        return None  # refused at submit time (commands check it)
    logger = world.log_writer
    return Evaluator(world, cfg, gen, rows, workers, eval_comm, logger)


def run_generator(world, cfg, run_dir: Path, model, tokenizer, exchange, weights, eval_comm=None, rate=None) -> int:
    a = cfg.algorithm
    task = load_task(cfg.task, data_dir=data_dir(run_dir))
    dataset = task.prompts(cfg.run.seed)
    gen = make_generator(cfg, model, tokenizer, task)
    multi_turn = is_multi_turn(task)
    if multi_turn:  # its environments: on the environment group, in worker processes, or (None) in threads here
        gen.env_host = generator_host(world, cfg, task, run_dir)
    models = ModelScorer(cfg, dataset) if cfg.rewards.models and not multi_turn else None
    workers = None if multi_turn else RewardWorkers(exchange, reward_pool(cfg, task, run_dir), models, rate)
    evaluator = make_evaluator(world, cfg, gen, task, workers, eval_comm) if cfg.eval and eval_comm else None

    # The trainers publish the weights they start from; its version is the first step to generate.
    version, tensors = receive_weights(weights, 0)
    gen.load_weights(tensors)
    step = version
    watchdog.beat(step)  # start-up is over: from here a rank that stops making progress is hung
    schedule = EvalSchedule(cfg, step)

    def evaluate_if_due(step: int) -> None:
        nonlocal version
        if evaluator is None:
            return
        point = schedule.due(step)
        if point is None:
            return
        if version < point:  # off-policy runs: evaluate the point's own weights
            version, tensors = receive_weights(weights, point)
            gen.load_weights(tensors)
        evaluator.run(point, version)

    # generator.extra_prompts with dynamic sampling: the groups the step needs are informative ones
    informative = (lambda r, n: group_informative(cfg, r.ravel(), n.ravel())) if uses_dynamic_sampling(cfg) else None
    warmup, total = cfg.warmup.sft_steps, cfg.total_steps
    aborted = 0  # samples cut off by generator.extra_prompts' scheduling
    try:
        while step < warmup:  # SFT warm-up: the trainers train alone; evaluate its points as their weights come
            point = schedule.next_point()
            target = warmup if point is None else min(point, warmup)
            try:
                if version < target:
                    version, tensors = receive_weights(weights, target)
                    gen.load_weights(tensors)
                step = max(target, version)
                evaluate_if_due(step)
            except SyncClosed:
                return 0  # a stop during warm-up
        while step < total:
            need = step - cfg.exchange.max_staleness
            try:
                got = weights.poll() if version >= need else receive_weights(weights, need)
                if got is not None:
                    version, tensors = got
                    gen.load_weights(tensors)
                evaluate_if_due(step)
            except SyncClosed:
                break  # the trainers stopped (end of run, or a checkpoint-and-stop)
            plan = StepPlan.for_step(cfg, step - warmup)  # RL steps count their prompts from 0
            if cfg.generator.extra_prompts:  # the prompt sampler's state comes with the weights of this step
                sampler = PromptSampler.from_meta(cfg, (weights.meta or {}).get("sampler"))
                share = RankShare(sampler, world.group_rank, a.group_size, world.rank, version)
                if workers is None:  # multi-turn: episodes score themselves
                    got = scheduled_episodes(gen, dataset, share, informative)
                    if got is not None:
                        exchange.put(got.batch)
                else:
                    got = scheduled_rollout(gen, dataset, share, workers, informative)
                    if got is not None:
                        workers.submit(got.batch, got.keys, got.texts, got.results)
                aborted += got.aborted if got is not None else 0
            elif plan.done:  # one round: hand it to the reward workers and go on to the next step
                ids = rank_share(plan.round, world.group_rank, world.group_size)
                if len(ids):
                    if multi_turn:  # episodes score themselves turn by turn
                        exchange.put(gen.rollout(dataset, ids, a.group_size, world.rank, version))
                    else:
                        assert workers is not None  # every single-turn task has reward workers
                        workers.submit(*generate_unscored(gen, dataset, ids, a.group_size, world.rank, version))
            else:
                generate_with_refills(world, cfg, plan, gen, dataset, exchange, workers, version)
            step += 1
            watchdog.beat(step)
        else:
            try:  # the final eval: the weights of the last step
                evaluate_if_due(total)
            except SyncClosed:
                pass
    finally:
        if workers is not None:
            workers.close()
        if aborted:
            print(f"rollout-hpc: generator rank {world.rank} aborted {aborted} unfinished samples", file=sys.stderr)
        if gen.env_host is not None:  # an environment rank ends once each of its generators has said so
            gen.env_host.close()
    return 0
