"""Built-in multi-turn task over gymnasium's FrozenLake: walk from S to the goal G over frozen tiles F, not into a
hole H. The board is shown as text with the player as `@`; replies are L/D/R/U or left/down/right/up (first word,
any case, as in sokoban). Reward 1 on reaching G (solved, done), 0 otherwise; falling into a hole ends the episode.

Params: `size` (4; with `random_map` a new map per episode seed, else gymnasium's fixed 4x4 / 8x8 map),
`random_map` (true), `is_slippery` (false: moves go where asked), `max_turns` (8), `invalid_penalty` (0.0),
`instructions` (true: one line of rules before the first board).
"""

from __future__ import annotations

from .gym_env import GymTask, adapter_factory, gymnasium
from .sokoban import parse_action

ACTIONS = {"L": 0, "D": 1, "R": 2, "U": 3}  # gymnasium's FrozenLake action numbers
RULES = "Walk @ from S to G, avoid holes H (L/D/R/U)\n"


class FrozenLakeAdapter:
    """FrozenLake's observation (the tile index) as the board with the player; replies as actions."""

    def __init__(self, instructions: bool = True) -> None:
        self.instructions = RULES if instructions else ""

    def observation(self, obs, info, env) -> str:
        desc = env.unwrapped.desc
        width = desc.shape[1]
        rows = [[c.decode() for c in row] for row in desc]
        rows[int(obs) // width][int(obs) % width] = "@"
        return "\n".join("".join(r) for r in rows) + "\n"

    def action(self, text: str, env):
        a = parse_action(text)
        return None if a is None else ACTIONS[a]


class FrozenLakeTask(GymTask):
    def __init__(
        self,
        size: int = 4,
        random_map: bool = True,
        is_slippery: bool = False,
        max_turns: int = 8,
        invalid_penalty: float = 0.0,
        instructions: bool = True,
    ) -> None:
        gym = gymnasium()
        if size < 2:
            raise ValueError(f"task.params.size must be at least 2, got {size}")
        if not random_map and size not in (4, 8):
            raise ValueError(f"task.params.size {size} needs random_map: true (gymnasium's fixed maps are 4 and 8)")
        from gymnasium.envs.toy_text.frozen_lake import generate_random_map  # gymnasium is optional

        def make(seed: int):
            layout = {"desc": generate_random_map(size, seed=seed)} if random_map else {"map_name": f"{size}x{size}"}
            return gym.make("FrozenLake-v1", is_slippery=is_slippery, **layout)

        super().__init__(
            make, adapter_factory(None, lambda: FrozenLakeAdapter(instructions)), max_turns, invalid_penalty
        )
