"""What a task is (see docs/plugins.md).

Single-turn Task:   prompts(seed) -> dataset; reward(prompt_item, response_text) -> float
Multi-turn task:    prompts(seed) -> dataset; make_env() -> Environment
Environment:        reset(prompt_item) -> observation str;
                    step(action_text) -> (observation str, reward float, done bool, info dict); max_turns int

A dataset is indexable: dataset[i] is prompt i, the same for the same seed (the run's data
cursor is the index, so a resumed run continues the same stream). It may be infinite (no
__len__) or finite (has __len__; the cursor wraps around). An item is a str, a `Prompt`, a
dict with a "prompt" key, or any object with a `text` attribute.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class Prompt:
    """One prompt of a task. `messages` (chat turns [{role, content}, ...]) is what a chat template
    formats when the task gives it; `text` is the plain-text form (the last user turn for chats)."""

    text: str
    answer: Any = None
    meta: dict = field(default_factory=dict)
    messages: tuple | None = None
    domain: str | None = None  # the source it came from, in a mixed dataset (task.params.train as a list)


def prompt_text(item: Any) -> str:
    """The text to feed the model for any supported prompt item."""
    if isinstance(item, str):
        return item
    if isinstance(item, dict) and "prompt" in item:
        return str(item["prompt"])
    text = getattr(item, "text", None)
    if isinstance(text, str):
        return text
    raise TypeError(
        f"prompt item {item!r} has no text: a task's dataset must yield str, Prompt, dict with 'prompt', or objects with .text"
    )


def dataset_item(dataset, index: int):
    """dataset[index], wrapping around finite datasets (the cursor keeps counting)."""
    n = len(dataset) if hasattr(dataset, "__len__") else None
    if n == 0:
        raise ValueError("the task's prompt dataset is empty")
    return dataset[index % n if n else index]


@runtime_checkable
class Environment(Protocol):
    max_turns: int

    def reset(self, prompt_item: Any) -> str: ...
    def step(self, action_text: str) -> tuple[str, float, bool, dict]: ...


def is_multi_turn(task: Any) -> bool:
    return callable(getattr(task, "make_env", None))
