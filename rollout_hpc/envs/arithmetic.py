"""Built-in single-turn task: small arithmetic like "3+4=" -> "7", exact-match reward.

Easy enough for a tiny model to learn on a CPU in minutes: operands 0..max_operand,
operations from `ops` ('+', '-', '*'); subtraction keeps the larger operand first so
answers are never negative.
"""

from __future__ import annotations

import numpy as np

from .base import Prompt


class ArithmeticPrompts:
    """Infinite, random-access stream: item i depends only on (seed, i)."""

    def __init__(self, seed: int, max_operand: int, ops: str) -> None:
        self.seed, self.max_operand, self.ops = seed, max_operand, ops

    def __getitem__(self, i: int) -> Prompt:
        if i < 0:
            raise IndexError(f"prompt index {i} is negative")
        rng = np.random.default_rng([self.seed, i])
        a, b = (int(x) for x in rng.integers(0, self.max_operand + 1, size=2))
        op = self.ops[int(rng.integers(len(self.ops)))]
        if op == "-" and b > a:
            a, b = b, a
        answer = {"+": a + b, "-": a - b, "*": a * b}[op]
        return Prompt(text=f"{a}{op}{b}=", answer=str(answer), meta={"a": a, "b": b, "op": op})


class ArithmeticTask:
    def __init__(self, max_operand: int = 9, ops: str = "+-", eval_size: int = 64) -> None:
        if not isinstance(max_operand, int) or max_operand < 1:
            raise ValueError(f"task.params.max_operand must be an integer >= 1, got {max_operand!r}")
        if not ops or any(o not in "+-*" for o in ops):
            raise ValueError(f"task.params.ops must be a non-empty string of '+', '-', '*', got {ops!r}")
        if not isinstance(eval_size, int) or eval_size < 1:
            raise ValueError(f"task.params.eval_size must be an integer >= 1, got {eval_size!r}")
        self.max_operand, self.ops, self.eval_size = max_operand, ops, eval_size

    def prompts(self, seed: int) -> ArithmeticPrompts:
        return ArithmeticPrompts(abs(int(seed)), self.max_operand, self.ops)

    def eval_prompts(self, seed: int) -> list[Prompt]:
        """A fixed held-out set of eval_size prompts (from a stream the training prompts never use)."""
        held_out = ArithmeticPrompts(abs(int(seed)) + (1 << 40), self.max_operand, self.ops)
        return [held_out[i] for i in range(self.eval_size)]

    def reward(self, prompt: Prompt, response_text: str) -> float:
        """1.0 when the response (surrounding whitespace ignored) is exactly the answer, else 0.0."""
        return 1.0 if response_text.strip() == prompt.answer else 0.0
