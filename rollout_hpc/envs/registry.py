"""cfg.task -> a task object: a built-in by name or a plugin, with cfg.task.reward overriding the reward."""

from __future__ import annotations

from typing import Any

from rollout_hpc.config import ConfigError
from rollout_hpc.plugins import PluginError, checked_reward_fn, is_plugin_spec, load_plugin, load_reward

from .arithmetic import ArithmeticTask
from .base import is_multi_turn
from .sokoban import SokobanTask

BUILTIN_TASKS = {"arithmetic": ArithmeticTask, "sokoban": SokobanTask}


class TaskError(ConfigError, ValueError):
    """A task.* setting that cannot work; the message names the field and the fix."""


class CheckedRewardTask:
    """A single-turn task whose reward is a checked function (the task's own or a reward plugin)."""

    def __init__(self, task: Any, reward_fn) -> None:
        self.task, self._reward = task, reward_fn

    def prompts(self, seed: int):
        return self.task.prompts(seed)

    def reward(self, prompt_item, response_text: str) -> float:
        return self._reward(prompt_item, response_text)


def load_task(task_cfg) -> Any:
    """Build the task of `cfg.task` (a TaskSection)."""
    name, params = task_cfg.name, dict(task_cfg.params)
    if name in BUILTIN_TASKS:
        try:
            task = BUILTIN_TASKS[name](**params)
        except (TypeError, ValueError) as exc:
            raise TaskError(f"task.params for built-in task '{name}': {exc}") from None
    elif is_plugin_spec(name):
        task = _task_from_plugin(name, params)
    else:
        raise TaskError(
            f"task.name '{name}' is not a built-in task ({', '.join(BUILTIN_TASKS)}) "
            "nor a plugin; name a plugin as 'package.module:attr' or 'path/to/file.py:attr'"
        )
    if task_cfg.reward:
        if is_multi_turn(task):
            raise TaskError(f"task.reward overrides the reward of single-turn tasks; '{name}' is multi-turn "
                             "(its environment's step() gives the rewards)")
        return CheckedRewardTask(task, load_reward(task_cfg.reward, "task.reward"))
    return task


def _task_from_plugin(spec: str, params: dict) -> Any:
    obj = load_plugin(spec, "task.name")
    who = f"task.name '{spec}'"
    # A class or function is a factory; anything else with prompts() is a ready task object.
    is_factory = isinstance(obj, type) or (callable(obj) and not hasattr(obj, "prompts"))
    if not is_factory and hasattr(obj, "prompts"):
        if params:
            raise PluginError(f"{who} is a ready task object, so task.params ({', '.join(params)}) cannot be applied; "
                              "export a class or factory function instead")
        task = obj
    elif is_factory:
        try:
            task = obj(**params)
        except TypeError as exc:
            raise PluginError(f"{who}: calling it with task.params {params} failed: {exc}") from None
    else:
        raise PluginError(f"{who} is a {type(obj).__name__}; export a task object, class or factory function")
    if not callable(getattr(task, "prompts", None)):
        raise PluginError(f"{who} gave a {type(task).__name__} without a prompts(seed) method; see docs/plugins.md")
    if is_multi_turn(task):
        return task
    if not callable(getattr(task, "reward", None)):
        raise PluginError(f"{who} gave a {type(task).__name__} with neither reward(prompt, response_text) "
                          "nor make_env(); see docs/plugins.md")
    return CheckedRewardTask(task, checked_reward_fn(task.reward, f"{who} reward()"))
