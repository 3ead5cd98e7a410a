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
from rollout_hpc.runtime.rollout_scheduler import PromptSampler, pick_groups
from rollout_hpc.store.trajlog import TrajectoryReader


def play(sampler: PromptSampler, steps: int, rng: np.random.Generator) -> list[tuple[np.ndarray, np.ndarray]]:
    """Run the rule for `steps` steps, the fresh groups finishing in a random order: (the step's retries, what it
    trained) per step, every rank's together. Each source of a mixture fills its own quota."""
    history, source = [], sampler.layout.domain_of
    for _ in range(steps):
        trained, retries = {}, []
        for rank in range(sampler.n_ranks):
            retry, fresh = sampler.candidates(rank)
            took = [retry]
            for k, quota in enumerate(sampler.source_quotas[rank]):
                need = quota - int((source(retry) == k).sum())
                took.append(rng.permutation(fresh[source(fresh) == k])[:need])
            trained[rank] = np.concatenate(took)
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
    assert sorted([*trained.tolist(), *owed.tolist()]) == list(range(sampler.cursors[0]))
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


def play_dynamic(sampler: PromptSampler, steps: int, rng: np.random.Generator, p_informative: float):
    """The rule with dynamic sampling: each rank takes its retries, then fresh groups in a random finishing order
    until its quota of those taken are informative (all of them if they never are). Returns per step
    (what it took, which of those were informative) and checks the trainers accept it."""
    history = []
    for _ in range(steps):
        took, informative, ok = {}, {}, []
        for rank in range(sampler.n_ranks):
            retry, fresh = sampler.candidates(rank)
            order = np.concatenate([retry, rng.permutation(fresh)])
            good = rng.random(len(order)) < p_informative
            done = np.arange(len(order)) < len(retry)
            need = sampler.quotas[rank] - int(good[: len(retry)].sum())
            for j in range(len(retry), len(order)):
                if need <= 0:
                    break
                done[j], need = True, need - int(good[j])
            took[rank], informative[rank] = order[done], int(good[done].sum())
            ok.append(order[done & good])
        sampler.advance(took, informative)
        history.append((np.concatenate(list(took.values())), np.concatenate(ok)))
    return history


@pytest.mark.parametrize(("prompts", "extra", "ranks", "p"), [(4, 2, 1, 0.5), (5, 3, 2, 0.7), (3, 3, 3, 0.2)])
def test_with_dynamic_sampling_each_prompt_is_taken_once_and_a_step_trains_its_quota_of_informative_groups(
    prompts, extra, ranks, p
):
    sampler = PromptSampler(prompts, extra, ranks)
    history = play_dynamic(sampler, 12, np.random.default_rng(0), p)
    took = np.concatenate([t for t, _ in history])
    assert len(took) == len(set(took.tolist()))  # taken once: trained, or dropped as uninformative, never retried
    owed = np.concatenate(sampler.retries)
    assert len(owed) <= extra
    assert sorted([*took.tolist(), *owed.tolist()]) == list(range(sampler.cursors[0]))  # nothing skipped
    assert all(len(ok) <= prompts for _, ok in history)  # never more informative groups than the step trains
    assert any(len(t) > prompts for t, _ in history)  # dropped groups were replaced within the step


def test_with_dynamic_sampling_the_trainers_check_the_informative_count():
    sampler = PromptSampler(2, 2, 1)  # candidates 0..3
    with pytest.raises(ValueError, match="1 informative groups among the 2 prompts taken, its share is 2"):
        sampler.advance({0: np.array([0, 1])}, {0: 1})
    sampler.advance({0: np.array([0, 1, 3])}, {0: 2})  # 0 dropped, 1 and 3 trained, 2 deferred
    assert sampler.candidates(0)[0].tolist() == [2]
    sampler.advance({0: np.array([2, 4, 5, 6])}, {0: 0})  # none informative: it took all its candidates
    assert sampler.cursors.tolist() == [7] and not len(sampler.retries[0])


def test_with_dynamic_sampling_a_rank_owing_less_than_its_share_keeps_its_retries_through_the_weight_sync():
    sampler = PromptSampler(5, 3, 2)  # rank 0: quota 3 + 2 extra (candidates 0..4), rank 1: 2 + 1 (5..7)
    sampler.advance({0: np.array([0, 1, 2, 3]), 1: np.array([5, 6])}, {0: 3, 1: 2})  # rank 0 dropped one group
    assert [r.tolist() for r in sampler.retries] == [[4], [7]]
    sent = PromptSampler(5, 3, 2)
    sent.load_state_dict(json.loads(json.dumps(sampler.meta())))
    assert [r.tolist() for r in sent.retries] == [[4], [7]]  # not dealt out again as if the ranks had changed
    one = PromptSampler(5, 3, 1)  # a resume with one generator rank: it owes both
    one.load_state_dict(sampler.state_dict())
    assert one.retries[0].tolist() == [4, 7]


