"""Built-in multi-turn environment: a small Sokoban room with one box and one target.

Levels are generated from a seed (walls around, optional interior walls, random box,
target and player) and kept only if a breadth-first search finds a solution, so every
level is solvable. Text rendering uses the usual glyphs:

    #  wall      .  target     $  box      *  box on target
    @  player    +  player on target        (space) floor

Actions: U/D/L/R or up/down/left/right (first word, any case). Rewards per step:
-step_cost for a move (also a bump into a wall), +1 more when the box reaches the target
(the episode ends, solved), -invalid_penalty for text that is no action (nothing moves), and with `shaping` > 0
shaping x (how many cells nearer the target the move pushed the box; negative when farther): a potential-based
term (Ng et al. 1999) that sums to shaping x (start distance - end distance) over an episode, so it ranks episodes of
the same level that fail by how near they brought the box, without changing which play is best.
The episode also ends after max_turns actions.

With `hints`, every board is followed by a line of offsets, e.g. `box D1L2 goal U2`: where the box is from the
player, and the target from the box (D/U rows down/up, R/L columns right/left; `0`: the same cell). A model that
starts from random weights must otherwise learn to count rows and columns in a character grid before it can act:
the 128 x 3-layer policy of configs/examples/agentic-sokoban.yaml sat at the uniform 4-move loss for ~60 SFT steps
on the bare grid, and left it after ~25 with the line (docs/agentic.md). A pretrained LLM reads the grid without it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .base import Prompt

MOVES = {"U": (-1, 0), "D": (1, 0), "L": (0, -1), "R": (0, 1)}
WORDS = {"u": "U", "up": "U", "d": "D", "down": "D", "l": "L", "left": "L", "r": "R", "right": "R"}
INSTRUCTIONS = "Push $ onto . (U/D/L/R)\n"

Cell = tuple[int, int]
EVAL_SPLIT, EVAL_LEVELS = 0xE7A1, 64  # held-out levels: generate_level([seed, EVAL_SPLIT, i]), i < eval_levels


@dataclass(frozen=True)
class Level:
    walls: frozenset[Cell]
    size: tuple[int, int]
    target: Cell
    box: Cell
    player: Cell

    @classmethod
    def from_text(cls, text: str) -> Level:
        rows = [r for r in text.strip("\n").split("\n")]
        walls, target, box, player = set(), None, None, None
        for y, row in enumerate(rows):
            for x, ch in enumerate(row):
                if ch == "#":
                    walls.add((y, x))
                if ch in ".*+":
                    target = (y, x)
                if ch in "$*":
                    box = (y, x)
                if ch in "@+":
                    player = (y, x)
        if target is None or box is None or player is None:
            raise ValueError("a sokoban level needs one target (.), one box ($) and one player (@)")
        return cls(frozenset(walls), (len(rows), max(len(r) for r in rows)), target, box, player)

    def render(self, box: Cell, player: Cell) -> str:
        h, w = self.size
        out = []
        for y in range(h):
            row = []
            for x in range(w):
                c = (y, x)
                if c in self.walls:
                    row.append("#")
                elif c == box:
                    row.append("*" if c == self.target else "$")
                elif c == player:
                    row.append("+" if c == self.target else "@")
                else:
                    row.append("." if c == self.target else " ")
            out.append("".join(row))
        return "\n".join(out)

    def move(self, box: Cell, player: Cell, action: str) -> tuple[Cell, Cell]:
        """(box, player) after `action`; blocked moves leave both in place."""
        dy, dx = MOVES[action]
        nxt = (player[0] + dy, player[1] + dx)
        if nxt in self.walls:
            return box, player
        if nxt == box:
            beyond = (box[0] + dy, box[1] + dx)
            if beyond in self.walls:
                return box, player
            return beyond, nxt
        return box, nxt

    def solve(self, max_states: int = 100_000) -> list[str] | None:
        """Shortest action sequence that puts the box on the target (BFS), or None."""
        start = (self.box, self.player)
        parent: dict = {start: None}
        queue = deque([start])
        while queue and len(parent) < max_states:
            state = queue.popleft()
            if state[0] == self.target:
                path = []
                while parent[state] is not None:
                    state, action = parent[state]
                    path.append(action)
                return path[::-1]
            for action in MOVES:
                nxt = self.move(*state, action)
                if nxt not in parent:
                    parent[nxt] = (state, action)
                    queue.append(nxt)
        return None


def offset(a: Cell, b: Cell) -> str:
    """Where b is from a, as the hints line writes it: `D1L2`, `U3`, `R1`, or `0` for the same cell."""
    dy, dx = b[0] - a[0], b[1] - a[1]
    rows = f"D{dy}" if dy > 0 else f"U{-dy}" if dy < 0 else ""
    cols = f"R{dx}" if dx > 0 else f"L{-dx}" if dx < 0 else ""
    return rows + cols or "0"


def observation(level: Level, box: Cell, player: Cell, hints: bool) -> str:
    """The board as the policy reads it: the grid, and with hints the offsets line (module docstring)."""
    text = level.render(box, player) + "\n"
    return text + f"box {offset(player, box)} goal {offset(box, level.target)}\n" if hints else text


def generate_level(seed: int | Sequence[int], size: int = 5, interior_walls: int = 0, min_moves: int = 1) -> Level:
    """A solvable level determined by `seed` (retries inside the same RNG stream)."""
    if size < 4:
        raise ValueError(f"task.params.size must be at least 4 (a 2x2 room inside the walls), got {size}")
    rng = np.random.default_rng(seed)
    border = {(y, x) for y in range(size) for x in range(size) if y in (0, size - 1) or x in (0, size - 1)}
    inside = [(y, x) for y in range(1, size - 1) for x in range(1, size - 1)]
    if interior_walls + 3 > len(inside):
        raise ValueError(f"task.params.interior_walls={interior_walls} leaves no room for box, target and player")
    for _ in range(10_000):
        cells = [inside[i] for i in rng.permutation(len(inside))[: interior_walls + 3]]
        target, box, player, extra = cells[0], cells[1], cells[2], cells[3:]
        level = Level(frozenset(border | set(extra)), (size, size), target, box, player)
        solution = level.solve()
        if solution is not None and len(solution) >= min_moves:
            return level
    raise RuntimeError(f"no solvable sokoban level found for seed {seed}; lower task.params.interior_walls")


def parse_action(text: str) -> str | None:
    words = text.strip().split()
    return WORDS.get(words[0].lower()) if words else None


class SokobanEnv:
    def __init__(
        self,
        max_turns: int = 8,
        step_cost: float = 0.05,
        invalid_penalty: float = 0.1,
        size: int = 5,
        interior_walls: int = 0,
        instructions: bool = True,
        shaping: float = 0.0,
        hints: bool = False,
    ) -> None:
        if shaping < 0:
            raise ValueError(
                f"task.params.shaping must be >= 0 (a reward per cell the box nears the target), got {shaping}"
            )
        self.max_turns, self.step_cost, self.invalid_penalty = max_turns, step_cost, invalid_penalty
        self.shaping, self.hints = shaping, hints
        self.size, self.interior_walls, self.instructions = size, interior_walls, instructions
        self.level: Level | None = None

    def reset(self, prompt_item) -> str:
        """Start an episode: prompt_item is a Prompt from SokobanTask.prompts, a Level, or an int level seed."""
        if isinstance(prompt_item, Level):
            self.level = prompt_item
        elif isinstance(prompt_item, Prompt) and "level" in prompt_item.meta:
            self.level = prompt_item.meta["level"]
        else:
            self.level = generate_level(int(prompt_item), self.size, self.interior_walls)
        self.box, self.player, self.turns, self.done = self.level.box, self.level.player, 0, False
        return (INSTRUCTIONS if self.instructions else "") + self.render()

    def render(self) -> str:
        assert self.level is not None  # set by reset(), which every episode starts with
        return observation(self.level, self.box, self.player, self.hints)

    def _box_distance(self) -> int:
        assert self.level is not None
        return abs(self.box[0] - self.level.target[0]) + abs(self.box[1] - self.level.target[1])

    def step(self, action_text: str) -> tuple[str, float, bool, dict]:
        if self.level is None or self.done:
            raise RuntimeError("call reset() before step(), and again after an episode ends")
        self.turns += 1
        action = parse_action(action_text)
        if action is None:
            reward, note = -self.invalid_penalty, "invalid action; reply U, D, L or R\n"
        else:
            before = self._box_distance()
            self.box, self.player = self.level.move(self.box, self.player, action)
            reward, note = -self.step_cost + self.shaping * (before - self._box_distance()), ""
        solved = self.box == self.level.target
        if solved:
            reward += 1.0
        truncated = not solved and self.turns >= self.max_turns
        self.done = solved or truncated
        info = {"solved": solved, "invalid": action is None, "turn": self.turns, "truncated": truncated}
        return note + self.render(), reward, self.done, info


class SokobanLevels:
    """Infinite, random-access stream of levels: level i depends only on (seed, i)."""

    def __init__(self, seed: int, env: SokobanEnv, split: tuple[int, ...] = ()) -> None:
        self.seed, self.env, self.split = seed, env, split

    def __getitem__(self, i: int) -> Prompt:
        if i < 0:
            raise IndexError(f"prompt index {i} is negative")
        level = generate_level([self.seed, *self.split, i], self.env.size, self.env.interior_walls)
        text = (INSTRUCTIONS if self.env.instructions else "") + observation(
            level, level.box, level.player, self.env.hints
        )
        return Prompt(text=text, meta={"level": level})


class SokobanTask:
    """Multi-turn task: prompts(seed) are levels, make_env() plays them."""

    def __init__(self, eval_levels: int = EVAL_LEVELS, **params) -> None:
        if isinstance(eval_levels, bool) or not isinstance(eval_levels, int) or eval_levels < 1:
            raise ValueError(
                f"task.params.eval_levels must be a whole number >= 1 (held-out levels an eval plays), got {eval_levels!r}"
            )
        self.eval_levels, self.params = eval_levels, params
        self.make_env()  # validate params now, with the task's error messages

    def make_env(self) -> SokobanEnv:
        return SokobanEnv(**self.params)

    @property
    def max_turns(self) -> int:
        return self.params.get("max_turns", 8)

    def prompts(self, seed: int) -> SokobanLevels:
        return SokobanLevels(abs(int(seed)), self.make_env())

    def demonstration(self, prompt_item) -> list[str]:
        """The replies that solve the level, shortest first found (breadth-first search): what an SFT warm-up
        (warmup.sft_steps) teaches before RL."""
        env = self.make_env()
        env.reset(prompt_item)
        assert env.level is not None
        return env.level.solve() or []

    def eval_prompts(self, seed: int) -> list[Prompt]:
        """task.params.eval_levels (64) held-out levels from their own seed stream, the same first ones whatever the
        count (small rooms have few layouts: 504 for size 5, so some may equal training levels; interior_walls and
        size make more). One eval's standard error at success p is sqrt(p(1-p)/eval_levels): 5 points at p = 0.2
        over 64 levels, 2.5 over 256."""
        levels = SokobanLevels(abs(int(seed)), self.make_env(), split=(EVAL_SPLIT,))
        return [levels[i] for i in range(self.eval_levels)]
