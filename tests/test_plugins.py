"""Plugins written by a user into tmp_path: rewards and tasks load, and every failure names the plugin."""

import sys
import textwrap

import pytest

from rollout_hpc.config import ConfigError, TaskSection
from rollout_hpc.envs import Prompt, is_multi_turn, load_task
from rollout_hpc.plugins import PluginError, load_plugin, load_reward


def write(tmp_path, name, body):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def test_reward_file_overrides_the_task_reward(tmp_path):
    path = write(
        tmp_path,
        "my_reward.py",
        """
        def length_reward(prompt_item, response_text):
            # reward short answers that start with the right digit
            return 0.5 if response_text[:1] == prompt_item.answer[:1] else 0.0
    """,
    )
    task = load_task(TaskSection(name="arithmetic", reward=f"{path}:length_reward"))
    p = Prompt("3+4=", answer="7")
    assert task.reward(p, "7") == 0.5 and task.reward(p, "1") == 0.0
    assert task.prompts(0)[0] == load_task(TaskSection(name="arithmetic")).prompts(0)[0]


def test_task_plugin_from_a_module_with_params(tmp_path, monkeypatch):
    write(
        tmp_path,
        "echo_task.py",
        """
        class EchoTask:
            def __init__(self, word="hi"):
                self.word = word
            def prompts(self, seed):
                return [f"say {self.word}:", f"again {self.word}:"]
            def reward(self, prompt, response_text):
                return int(response_text == self.word)  # ints are accepted as rewards
    """,
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    task = load_task(TaskSection(name="echo_task:EchoTask", params={"word": "yo"}))
    assert task.prompts(0)[1] == "again yo:"
    assert task.reward("say yo:", "yo") == 1.0 and isinstance(task.reward("x", "no"), float)
    sys.modules.pop("echo_task", None)


def test_multi_turn_plugin(tmp_path):
    path = write(
        tmp_path,
        "guess.py",
        """
        class Guess:
            max_turns = 3
            def reset(self, item):
                self.target = item
                return "guess a digit"
            def step(self, action_text):
                ok = action_text.strip() == self.target
                return ("yes" if ok else "no"), float(ok), ok, {}
        class GuessTask:
            def prompts(self, seed):
                return ["1", "2", "3"]
            def make_env(self):
                return Guess()
    """,
    )
    task = load_task(TaskSection(name=f"{path}:GuessTask"))
    assert is_multi_turn(task)
    env = task.make_env()
    env.reset(task.prompts(0)[1])
    assert env.step("2") == ("yes", 1.0, True, {})


def test_errors_name_the_plugin(tmp_path):
    assert issubclass(PluginError, ConfigError)  # printed as one line by the entry point
    missing = tmp_path / "nope.py"
    with pytest.raises(PluginError, match=rf"task.reward '{missing}:f'.*not found"):
        load_task(TaskSection(name="arithmetic", reward=f"{missing}:f"))
    with pytest.raises(PluginError, match="module 'no_such_pkg_xyz' not found"):
        load_plugin("no_such_pkg_xyz.mod:f", "task.reward")

    broken = write(tmp_path, "broken.py", "import math\nraise RuntimeError('boom at import')\n")
    with pytest.raises(PluginError, match=rf"'{broken}:f'.*RuntimeError: boom at import"):
        load_reward(f"{broken}:f")

    ok = write(
        tmp_path,
        "rewards.py",
        """
        def good(p, r):
            return 1.0
        def wrong_type(p, r):
            return "1.0"
        def nan(p, r):
            return float("nan")
        NOT_A_FUNCTION = 3
    """,
    )
    with pytest.raises(
        PluginError, match=r"has no attribute 'missing' \(it defines: NOT_A_FUNCTION, good, nan, wrong_type\)"
    ):
        load_reward(f"{ok}:missing")
    with pytest.raises(
        PluginError, match=rf"task.reward '{ok}:wrong_type' returned str '1.0'; a reward must be a float"
    ):
        load_reward(f"{ok}:wrong_type")("p", "r")
    with pytest.raises(PluginError, match="must be finite"):
        load_reward(f"{ok}:nan")("p", "r")
    with pytest.raises(PluginError, match="is a int, not a function"):
        load_reward(f"{ok}:NOT_A_FUNCTION")
    with pytest.raises(PluginError, match="expected 'package.module:attr'"):
        load_reward(f"{ok}:")

    not_task = write(
        tmp_path,
        "not_task.py",
        """
        class NoPrompts:
            def reward(self, p, r):
                return 0.0
        class NoReward:
            def prompts(self, seed):
                return ["a"]
        def takes_nothing():
            return NoReward()
    """,
    )
    with pytest.raises(PluginError, match=rf"task.name '{not_task}:NoPrompts' gave a NoPrompts without a prompts"):
        load_task(TaskSection(name=f"{not_task}:NoPrompts"))
    with pytest.raises(PluginError, match="neither reward"):
        load_task(TaskSection(name=f"{not_task}:NoReward"))
    with pytest.raises(PluginError, match=r"takes_nothing' *: calling it with task.params \{'x': 1\} failed"):
        load_task(TaskSection(name=f"{not_task}:takes_nothing", params={"x": 1}))
