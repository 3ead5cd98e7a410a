"""generator.extra_prompts: sample-level rollout scheduling. The prompt sampler's rule (candidates, retries, the
checks the trainers apply), the choice of the groups that finish first, the config's refusals, and real runs: a run
with extra prompts stopped and resumed trains every prompt of the stream at most once, retries each deferred prompt
at the next step, and ends with the same weights as the same run never stopped."""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_resume_local import GROUP, PROMPTS, cli, logged_uids, stop_and_resume, weights_digest, write_run_config

from rollout_hpc.config import ConfigError, load_config
from rollout_hpc.envs.registry import TaskError, check_task
from rollout_hpc.runtime.rollout_scheduler import PromptSampler, pick_groups
from rollout_hpc.store.trajlog import TrajectoryReader


def play(sampler: PromptSampler, steps: int, rng: np.random.Generator) -> list[tuple[np.ndarray, np.ndarray]]:
    """Run the rule for `steps` steps, the fresh groups finishing in a random order: (the step's retries, what it
    trained) per step, every rank's together."""
    history = []
    for _ in range(steps):
        trained, retries = {}, []
        for rank in range(sampler.n_ranks):
            retry, fresh = sampler.candidates(rank)
            need = sampler.quotas[rank] - len(retry)
            trained[rank] = np.concatenate([retry, rng.permutation(fresh)[:need]])
            retries.append(retry)
        sampler.advance(trained)
        history.append((np.concatenate(retries), np.concatenate(list(trained.values()))))
    return history


@pytest.mark.parametrize(("prompts", "extra", "ranks"), [(4, 2, 1), (5, 3, 2), (3, 3, 3), (2, 1, 3)])
def test_every_prompt_is_trained_once_and_a_deferred_one_at_the_next_step(prompts, extra, ranks):
    sampler = PromptSampler(prompts, extra, ranks)
    history = play(sampler, 12, np.random.default_rng(0))
    trained = np.concatenate([ids for _, ids in history])
    assert len(trained) == len(set(trained.tolist())) == 12 * prompts  # each once, P a step
    # Nothing is skipped: every prompt below the cursor is trained, or is one of the retries still owed.
    owed = np.concatenate(sampler.retries)
    assert sorted([*trained.tolist(), *owed.tolist()]) == list(range(sampler.cursor))
    assert len(owed) == extra
    for s, (retries, ids) in enumerate(history):
        assert set(retries.tolist()) <= set(ids.tolist())  # the step trains every retry it owes
        if s:  # and those are exactly the prompts the step before left out
            before = set(range(max(history[s - 1][1]) + 1)) - set(np.concatenate([t for _, t in history[:s]]).tolist())
            assert before <= set(retries.tolist())


def test_the_trainers_refuse_a_choice_that_breaks_the_rule():
    sampler = PromptSampler(4, 2, 1)
    with pytest.raises(ValueError, match="its share is 4"):
        sampler.advance({0: np.arange(3)})
    with pytest.raises(ValueError, match="not its to run"):
        sampler.advance({0: np.array([0, 1, 2, 9])})
    sampler.advance({0: np.array([0, 1, 2, 5])})  # 3 and 4 deferred
    assert sampler.candidates(0)[0].tolist() == [3, 4]
    with pytest.raises(ValueError, match=r"retried prompts \[4\] are missing"):
        sampler.advance({0: np.array([3, 6, 7, 8])})


def test_the_state_survives_a_checkpoint_the_weight_sync_and_a_new_generator_count():
    cfg = load_config(None, ["generator.extra_prompts=3", "algorithm.prompts_per_step=6", "generator.tasks_per_node=2"])
    sampler = PromptSampler.for_config(cfg)
    play(sampler, 3, np.random.default_rng(1))
    again = PromptSampler.for_config(cfg)
    again.load_state_dict(sampler.state_dict())
    sent = PromptSampler.from_meta(cfg, json.loads(json.dumps(sampler.meta())))
    for other in (again, sent):
        assert other.cursor == sampler.cursor
        assert [r.tolist() for r in other.retries] == [r.tolist() for r in sampler.retries]
    one = PromptSampler(6, 3, 1)  # resumed with one generator rank instead of two: it owes every retry
    one.load_state_dict(sampler.state_dict())
    assert sorted(one.retries[0].tolist()) == sorted(np.concatenate(sampler.retries).tolist())
    play(one, 2, np.random.default_rng(2))
    narrow = PromptSampler(2, 2, 1)  # one rank owing 2 retries, then three ranks sharing P=2 (quotas 1, 1, 0)
    play(narrow, 1, np.random.default_rng(3))
    wide = PromptSampler(2, 2, 3)
    wide.load_state_dict(narrow.state_dict())
    assert [len(r) for r in wide.retries] == [1, 1, 0]
    play(wide, 3, np.random.default_rng(4))


