"""Supervised warm-up (warmup.sft_steps; run.program 'sft'): teacher-forced training on the task's (prompt, answer)
pairs by the trainer ranks, before RL, in the same run (same trainer, checkpoints, resume, metrics).

Step g < warmup.sft_steps trains pairs [g*B, (g+1)*B) of an SFT stream of the task's prompts (a shuffle of its own,
seeded apart from the RL stream: the RL steps still start at prompt 0 of theirs), so the step stays the data cursor
and an interruption during warm-up resumes in warm-up, exactly once. The target is the row's answer as text plus
EOS; the prompt is formatted exactly as the generators format it (chat template included); the loss is the
negative log-likelihood of the target tokens, aggregated like the RL loss (algorithm.loss_agg).

A multi-turn task teaches whole episodes instead: its `demonstration(item)` gives the replies that solve the item
(sokoban: the breadth-first solver's moves); they are played through a fresh environment and the record is built as
the generators build an episode's (by backends/episodes.py itself: the first observation as the prompt, each reply's
tokens trained on, each observation after it in the context with no loss), so the warm-up teaches exactly the token
sequences RL then samples.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from rollout_hpc import algos
from rollout_hpc.backends.episodes import Episode, EpisodeSettings, rollout_episodes
from rollout_hpc.backends.generate_hf import derive_seed, trajectory_batch
from rollout_hpc.backends.generator import Generation
from rollout_hpc.envs.base import dataset_item, is_multi_turn
from rollout_hpc.errors import DatasetError, TaskError
from rollout_hpc.models.prompting import encode_prompt_item
from rollout_hpc.trajectory import EPISODE_OK, TrajectoryBatch

_SFT_STREAM = 0x5F7


def sft_stream(task, seed: int):
    """The task's prompts in the SFT phase's own order."""
    return task.prompts(derive_seed(seed, _SFT_STREAM) % (1 << 31))


def batch_size(cfg) -> int:
    return cfg.warmup.batch_size or cfg.algorithm.prompts_per_step * cfg.algorithm.group_size


def answer_text(item) -> str:
    """The text an SFT step teaches for a prompt: its answer (the first of several accepted ones)."""
    answer = getattr(item, "answer", None)
    if isinstance(answer, (list, tuple)):
        answer = answer[0] if answer else None
    if answer is None:
        raise DatasetError(
            "warmup.sft_steps trains on the task's answers, but a prompt has none "
            f"({getattr(item, 'text', item)!r}); give every row an answer or set warmup.sft_steps: 0"
        )
    return str(answer)


def demonstration_episodes(cfg, task, tokenizer, items) -> list[Episode]:
    """The task's demonstrations of `items`, played by the episode loop itself (backends/episodes.py) with a policy
    that replies each demonstrated move as the generator would sample it (its tokens and EOS, cut at
    task.env.max_tokens_per_turn): the records RL then samples, built by the same code."""
    demonstrate = getattr(task, "demonstration", None)
    if not callable(demonstrate):
        raise DatasetError(
            f"warmup.sft_steps on a multi-turn task trains on demonstrations, but the task ({type(task).__name__}) "
            "has no demonstration(item) method returning the replies that solve an item; add one or set "
            "warmup.sft_steps: 0"
        )
    replies = [demonstrate(item) for item in items]
    for item, moves in zip(items, replies):
        if not moves:
            raise DatasetError(f"the task's demonstration of {getattr(item, 'text', item)!r} has no reply")
    per_turn = cfg.task.env.max_tokens_per_turn or cfg.algorithm.max_new_tokens
    turn = [0] * len(items)

    def replay(prompts, live):
        out = []
        for i in live:
            if turn[i] >= len(replies[i]):
                raise DatasetError(
                    f"the task's demonstration of {getattr(items[i], 'text', items[i])!r} ends after {turn[i]} "
                    "replies, before its episode does (it does not solve the item)"
                )
            out.append((tokenizer.encode(replies[i][turn[i]]) + [tokenizer.eos_id])[:per_turn])
            turn[i] += 1
        return Generation(out, [[0.0] * len(ids) for ids in out], [False] * len(out))

    settings = EpisodeSettings.from_config(cfg.task.env)
    episodes = rollout_episodes(lambda i: task.make_env(), items, replay, tokenizer, per_turn, settings=settings)
    for item, ep in zip(items, episodes):
        if ep.status != EPISODE_OK:  # a demonstration is the teacher: its environment failing is no sample to skip
            raise TaskError(
                f"the environment failed playing the demonstration of {getattr(item, 'text', item)!r}: {ep.error}"
            )
    return episodes


def sft_batch(cfg, task, tokenizer, stream, step: int) -> TrajectoryBatch:
    """Step `step`'s (prompt, answer + EOS) pairs as records: the answer is the 'response' trained on (a
    multi-turn task's: its demonstration episodes)."""
    B = batch_size(cfg)
    indices = range(step * B, (step + 1) * B)
    items = [dataset_item(stream, i) for i in indices]
    masks = starts = None
    if is_multi_turn(task):
        episodes = demonstration_episodes(cfg, task, tokenizer, items)
        prompts, targets = [e.prompt_ids for e in episodes], [e.response_ids for e in episodes]
        masks, starts = [e.loss_mask for e in episodes], [e.turn_starts for e in episodes]
    else:
        prompts = [encode_prompt_item(tokenizer, item, getattr(task, "chat_template", "auto")) for item in items]
        targets = [tokenizer.encode(answer_text(item)) + [tokenizer.eos_id] for item in items]
    now = time.time()
    return trajectory_batch(
        prompts,
        targets,
        [[0.0] * len(t) for t in targets],
        [0.0] * B,
        prompt_index=list(indices),
        sample_idx=[0] * B,
        gen_rank=0,
        policy_version=step,
        truncated=[False] * B,
        t_start=now,
        t_end=now,
        loss_masks=masks,
        turn_starts=starts,
    )


def make_sft_loss_fn(cfg):
    """loss_fn(logprobs, entropy, batch) for Trainer.train_step: NLL of the target tokens."""
    agg = cfg.algorithm.loss_agg

    def loss_fn(logp: torch.Tensor, ent: torch.Tensor, b: dict):
        mask = b["mask"]
        loss = algos.aggregate(-logp, mask, agg)
        n = mask.sum().clamp(min=1)
        return loss, {
            "sft_loss": float(loss.detach()),
            "entropy": float((ent.detach() * mask).sum() / n),
            "sft_token_logp": float((logp.detach() * mask).sum() / n),
        }

    return loss_fn


def my_rows(n: int, group_rank: int, group_size: int) -> np.ndarray:
    return np.array_split(np.arange(n), group_size)[group_rank]
