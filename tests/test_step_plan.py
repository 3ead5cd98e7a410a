"""The step -> prompts plan, with and without dynamic sampling's refill rounds (runtime.step_plan)."""

from __future__ import annotations

import numpy as np
import pytest

from rollout_hpc.config import load_config
from rollout_hpc.runtime.step_plan import StepPlan, informative_groups, rank_share
from rollout_hpc.trajectory import TrajectoryBatch


def test_without_refills_a_step_is_its_prompts_per_step_block():
    plan = StepPlan(step=5, prompts_per_step=8)
    assert plan.done and plan.prompts == range(40, 48) and plan.round == range(40, 48)


def test_refill_rounds_ask_for_the_missing_groups_from_the_steps_own_block():
    plan = StepPlan(step=2, prompts_per_step=4, max_rounds=3)  # block [24, 36)
    assert plan.round == range(24, 28) and not plan.done
    assert plan.advance(1)  # 3 groups missing
    assert plan.round == range(28, 31)
    assert plan.advance(2)  # 1 missing
    assert plan.round == range(31, 32)
    assert not plan.advance(0)  # out of rounds: train on the 3 informative groups
    assert plan.done and plan.rounds == 3 and plan.informative == 3
    assert plan.prompts == range(24, 32) and plan.prompts.stop <= plan.block_end == 36
    with pytest.raises(RuntimeError):
        plan.advance(1)


def test_a_full_first_round_needs_no_refill():
    plan = StepPlan(step=0, prompts_per_step=4, max_rounds=3)
    assert not plan.advance(4) and plan.prompts == range(0, 4) and plan.rounds == 1


def test_rank_shares_cover_a_round_once():
    shares = [rank_share(range(28, 31), r, 2) for r in range(2)]
    assert [s.tolist() for s in shares] == [[28, 29], [30]]
    assert rank_share(range(31, 32), 1, 2).tolist() == []


def _batch(rewards, lengths, group_size):
    return TrajectoryBatch.from_records(
        [
            {"prompt_id": i // group_size, "sample_idx": i % group_size, "reward": r, "response_ids": [1] * n}
            for i, (r, n) in enumerate(zip(rewards, lengths))
        ]
    )


def test_informative_groups_use_the_shaped_rewards():
    cfg = load_config(
        None,
        ["algorithm.name=dapo", "algorithm.group_size=2", "algorithm.max_new_tokens=4", "algorithm.overlong_buffer=2"],
    )
    # Group 0: equal rewards and lengths -> no signal. Group 1: different rewards. Group 2: equal task rewards,
    # but one response runs into the overlong buffer, so the shaped rewards differ.
    batch = _batch([1, 1, 0, 1, 0, 0], [1, 1, 1, 1, 1, 4], group_size=2)
    assert informative_groups(cfg, batch) == 2
    assert informative_groups(cfg, batch.select(np.array([2, 3, 0, 1]))) == 1  # row order does not matter