def test_the_state_survives_a_checkpoint_the_weight_sync_and_a_new_generator_count():
    cfg = load_config(None, ["generator.extra_prompts=3", "algorithm.prompts_per_step=6", "generator.tasks_per_node=2"])
    sampler = PromptSampler.for_config(cfg)
    play(sampler, 3, np.random.default_rng(1))
    again = PromptSampler.for_config(cfg)
    again.load_state_dict(sampler.state_dict())
    sent = PromptSampler.from_meta(cfg, json.loads(json.dumps(sampler.meta())))
    for other in (again, sent):
        assert other.cursors.tolist() == sampler.cursors.tolist()
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


@pytest.mark.parametrize(
    ("quotas", "extra", "ranks"), [([3, 1], 2, 1), ([3, 1, 2], 3, 2), ([1, 4], 4, 3), ([2, 2], 1, 2)]
)
def test_a_mixture_keeps_each_sources_quota_and_trains_each_prompt_once(quotas, extra, ranks):
    sampler = PromptSampler(sum(quotas), extra, ranks, quotas)
    assert [sum(q) for q in sampler.source_quotas] == sampler.quotas  # each rank's slice of the block, by source
    assert [sum(x) for x in sampler.source_extras] == sampler.extras
    assert all(x <= q for qs, xs in zip(sampler.source_quotas, sampler.source_extras) for q, x in zip(qs, xs))
    history = play(sampler, 12, np.random.default_rng(len(quotas) + ranks))
    layout = sampler.layout
    for _, ids in history:  # every step trains each source's quota, whatever finished first
        assert np.bincount(layout.domain_of(ids), minlength=len(quotas)).tolist() == quotas
    trained = np.concatenate([ids for _, ids in history])
    assert len(trained) == len(set(trained.tolist()))
    owed = np.concatenate(sampler.retries)
    for k in range(len(quotas)):  # each source's own stream: every position below its cursor trained or owed
        mine = np.concatenate([trained, owed])
        positions = layout.split(mine[layout.domain_of(mine) == k])[1]
        assert sorted(positions.tolist()) == list(range(sampler.cursors[k]))
    # its state through the weight sync, and dealt out again over another generator count
    sent = PromptSampler(sum(quotas), extra, ranks, quotas)
    sent.load_state_dict(json.loads(json.dumps(sampler.meta())))
    assert sent.cursors.tolist() == sampler.cursors.tolist()
    assert [r.tolist() for r in sent.retries] == [r.tolist() for r in sampler.retries]
    other = PromptSampler(sum(quotas), extra, ranks % 3 + 1, quotas)
    other.load_state_dict(sampler.state_dict())
    assert sorted(np.concatenate(other.retries).tolist()) == sorted(owed.tolist())
    for rank, retry in enumerate(other.retries):  # no rank owes more of a source than it trains of it
        assert (np.bincount(layout.domain_of(retry), minlength=len(quotas)) <= other.source_quotas[rank]).all()
    play(other, 3, np.random.default_rng(5))
    with pytest.raises(ValueError, match="2 data sources, the config 1"):
        PromptSampler(sum(quotas), extra, ranks).load_state_dict(PromptSampler(4, 1, 1, [3, 1]).state_dict())


def test_a_mixtures_rule_is_checked_and_picked_per_source():
    sampler = PromptSampler(4, 2, 1, [2, 2])  # each source: quota 2 + 1 extra
    retry, fresh = sampler.candidates(0)
    assert not len(retry) and fresh.tolist() == [0, 1, 2, 3, 4, 6]  # sums 0, 1 and 4; words 2, 3 and 6
    with pytest.raises(ValueError, match="3 prompts of source 1 trained, its share is 2"):
        sampler.advance({0: np.array([0, 1, 2, 3, 6])})
    G = 2
    done = np.full(6 * G, -1)  # candidate groups in that order
    done[[0, 1, 2, 3, 8, 9]] = 1  # sums 0, 1 and 4 finished (a tie: stream order); no words yet
    assert sampler.pick(0, done, G) is None
    done[[10, 11]], done[[4, 5]] = 4, 3  # words 6, then words 2
    assert sampler.pick(0, done, G).tolist() == [0, 1, 2, 5]  # sums 0, 1; words 2, 6
    sampler.advance({0: np.array([0, 1, 2, 6])})
    retry, fresh = sampler.candidates(0)
    assert retry.tolist() == [3, 4] and fresh.tolist() == [5, 7, 8, 10]  # a retry of each source, then fresh
    # With dynamic sampling: a source is whole with its quota of informative groups, or all of its candidates.
    assert not sampler.share_complete(0, np.array([3, 4, 5]), np.array([2, 1]))
    assert sampler.share_complete(0, np.array([3, 4, 5, 7, 8, 10]), np.array([1, 2]))
    assert not sampler.share_complete(0, np.array([3, 4, 5, 7, 8]), np.array([1, 1]))  # words: 1 of 2, 2 of 3 held
    with pytest.raises(ValueError, match="1 informative groups among the 2 prompts of source 1 taken"):
        sampler.advance({0: np.array([3, 4, 5, 7])}, {0: np.array([2, 1])})


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


