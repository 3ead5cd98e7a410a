"""gymnasium environments as multi-turn tasks (docs/agentic.md).

`task.name: gym:ENV_ID` wraps `gymnasium.make(ENV_ID, **task.params.env_kwargs)`; a plugin `file.py:make_env` that
returns a `gymnasium.Env` is wrapped the same way. A *text adapter* turns the environment's observations into the
text the model reads and the model's reply into an action:

    class MyAdapter:
        instructions = "Reply with a number 0-3\\n"          # optional: put before the first observation
        def observation(self, obs, info, env) -> str: ...
        def action(self, text, env):                          # None: the reply is no action (a format error)

`task.params.adapter` names one ('file.py:MyAdapter'); without it a built-in one is used: FrozenLake's
(envs/frozenlake.py), or for any environment with a Discrete action space `DiscreteAdapter` (observations as
`str(obs)`, actions as their number). Episode i of a stream is `env.reset(seed=derive(run seed, i))`.
"""

from __future__ import annotations

import hashlib
from typing import Any

from rollout_hpc.errors import TaskError
from rollout_hpc.plugins import load_plugin

from .base import Prompt

GYM_PREFIX = "gym:"
EVAL_EPISODES = 256  # held-out environment seeds of a task (eval.max_prompts takes fewer)
INSTALL = "pip install 'rollout-hpc[gym]' (gymnasium)"


def gymnasium():
    """The gymnasium module (an optional dependency), or a TaskError saying how to install it."""
    try:
        import gymnasium  # optional: only gym tasks need it
    except ImportError:
        raise TaskError(f"task.name 'gym:...' and the frozenlake task need gymnasium: {INSTALL}") from None
    return gymnasium


def episode_seed(seed: int, index: int, split: str = "train") -> int:
    """A 31-bit environment seed for episode `index` of a split: train and held-out seeds never share a stream."""
    digest = hashlib.sha256(f"{split},{int(seed)},{int(index)}".encode()).digest()
    return int.from_bytes(digest[:4], "little") >> 1


class DiscreteAdapter:
    """Any environment with a Discrete action space: the observation as text, the action as its number."""

    def __init__(self, env) -> None:
        n = getattr(env.action_space, "n", None)
        if n is None:
            raise TaskError(
                f"the gymnasium environment's action space {env.action_space} is not Discrete: give a text adapter "
                "task.params.adapter: 'file.py:Adapter' (docs/agentic.md)"
            )
        self.n, self.start = int(n), int(getattr(env.action_space, "start", 0))
        self.instructions = f"Reply with an action number {self.start}-{self.start + self.n - 1}\n"

    def observation(self, obs, info, env) -> str:
        return f"{obs}\n"

    def action(self, text: str, env):
        words = text.strip().split()
        if not words or not words[0].lstrip("-").isdigit():
            return None
        a = int(words[0])
        return a if self.start <= a < self.start + self.n else None


class GymEnv:
    """Our Environment (reset(item) -> text, step(text) -> (text, reward, done, info)) over one gymnasium.Env."""

    def __init__(self, make, adapter_for, max_turns: int, invalid_penalty: float) -> None:
        self.make, self.adapter_for = make, adapter_for
        self.max_turns, self.invalid_penalty = max_turns, invalid_penalty
        self.env: Any = None
        self.adapter: Any = None

    def reset(self, prompt_item) -> str:
        seed = prompt_item.meta["seed"] if isinstance(prompt_item, Prompt) else int(prompt_item)
        if self.env is None:
            self.env = self.make(seed)
            self.adapter = self.adapter_for(self.env)
        obs, info = self.env.reset(seed=seed)
        self.last = self.adapter.observation(obs, info, self.env)
        return getattr(self.adapter, "instructions", "") + self.last

    def step(self, action_text: str) -> tuple[str, float, bool, dict]:
        action = self.adapter.action(action_text, self.env)
        if action is None:  # nothing happens in the environment; the model is told and tries again
            note = getattr(self.adapter, "instructions", "") or "not an action\n"
            return "invalid action. " + note + self.last, 0.0 - self.invalid_penalty, False, {"format_error": True}
        obs, reward, terminated, truncated, info = self.env.step(action)
        self.last = self.adapter.observation(obs, info, self.env)
        success = bool(info.get("success", terminated and reward > 0))
        info = {**info, "success": success, "truncated": bool(truncated and not terminated)}
        return self.last, float(reward), bool(terminated or truncated), info


