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
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from rollout_hpc.exchange.weights import SyncClosed
from rollout_hpc.runtime.step_plan import StepPlan, informative_groups, rank_share


class RewardWorkers:
    """Scores generated batches in worker threads and puts them into the exchange in order.

    The generator thread submits unscored samples and goes on; a sender thread
    waits for each batch's rewards (computed by a small pool) and puts batches
    in submission order, so the trainer's input never depends on thread timing.
    """

    def __init__(self, exchange, reward_fn, n_workers: int = 2):
        self.exchange = exchange
        self.reward_fn = reward_fn
        self.pool = ThreadPoolExecutor(max_workers=n_workers, thread_name_prefix="reward")
        self.queue: queue.Queue = queue.Queue(maxsize=4)  # bound the work in flight
        self.error: BaseException | None = None
        self.sender = threading.Thread(target=self._send_loop, name="reward-sender", daemon=True)
        self.sender.start()

    def submit(self, batch, items: list, texts: list[str]) -> None:
        """`batch` rows are (prompt, sample) ordered; items/texts per row. Rewards fill batch.fixed['reward']."""
        self._raise()
        futures = [self.pool.submit(self.reward_fn, item, text) for item, text in zip(items, texts)]
        self.queue.put((batch, futures))

    def score_now(self, batch, items: list, texts: list[str]):
        """Score on the pool and wait (dynamic sampling must see rewards before it decides on a refill).
        Only for runs that never `submit`: the batch is returned, not put into the exchange."""
        self._raise()
        batch.fixed["reward"] = list(self.pool.map(self.reward_fn, items, texts))
        batch.fixed["t_end"] = time.time()
        return batch

    def _send_loop(self) -> None:
        while True:
            job = self.queue.get()
            if job is None:
                return
            batch, futures = job
            try:
                batch.fixed["reward"] = [f.result() for f in futures]
                batch.fixed["t_end"] = time.time()
                self.exchange.put(batch)
            except BaseException as exc:  # surfaced on the generator thread's next call
                self.error = exc
                return

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        """Wait until everything submitted is scored and in the exchange."""
        self.queue.put(None)
        self.sender.join()
        self.pool.shutdown()
        self._raise()


def make_generator(cfg, model, tokenizer, task):
    from rollout_hpc.backends.generate_hf import HFGenerator, SamplingParams

    sampling = SamplingParams.from_config(cfg.algorithm, tokenizer)
    if cfg.generator.backend == "vllm":
        from rollout_hpc.backends.generate_vllm import VLLMGenerator

        return VLLMGenerator(cfg.model, tokenizer, task, sampling, cfg.run.seed, cfg.generator.tensor_parallel,
                             model=model if cfg.model.path is None else None)
    return HFGenerator(model, tokenizer, task, sampling, seed=cfg.run.seed)


def generate_unscored(gen, dataset, prompt_indices, group_size: int, gen_rank: int, version: int):
    """Single-turn sampling without rewards: (batch with reward 0, items, response texts).

    The same rows and seeds as Generator.rollout, which scores inline; here the
    reward workers score it."""
    from rollout_hpc.backends.generate_hf import derive_seed, trajectory_batch
    from rollout_hpc.envs.base import dataset_item, prompt_text

    t_start = time.time()
    # Each prompt is built and tokenized once; its group_size rows share the item and the token list.
    per_prompt = {int(i): dataset_item(dataset, int(i)) for i in prompt_indices}
    tokens = {i: gen.tokenizer.encode_prompt(prompt_text(item)) for i, item in per_prompt.items()}
    rows = [(i, item, s) for i, item in per_prompt.items() for s in range(group_size)]
    prompts = [tokens[i] for i, _, _ in rows]
    out = gen.generate(prompts, [derive_seed(gen.seed, i, s) for i, _, s in rows])
    batch = trajectory_batch(
        prompts, out.response_ids, out.logprobs, [0.0] * len(rows), truncated=out.truncated,
        prompt_index=[r[0] for r in rows], sample_idx=[r[2] for r in rows], gen_rank=gen_rank,
        policy_version=version, t_start=t_start, t_end=t_start,
    )
    return batch, [item for _, item, _ in rows], [gen.tokenizer.decode(ids) for ids in out.response_ids]


def generate_with_refills(world, cfg, plan, gen, dataset, exchange, workers, version: int) -> None:
    """Dynamic sampling: generate the plan's rounds until enough groups are informative. Each round is
    scored before the next is decided; the generator group agrees on its informative-group count."""
    G = cfg.algorithm.group_size
    while True:
        ids = rank_share(plan.round, world.group_rank, world.group_size)
        informative = 0
        if len(ids):
            if workers is None:  # multi-turn: episodes score themselves
                batch = gen.rollout(dataset, ids, G, world.rank, version)
            else:
                batch = workers.score_now(*generate_unscored(gen, dataset, ids, G, world.rank, version))
            informative = informative_groups(cfg, batch)
            exchange.put(batch)  # dropped groups too: the trainer logs every sample and replays the same plan
        if not plan.advance(world.group_comm.allreduce(informative)):
            return


def run_generator(world, cfg, run_dir: Path, model, tokenizer, exchange, weights) -> int:
    from rollout_hpc.envs import load_task
    from rollout_hpc.envs.base import is_multi_turn

    a = cfg.algorithm
    task = load_task(cfg.task)
    dataset = task.prompts(cfg.run.seed)
    gen = make_generator(cfg, model, tokenizer, task)
    multi_turn = is_multi_turn(task)
    workers = None if multi_turn else RewardWorkers(exchange, task.reward)

    # The trainers publish the weights they start from; its version is the first step to generate.
    version, tensors = weights.receive(0)
    gen.load_weights(tensors)
    step = version
    try:
        while step < a.steps:
            need = step - cfg.exchange.max_staleness
            try:
                got = weights.poll() if version >= need else weights.receive(need)
            except SyncClosed:
                break  # the trainers stopped (end of run, or a checkpoint-and-stop)
            if got is not None:
                version, tensors = got
                gen.load_weights(tensors)
            plan = StepPlan.for_step(cfg, step)
            if plan.done:  # one round: hand it to the reward workers and go on to the next step
                ids = rank_share(plan.round, world.group_rank, world.group_size)
                if len(ids):
                    if multi_turn:  # episodes score themselves turn by turn
                        exchange.put(gen.rollout(dataset, ids, a.group_size, world.rank, version))
                    else:
                        workers.submit(*generate_unscored(gen, dataset, ids, a.group_size, world.rank, version))
            else:
                generate_with_refills(world, cfg, plan, gen, dataset, exchange, workers, version)
            step += 1
    finally:
        if workers is not None:
            workers.close()
    return 0
