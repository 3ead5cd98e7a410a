"""Tasks and environments: built-ins (arithmetic, sokoban) and plugins (see docs/plugins.md)."""

from .arithmetic import ArithmeticTask
from .base import Environment, Prompt, dataset_item, is_multi_turn, prompt_text
from .registry import BUILTIN_TASKS, TaskError, check_task, eval_prompts, load_task
from .sokoban import Level, SokobanEnv, SokobanTask, generate_level, parse_action

__all__ = [
    "ArithmeticTask",
    "BUILTIN_TASKS",
    "Environment",
    "Level",
    "Prompt",
    "SokobanEnv",
    "SokobanTask",
    "TaskError",
    "check_task",
    "eval_prompts",
    "dataset_item",
    "generate_level",
    "is_multi_turn",
    "load_task",
    "parse_action",
    "prompt_text",
]