def test_the_step_takes_the_groups_that_finish_first():
    G = 2
    done = np.full(5 * G, -1)  # group 0 is a retry; the step needs 3 groups
    done[2:4] = 5  # fresh group 1 done at token 5
    done[8:10] = 2  # fresh group 4 done at token 2
    assert pick_groups(done, G, n_retries=1, quota=3) is None  # the retry is still generating
    done[0:2] = 9
    assert pick_groups(done, G, 1, 3).tolist() == [0, 1, 4]
    done[4] = 1  # group 2: one sample done, the other not: not finished
    assert pick_groups(done, G, 1, 3).tolist() == [0, 1, 4]
    done[6:8] = 2  # group 3 ties with group 4 at token 2: stream order decides
    assert pick_groups(done, G, 1, 3).tolist() == [0, 3, 4]
    assert pick_groups(np.full(4, -1), G, 0, 1) is None


@pytest.mark.parametrize(
    ("overrides", "names"),
    [
        (["generator.extra_prompts=9"], "more than algorithm.prompts_per_step"),
        (["generator.extra_prompts=2", "exchange.max_staleness=1"], "exchange.max_staleness is 1"),
        (["generator.extra_prompts=2", "algorithm.name=dapo"], "dynamic sampling"),
        (["generator.extra_prompts=2", "algorithm.dynamic_sampling=true"], "dynamic_sampling: true"),
        (
            ["generator.extra_prompts=2", "generator.backend=vllm", "generator.gpus_per_task=1"],
            "backend 'vllm' has no such abort",
        ),
    ],
)
def test_extra_prompts_refuses_what_it_cannot_do(overrides, names):
    with pytest.raises(ConfigError, match=names):
        load_config(None, overrides)


def test_extra_prompts_refuses_a_multi_turn_task():
    cfg = load_config(None, ["generator.extra_prompts=1", "task.name=frozenlake"])
    with pytest.raises(TaskError, match="multi-turn"):
        check_task(cfg)


EXTRA = "generator: {extra_prompts: 1}"
STEPS = 9


def trained_by_step(run_dir) -> dict[int, set[int]]:
    with TrajectoryReader(run_dir) as r:
        steps, prompts = r.column("step"), r.column("prompt_id")
    return {int(s): set(prompts[steps == s].tolist()) for s in np.unique(steps)}


def test_a_run_with_extra_prompts_stopped_and_resumed_trains_each_prompt_once_like_one_never_stopped(tmp_path):
    # A random policy whose answers end at any of 36 characters (a stop string each: ~0.36 a token) and run to at most
    # 6: groups finish at different tokens, so which ones a step takes is a real choice.
    stops = list("0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ")
    extra = (
        f"{EXTRA}\nalgorithm: {{steps: {STEPS}, prompts_per_step: {PROMPTS}, group_size: {GROUP}, max_new_tokens: 6, "
        f"stop: {json.dumps(stops)}}}"
    )
    whole = tmp_path / "whole"
    config = write_run_config(tmp_path, "whole", STEPS, extra=extra)
    done = cli("submit", config, "--local", "--run-dir", whole, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "aborted" in (whole / "logs" / "local-0.out").read_text()  # the generator says how many samples it cut off
    cut = tmp_path / "cut"
    stop_and_resume(write_run_config(tmp_path, "cut", STEPS, extra=extra), cut, 3, tmp_path, steps=STEPS)

    for run in (whole, cut):
        rows = logged_uids(run)
        assert len(rows) == len(set(rows)) == STEPS * PROMPTS * GROUP  # every sample once, P groups a step
        by_step = trained_by_step(run)
        trained = [p for s in sorted(by_step) for p in by_step[s]]
        assert len(trained) == len(set(trained))  # no prompt trained twice
        # Nothing skipped: the prompts below the highest trained are all trained, but the one deferred at the end.
        assert len(set(range(max(trained) + 1)) - set(trained)) <= 1
        passed_over = []
        for s in range(1, STEPS):  # a prompt passed over at step s-1 (below its highest) is trained at step s
            skipped = set(range(max(by_step[s - 1]))) - set().union(*(by_step[k] for k in range(s)))
            assert skipped <= by_step[s], (s, skipped, by_step[s])
            passed_over += skipped
        assert passed_over  # a later prompt finished first at some step: the choice depended on the lengths
    assert trained_by_step(cut) == trained_by_step(whole)  # the HF backend on a CPU chooses deterministically
    assert weights_digest(cut) == weights_digest(whole)
    with TrajectoryReader(cut) as r:
        m = r.metrics()
    assert m["deferred_prompts"].tolist() == [1.0] * STEPS  # logged each step
    assert m["retried_prompts"].tolist() == [0.0] + [1.0] * (STEPS - 1)