class EpisodeSeeds:
    """Infinite, random-access stream of episodes: item i resets the environment with episode_seed(seed, i)."""

    def __init__(self, seed: int, split: str = "train") -> None:
        self.seed, self.split = seed, split

    def __getitem__(self, i: int) -> Prompt:
        if i < 0:
            raise IndexError(f"prompt index {i} is negative")
        s = episode_seed(self.seed, i, self.split)
        return Prompt(text=f"episode seed {s}", meta={"seed": s})


class HeldOutSeeds(EpisodeSeeds):
    """The first EVAL_EPISODES episodes of a held-out split (finite: an eval runs over all of them)."""

    def __len__(self) -> int:
        return EVAL_EPISODES

    def __getitem__(self, i: int) -> Prompt:
        if i >= EVAL_EPISODES:
            raise IndexError(f"held-out episode {i} of {EVAL_EPISODES}")
        return super().__getitem__(i)


class GymTask:
    """A multi-turn task over gymnasium environments: `make(seed)` builds one (seed: the episode's, for
    environments whose layout depends on it), `adapter_for(env)` its text adapter."""

    def __init__(self, make, adapter_for, max_turns: int = 20, invalid_penalty: float = 0.0) -> None:
        self.make, self.adapter_for = make, adapter_for
        self.max_turns, self.invalid_penalty = max_turns, invalid_penalty

    def prompts(self, seed: int) -> EpisodeSeeds:
        return EpisodeSeeds(seed)

    def eval_prompts(self, seed: int) -> HeldOutSeeds:
        """Held-out environment seeds (a stream disjoint from training's)."""
        return HeldOutSeeds(seed, "eval")

    def make_env(self) -> GymEnv:
        return GymEnv(self.make, self.adapter_for, self.max_turns, self.invalid_penalty)


def adapter_factory(spec: str | None, builtin=None):
    """adapter_for(env): the adapter plugin `spec` (a class, factory or object), else the built-in adapter class
    of the environment (`builtin`, e.g. FrozenLake's), else DiscreteAdapter."""
    if spec:
        obj = load_plugin(spec, "task.params.adapter")
        if isinstance(obj, type) or not callable(getattr(obj, "action", None)):
            return lambda env: obj()
        return lambda env: obj
    if builtin is not None:
        return lambda env: builtin()
    return DiscreteAdapter


def gym_task(
    env_id: str,
    adapter: str | None = None,
    max_turns: int = 20,
    invalid_penalty: float = 0.0,
    env_kwargs: dict | None = None,
    builtin_adapter=None,
) -> GymTask:
    """task.name 'gym:ENV_ID' with task.params {adapter, max_turns, invalid_penalty, env_kwargs}."""
    gym = gymnasium()
    kwargs = dict(env_kwargs or {})
    try:
        probe = gym.make(env_id, **kwargs)  # fail now, naming the id, not on a generator rank
    except Exception as exc:  # gymnasium raises several kinds (NameNotFound, TypeError for kwargs, ...)
        raise TaskError(f"task.name 'gym:{env_id}': gymnasium.make failed: {type(exc).__name__}: {exc}") from None
    adapter_for = adapter_factory(adapter, builtin_adapter)
    adapter_for(probe)  # a Discrete-less space without an adapter is refused here
    probe.close()
    return GymTask(lambda seed: gym.make(env_id, **kwargs), adapter_for, max_turns, invalid_penalty)


def wrap_gym_env(factory, probe, params: dict, who: str, builtin_adapter=None) -> GymTask:
    """A plugin factory that returns a gymnasium.Env (`probe`: what it returned for task.params; it is called
    again for every episode). Its adapter: the env's `text_adapter` attribute, else as adapter_factory."""
    spec = getattr(probe, "spec", None)
    has_own = getattr(probe, "text_adapter", None) is not None
    adapter_for = (lambda env: env.text_adapter) if has_own else adapter_factory(None, builtin_adapter)
    try:
        adapter_for(probe)
    except TaskError as exc:
        raise TaskError(f"{who}: {exc}; or give the environment a text_adapter attribute") from None
    turns = getattr(spec, "max_episode_steps", None) or 20
    return GymTask(lambda seed: factory(**params), adapter_for, turns)


def is_gym_env(obj: Any) -> bool:
    return all(hasattr(obj, a) for a in ("action_space", "observation_space", "step", "reset"))