def test_with_dynamic_sampling_the_step_takes_finished_groups_until_enough_count():
    G = 2
    done = np.full(4 * G, -1)  # no retries; the step needs 2 informative groups
    informative = np.full(4, -1)
    done[0:2], done[4:6] = 1, 3  # group 0 done at token 1, group 2 at token 3
    informative[2] = 1
    assert pick_groups(done, G, 0, 2, informative) is None  # group 0 finished first but is not scored yet
    informative[0] = 0
    assert pick_groups(done, G, 0, 2, informative) is None  # 0 is dropped, 2 counts: one short
    done[6:8], informative[3] = 4, 1
    assert pick_groups(done, G, 0, 2, informative).tolist() == [0, 2, 3]  # the dropped group is taken too
    done[2:4], informative[1] = 8, 0  # all finished, too few informative: the step takes them all
    assert pick_groups(done, G, 0, 3, informative).tolist() == [0, 1, 2, 3]
    # A retry must be finished and scored; an informative one counts toward the quota.
    retried = np.array([5, 5, 2, 2, -1, -1])
    assert pick_groups(retried, G, 1, 2, np.array([-1, 1, -1])) is None
    assert pick_groups(retried, G, 1, 2, np.array([1, 1, -1])).tolist() == [0, 1]


@pytest.mark.parametrize(
    ("overrides", "names"),
    [
        (["generator.extra_prompts=9"], "more than algorithm.prompts_per_step"),
        (["generator.extra_prompts=2", "exchange.max_staleness=1"], "exchange.max_staleness is 1"),
        (
            ["generator.extra_prompts=2", "algorithm.name=dapo", "rewards.models=[{name: rm, path: x, kind: judge}]"],
            "rewards.models' scores are mixed in later",
        ),
        (
            ["generator.extra_prompts=2", "generator.backend=vllm", "generator.gpus_per_task=1"],
            "backend 'vllm' has no such abort",
        ),
    ],
)
def test_extra_prompts_refuses_what_it_cannot_do(overrides, names):
    with pytest.raises(ConfigError, match=names):
        load_config(None, overrides)


EXTRA = "generator: {extra_prompts: 1}"
STEPS = 9


def trained_by_step(run_dir) -> dict[int, set[int]]:
    with TrajectoryReader(run_dir) as r:
        steps, prompts = r.column("step"), r.column("prompt_id")
    return {int(s): set(prompts[steps == s].tolist()) for s in np.unique(steps)}


def assert_each_prompt_once_and_a_passed_over_one_next(run) -> None:
    """Every sample logged once, P groups a step; no prompt trained twice; nothing skipped; a prompt passed over at
    step s-1 (below the highest it trained) is trained at step s, and that happened (the choice depended on timing)."""
    rows = logged_uids(run)
    assert len(rows) == len(set(rows)) == STEPS * PROMPTS * GROUP
    by_step = trained_by_step(run)
    trained = [p for s in sorted(by_step) for p in by_step[s]]
    assert len(trained) == len(set(trained))
    assert len(set(range(max(trained) + 1)) - set(trained)) <= 1  # all below the highest but the last one deferred
    passed_over = []
    for s in range(1, STEPS):
        skipped = set(range(max(by_step[s - 1]))) - set().union(*(by_step[k] for k in range(s)))
        assert skipped <= by_step[s], (s, skipped, by_step[s])
        passed_over += skipped
    assert passed_over


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
        assert_each_prompt_once_and_a_passed_over_one_next(run)
    assert trained_by_step(cut) == trained_by_step(whole)  # the HF backend on a CPU chooses deterministically
    assert weights_digest(cut) == weights_digest(whole)
    with TrajectoryReader(cut) as r:
        m = r.metrics()
    assert m["deferred_prompts"].tolist() == [1.0] * STEPS  # logged each step
    assert m["retried_prompts"].tolist() == [0.0] + [1.0] * (STEPS - 1)


