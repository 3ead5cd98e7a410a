"""task.reward_workers: 0 (rewards/inline.py): the generator rank scores in its own process, with RewardPool's
results and messages, and a run trains to the same weights as with reward worker processes."""

from __future__ import annotations

import pytest
from test_resume_local import cli, weights_digest, write_run_config

from rollout_hpc.errors import RewardFatal, UserError
from rollout_hpc.rewards import REWARD_ERROR, REWARD_OK, RewardPool
from rollout_hpc.rewards.inline import InlineScorer


def _both(factory: str, **kwargs):
    return InlineScorer(factory, **kwargs), RewardPool(factory, n_workers=1, timeout_s=5.0, **kwargs)


@pytest.mark.parametrize(
    "factory, args, jobs",
    [
        ("reward_plugins:correct", (0.5,), [(i, str(i) if i % 2 else "no") for i in range(20)]),
        ("reward_plugins:flaky", (), [(i, "") for i in range(10)]),  # every third raises: an error, not the end
        ("rollout_hpc.rewards.verifiers:reward_factory", ("exact",), [("12", "12"), ("12", " 12."), ("12", "13")]),
    ],
)
def test_inline_scores_as_the_pool_does(factory, args, jobs):
    inline, pool = _both(factory, args=args)
    with pool:
        assert inline.score(jobs) == pool.score(jobs)
    statuses = {r.status for r in inline.score(jobs)}
    assert REWARD_OK in statuses
    if factory.endswith("flaky"):
        assert REWARD_ERROR in statuses and inline.stats()["errors"] == 2 * 4  # two calls, keys 0, 3, 6, 9
    assert inline.pids == [] and inline.score([]) == []


@pytest.mark.parametrize(
    "factory, jobs, match",
    [
        ("reward_plugins:nan_reward", [("ok", "x"), ("nan", "the response")], r"returned nan; a reward must be finite"),
        ("reward_plugins:wrong_type", [(1, "x")], r"returned str 'one'; a reward must be a float"),
    ],
)
def test_a_value_no_run_may_train_on_is_fatal_with_the_pools_message(factory, jobs, match):
    inline, pool = _both(factory, name="task.reward 'x'")
    with pool, pytest.raises(RewardFatal) as by_pool:
        pool.score(jobs)
    with pytest.raises(RewardFatal, match=match) as by_inline:
        inline.score(jobs)
    assert str(by_inline.value) == str(by_pool.value) and isinstance(by_inline.value, UserError)


@pytest.mark.parametrize(
    "factory, expected",
    [
        ("reward_plugins:broken_factory", "RuntimeError: cannot load the reward model"),
        ("reward_plugins:not_callable", "not fn(key, text)"),
        ("no_such_module_xyz:fn", "module 'no_such_module_xyz' not found"),
    ],
)
def test_a_failing_factory_is_fatal_at_construction_naming_it(factory, expected):
    with pytest.raises(RewardFatal) as err:
        InlineScorer(factory, name="task.reward")
    assert "task.reward" in str(err.value) and factory.split(":")[0] in str(err.value) and expected in str(err.value)


def test_a_run_scoring_in_the_generator_rank_trains_the_weights_of_one_with_reward_workers(finished_run, tmp_path):
    """The session's finished 4-step run scored in two reward worker processes; the same run scored inline."""
    done = cli(
        "submit",
        write_run_config(tmp_path, "run", steps=4, sleep=0.0),
        "--local",
        "--run-dir",
        tmp_path / "run",
        "--set",
        "task.reward_workers=0",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert weights_digest(tmp_path / "run") == weights_digest(finished_run)
