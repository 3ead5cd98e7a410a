"""What a reward worker process runs: the task's reward for a prompt named by (split, index).

Reward workers (rollout_hpc.rewards.pool.RewardPool) are separate processes, so they get the task's
*config*, not its objects: each builds the task once (a dataset task memory-maps the run's frozen rows)
and is then sent only (split, prompt index, response text) per sample.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rollout_hpc.config import TaskSection

from .base import dataset_item
from .registry import eval_prompts, load_task

TRAIN, EVAL = "train", "eval"


def task_scorer(task_cfg: dict, seed: int, data_dir: str | None = None) -> Callable[[Any, str], Any]:
    """RewardPool factory: score((split, index), text) -> the task's reward, unchecked (the pool checks it)."""
    task = load_task(TaskSection.model_validate(task_cfg), data_dir=data_dir)
    streams = {TRAIN: task.prompts(seed), EVAL: eval_prompts(task, seed)}
    reward = getattr(task, "raw_reward", task.reward)

    def score(key, text: str):
        split, index = key
        return reward(dataset_item(streams[split], int(index)), text)

    return score


def reward_name(task: Any, task_cfg) -> str:
    """How error messages name the reward: the plugin or built-in spec, else the task."""
    return getattr(task, "reward_name", None) or f"task '{task_cfg.name}' reward()"