# Informative for about half of the groups: prompts with an odd answer score the parity of the response's length
# (a group of 4 ties there 1 time in 8), the others always 0 (never informative).
PARITY_REWARD = """
def reward(prompt, text):
    return float(len(text) % 2) if int(prompt.answer) % 2 else 0.0
"""


def test_dapo_with_extra_prompts_drops_uninformative_groups_as_they_finish_and_resumes_exactly(tmp_path):
    (tmp_path / "parity.py").write_text(PARITY_REWARD)
    stops = list("0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ")
    extra = (
        "generator: {extra_prompts: 2, tasks_per_node: 2}\n"  # two generator ranks: each applies the rule to its share
        f'task: {{name: arithmetic, params: {{max_operand: 4, ops: "+"}}, reward: "{tmp_path / "parity.py"}:reward"}}\n'
        f"algorithm: {{name: dapo, steps: {STEPS}, prompts_per_step: {PROMPTS}, group_size: {GROUP}, "
        f"max_new_tokens: 6, stop: {json.dumps(stops)}}}"
    )
    whole = tmp_path / "whole"
    done = cli(
        "submit", write_run_config(tmp_path, "whole", STEPS, extra=extra), "--local", "--run-dir", whole, cwd=tmp_path
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    cut = tmp_path / "cut"
    stop_and_resume(write_run_config(tmp_path, "cut", STEPS, extra=extra), cut, 3, tmp_path, steps=STEPS)

    for run in (whole, cut):
        rows = logged_uids(run)
        assert len(rows) == len(set(rows))  # every sample logged once
        by_step = trained_by_step(run)
        taken = [p for s in sorted(by_step) for p in by_step[s]]
        assert len(taken) == len(set(taken))  # a prompt is taken once: trained, or dropped and never retried
        assert len(set(range(max(taken) + 1)) - set(taken)) <= 2  # nothing skipped but the retries still owed
        with TrajectoryReader(run) as r:
            m = r.metrics()
            steps, prompts, rewards, ranks = (r.column(c) for c in ("step", "prompt_id", "reward", "gen_rank"))
        kept, dropped = m["groups_kept"], m["groups_dropped"]
        replaced = 0  # rank-steps that dropped a group and found an informative one after it
        for s in range(STEPS):
            assert kept[s] + dropped[s] == len(by_step[s])
            for rank in (0, 1):  # each generator rank: quota 1 and 1 extra prompt (2 candidates a step)
                mine = (steps == s) & (ranks == rank)
                groups = [rewards[mine & (prompts == p)] for p in np.unique(prompts[mine])]
                assert all(len(g) == GROUP for g in groups)
                informative = sum(np.ptp(g) > 0 for g in groups)  # what the trainer kept of them (the rest all tie)
                # Its one informative group, with the uninformative ones that finished before it; or, if it found
                # none, both of its candidates.
                assert informative == 1 or len(groups) == 2, (s, rank, [g.tolist() for g in groups])
                assert informative <= 1
                replaced += informative == 1 and len(groups) == 2
        assert replaced and (kept == PROMPTS).any()
    assert trained_by_step(cut) == trained_by_step(whole)
    assert weights_digest(cut) == weights_digest(whole)


def test_episodes_with_extra_prompts_take_the_groups_that_end_first_and_resume_exactly(tmp_path):
    # FrozenLake's episodes (a random policy: it falls in a hole, reaches the goal or runs out of turns) end after 1
    # to 4 turns: a group ends with its last episode, so which groups a step takes is a real choice.
    extra = (
        f"{EXTRA}\n"
        "task: {name: frozenlake, params: {size: 4}, env: {max_turns: 4, parallel_envs: 16}}\n"
        "model: {max_seq_len: 256}\n"
        f"algorithm: {{steps: {STEPS}, prompts_per_step: {PROMPTS}, group_size: {GROUP}, max_new_tokens: 1}}"
    )
    whole = tmp_path / "whole"
    config = write_run_config(tmp_path, "whole", STEPS, extra=extra)
    done = cli("submit", config, "--local", "--run-dir", whole, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "aborted" in (whole / "logs" / "local-0.out").read_text()  # episodes were abandoned unfinished
    cut = tmp_path / "cut"
    stop_and_resume(write_run_config(tmp_path, "cut", STEPS, extra=extra), cut, 3, tmp_path, steps=STEPS)
    for run in (whole, cut):
        assert_each_prompt_once_and_a_passed_over_one_next(run)
        with TrajectoryReader(run) as r:
            assert (r.column("n_turns") >= 1).all()  # whole episodes only: an abandoned one is never logged
    assert trained_by_step(cut) == trained_by_step(whole)
    assert weights_digest(cut) == weights_digest(whole)
