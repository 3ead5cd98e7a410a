"""cfg.task -> a task object: a built-in by name or a plugin, with cfg.task.reward overriding the reward."""

from __future__ import annotations

from typing import Any

from rollout_hpc.errors import TaskError
from rollout_hpc.plugins import PluginError, checked_reward_fn, is_plugin_spec, load_plugin
from rollout_hpc.rewards import CODE_PARAMS, builtin_reward, is_builtin_reward
from rollout_hpc.rewards.reward_models import check_reward_model

from .arithmetic import ArithmeticTask
from .base import is_multi_turn
from .dataset import DatasetTask
from .frozenlake import FrozenLakeAdapter, FrozenLakeTask
from .gym_env import GYM_PREFIX, gym_task, is_gym_env, wrap_gym_env
from .sokoban import SokobanTask

BUILTIN_TASKS = {
    "arithmetic": ArithmeticTask,
    "sokoban": SokobanTask,
    "frozenlake": FrozenLakeTask,
    "dataset": DatasetTask,
}
GYM_ADAPTERS = {"FrozenLake": FrozenLakeAdapter}  # gymnasium environments (id without version) with a built-in adapter


def builtin_adapter(env_id: str | None):
    """The built-in text adapter class of a gymnasium environment id ('FrozenLake-v1'), or None."""
    return GYM_ADAPTERS.get((env_id or "").split("/")[-1].rsplit("-v", 1)[0])


NEEDS_REWARD = {"dataset"}  # tasks that bring prompts and answers but no reward of their own


class CheckedRewardTask:
    """A single-turn task whose reward is a checked function (the task's own, a built-in or a reward plugin).
    Everything else (prompts, eval_prompts, chat_template, ...) is the task's."""

    def __init__(self, task: Any, reward_fn, raw_reward=None, reward_name: str = "reward") -> None:
        self.task, self._reward = task, reward_fn
        self.raw_reward = raw_reward or reward_fn  # unchecked: the reward pool checks values and names the plugin
        self.reward_name = reward_name

    def __getattr__(self, name: str) -> Any:
        return getattr(self.task, name)

    def prompts(self, seed: int):
        return self.task.prompts(seed)

    def reward(self, prompt_item, response_text: str) -> float:
        return self._reward(prompt_item, response_text)


def answer_reward(fn):
    """A built-in reward fn(answer, response_text) as a task reward fn(prompt_item, response_text)."""

    def reward(prompt_item, response_text: str) -> float:
        return fn(getattr(prompt_item, "answer", None), response_text)

    return reward


def eval_prompts(task: Any, seed: int):
    """The task's held-out prompts for validation, or None when it has none."""
    method = getattr(task, "eval_prompts", None)
    return method(seed) if callable(method) else None


def load_task(task_cfg, data_dir=None) -> Any:
    """Build the task of `cfg.task` (a TaskSection). data_dir: RUN_DIR/data, where a dataset task's rows were frozen."""
    name, params = task_cfg.name, dict(task_cfg.params)
    params = {k: v for k, v in params.items() if k not in CODE_PARAMS}  # the code reward's limits, not the task's
    if name in BUILTIN_TASKS:
        if name == "dataset":
            params["data_dir"] = data_dir
        try:
            task = BUILTIN_TASKS[name](**params)
        except TypeError as exc:
            raise TaskError(f"task.params for built-in task '{name}': {exc}") from None
        except ValueError as exc:
            raise TaskError(f"task.params for built-in task '{name}': {exc}") from None
    elif name.startswith(GYM_PREFIX):
        env_id = name[len(GYM_PREFIX) :]
        try:
            task = gym_task(env_id, builtin_adapter=builtin_adapter(env_id), **params)
        except TypeError as exc:
            raise TaskError(
                f"task.params for '{name}': {exc} (it takes adapter, max_turns, invalid_penalty, env_kwargs)"
            ) from None
    elif is_plugin_spec(name):
        task = _task_from_plugin(name, params)
    else:
        raise TaskError(
            f"task.name '{name}' is not a built-in task ({', '.join(BUILTIN_TASKS)}), a gymnasium environment "
            "'gym:ENV_ID', nor a plugin; name a plugin as 'package.module:attr' or 'path/to/file.py:attr'"
        )
    spec = task_cfg.reward
    domains = getattr(task, "domain_rewards", None)  # a mixed dataset: one reward per source
    if domains:
        return _mixed_reward_task(task, task_cfg, domains)
    if not spec:
        if name in NEEDS_REWARD:
            raise TaskError(
                f"task.name '{name}' needs task.reward: math (math-verify: \\boxed{{}}, LaTeX, numbers, "
                "GSM8K '#### 42' answers), exact, regex:PATTERN, or a plugin 'file.py:fn'"
            )
        return task
    if is_multi_turn(task):
        raise TaskError(
            f"task.reward overrides the reward of single-turn tasks; '{name}' is multi-turn "
            "(its environment's step() gives the rewards)"
        )
    raw, who = _reward_fn(spec, task_cfg, "task.reward")
    return CheckedRewardTask(task, checked_reward_fn(raw, who), raw, who)


def _reward_fn(spec: str, task_cfg, field: str):
    """(unchecked reward fn(prompt_item, text), its name for messages) of a reward spec: built-in or plugin."""
    who = f"{field} '{spec}'"
    if is_builtin_reward(spec):
        fn = builtin_reward(spec, task_cfg.format_reward, task_cfg.format_pattern, task_cfg.params)
        return answer_reward(fn), who
    if not is_plugin_spec(spec):
        raise TaskError(
            f"{who} is neither a built-in reward (math, exact, regex:PATTERN) nor a plugin "
            "('package.module:fn' or 'path/to/file.py:fn')"
        )
    return load_plugin(spec, field), who


class DomainReward:
    """A mixed dataset's reward: the reward of the prompt's source (Prompt.domain; None: the task.reward-scored
    single held-out file)."""

    def __init__(self, by_domain: dict) -> None:
        self.by_domain = by_domain

    def __call__(self, prompt_item, response_text: str):
        return self.by_domain[getattr(prompt_item, "domain", None)](prompt_item, response_text)


def _mixed_reward_task(task: Any, task_cfg, specs: dict) -> CheckedRewardTask:
    raw, checked, names = {}, {}, []
    for domain, own in specs.items():
        spec = own or task_cfg.reward
        if not spec:
            raise TaskError(
                f"task.params.train source '{domain}' has no reward: give it reward: (math, exact, regex:PATTERN or a "
                "plugin) or set task.reward, the default of every source"
                if domain is not None
                else "task.params.val is one file for a mixture of sources, so it is scored with task.reward; set "
                "task.reward, or give val as a list of sources {name, path} named after the training sources"
            )
        field = f"task.params.train[{domain}].reward" if own else "task.reward"
        raw[domain], who = _reward_fn(spec, task_cfg, field)
        checked[domain] = checked_reward_fn(raw[domain], who)
        names.append(f"{domain or 'val'}: {spec}")
    return CheckedRewardTask(task, DomainReward(checked), DomainReward(raw), f"the rewards ({', '.join(names)})")


def check_task(cfg) -> Any:
    """Load cfg's task as the ranks will (reading and checking a dataset's files) and check that the eval
    section can run on it. Raises TaskError / DatasetError / PluginError naming the field or file."""
    task = load_task(cfg.task)
    if not is_multi_turn(task) and cfg.task.env != type(cfg.task.env)():
        raise TaskError(
            f"task.env sets how multi-turn episodes are played; '{cfg.task.name}' is single-turn (remove task.env)"
        )
    if not is_multi_turn(task) and (cfg.envs.workers or cfg.envs.nodes):
        raise TaskError(
            f"envs places a multi-turn task's environments (workers, nodes); '{cfg.task.name}' is single-turn and has "
            "none: remove envs (reward functions run in worker processes of their own already)"
        )
    if not is_multi_turn(task) and cfg.algorithm.step_advantage_weight:
        raise TaskError(
            f"algorithm.step_advantage_weight compares the turns of multi-turn episodes; '{cfg.task.name}' is "
            "single-turn (one turn per sample: its episode-level advantage is all there is): set it to 0"
        )
    if is_multi_turn(task) and cfg.warmup.sft_steps and not callable(getattr(task, "demonstration", None)):
        raise TaskError(
            f"warmup.sft_steps on multi-turn task '{cfg.task.name}' trains on demonstrations, but it has no "
            "demonstration(item) method (the replies that solve an item; the built-in sokoban has one): add one, or "
            "set warmup.sft_steps: 0"
        )
    # Multi-turn only (a single-turn task never waits on an environment, whatever run.hang_timeout is).
    hang, step = cfg.run.hang_timeout, cfg.task.env.step_timeout
    if is_multi_turn(task) and hang and step >= hang:  # a hung environment would look like a hung rank: job ends
        raise TaskError(
            f"task.env.step_timeout ({step:g} s) must be below run.hang_timeout ({hang:g} s): an environment that "
            "hangs should end its episode, not the job; lower task.env.step_timeout or raise run.hang_timeout"
        )
    if cfg.rewards.models and is_multi_turn(task):
        raise TaskError(
            f"rewards.models score single-turn samples; '{cfg.task.name}' is multi-turn (its environment gives the "
            "reward): remove rewards.models, or score episodes in the environment's step()"
        )
    for spec in cfg.rewards.models:
        check_reward_model(spec)
    if cfg.eval is not None:
        rows = eval_prompts(task, cfg.run.seed)
        if rows is None or len(rows) == 0:
            raise TaskError(
                f"eval: task '{cfg.task.name}' has no held-out prompts; for a dataset set task.params.val "
                "(a file) or task.params.val_fraction (a seeded split of train), or remove the eval: section"
            )
    return task


def _task_from_plugin(spec: str, params: dict) -> Any:
    obj = load_plugin(spec, "task.name")
    who = f"task.name '{spec}'"
    # A class or function is a factory; anything else with prompts() is a ready task object.
    is_factory = isinstance(obj, type) or (callable(obj) and not hasattr(obj, "prompts"))
    if not is_factory and hasattr(obj, "prompts"):
        if params:
            raise PluginError(
                f"{who} is a ready task object, so task.params ({', '.join(params)}) cannot be applied; "
                "export a class or factory function instead"
            )
        task = obj
    elif is_factory:
        try:
            task = obj(**params)
        except TypeError as exc:
            raise PluginError(f"{who}: calling it with task.params {params} failed: {exc}") from None
        if is_gym_env(task):  # a gymnasium.Env factory: every episode gets a fresh one
            return wrap_gym_env(
                obj, task, params, who, builtin_adapter(getattr(getattr(task, "spec", None), "id", None))
            )
    else:
        raise PluginError(f"{who} is a {type(obj).__name__}; export a task object, class or factory function")
    if not callable(getattr(task, "prompts", None)):
        raise PluginError(f"{who} gave a {type(task).__name__} without a prompts(seed) method; see docs/plugins.md")
    if is_multi_turn(task):
        return task
    if not callable(getattr(task, "reward", None)):
        raise PluginError(
            f"{who} gave a {type(task).__name__} with neither reward(prompt, response_text) "
            "nor make_env(); see docs/plugins.md"
        )
    return CheckedRewardTask(task, checked_reward_fn(task.reward, f"{who} reward()"), task.reward, f"{who} reward()")
