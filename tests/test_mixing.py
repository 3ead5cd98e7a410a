"""Multi-domain mixing of the dataset task (task.params.train as a list of sources): per-step quotas, per-source
epoch-shuffled streams whose cursors follow from the step, per-source rewards in the reward pool, per-domain
normalisation, dynamic sampling refilled per source, per-domain metrics and analysis. The end-to-end runs are real
(`rollout-hpc submit/resume --local`, mpirun, the built-in tiny model)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from test_resume_local import cli

from rollout_hpc import algos
from rollout_hpc.config import load_config, mixture_quotas
from rollout_hpc.envs.datafile import QuotaLayout
from rollout_hpc.envs.registry import TaskError, load_task
from rollout_hpc.runtime.step_plan import StepPlan, informative_groups
from rollout_hpc.store.checkpoint import load_latest_valid, weights_digest
from rollout_hpc.store.trajlog import TrajectoryLog, TrajectoryReader
from rollout_hpc.trajectory import TrajectoryBatch

# words' reward plugin: a constant that says whether the prompt arrived tagged with its source
WORDS_REWARD = """
def reward(prompt, text):
    return 0.75 if prompt.domain == "words" else 0.25
"""


def write_data(directory: Path, n_sums: int = 10, n_words: int = 2) -> None:
    rows = [{"prompt": f"{i % 5}+{i // 5}=", "answer": str(i % 5 + i // 5)} for i in range(n_sums)]
    (directory / "sums.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    words = [{"q": f"say {w}", "a": w} for w in ("cat", "dog", "sun", "sky")[:n_words]]
    (directory / "words.jsonl").write_text("".join(json.dumps(r) + "\n" for r in words))
    (directory / "sums_val.jsonl").write_text(json.dumps({"prompt": "2+2=", "answer": "4"}) + "\n")
    (directory / "words_val.jsonl").write_text(json.dumps({"q": "say red", "a": "red"}) + "\n")
    (directory / "words_reward.py").write_text(WORDS_REWARD)


def write_config(
    directory: Path,
    name: str,
    *,
    steps: int,
    weights=(3, 1),
    algorithm: str = "",
    extra: str = "",
    max_new_tokens: int = 2,
) -> Path:
    d = directory.parent if directory.name in ("a", "b") else directory
    path = directory / f"{name}.yaml"
    path.write_text(f"""
run: {{name: {name}, seed: 1}}
launcher: local
task:
  name: dataset
  reward: exact
  params:
    train:
      - {{name: sums, path: {d / "sums.jsonl"}, weight: {weights[0]}}}
      - {{name: words, path: {d / "words.jsonl"}, weight: {weights[1]}, reward: "{d / "words_reward.py"}:reward",
         prompt_key: q, answer_key: a}}
    val: [{{name: sums, path: {d / "sums_val.jsonl"}}}, {{name: words, path: {d / "words_val.jsonl"}}}]
algorithm: {{name: grpo, steps: {steps}, prompts_per_step: 4, group_size: 2, max_new_tokens: {max_new_tokens}, {algorithm}}}
checkpoint: {{every_steps: 3, keep_last: 3}}
{extra}""")
    return path


def final_weights(run_dir: Path) -> str:
    """sha256 of the newest checkpoint's weights (what `rollout-hpc ckpt --json` prints, without a process)."""
    found = load_latest_valid(run_dir)
    assert found is not None
    return weights_digest(found[1])


def logged(run_dir: Path) -> list[tuple[int, int, int, int]]:
    """(step, prompt_id, domain, sample_idx) of every row of the trajectory log."""
    with TrajectoryReader(run_dir) as r:
        return list(zip(*(r.column(n).tolist() for n in ("step", "prompt_id", "domain", "sample_idx"))))


# --- the layout, the plan and the normalisation (pure) -----------------------------------------------------------


def test_quota_layout_maps_the_stream_onto_each_sources_own_stream_both_ways():
    layout = QuotaLayout([3, 1, 2])
    ids = np.arange(60)
    k, pos = layout.split(ids)
    assert np.bincount(k[:6]).tolist() == [3, 1, 2]  # every block of P = 6 holds each quota
    for source in range(3):  # each source's positions are 0, 1, 2, ... in stream order, and map back
        mine = ids[k == source]
        assert pos[k == source].tolist() == list(range(len(mine)))
        assert layout.index(source, pos[k == source]).tolist() == mine.tolist()
    assert mixture_quotas([3, 1, 2], 6) == [3, 1, 2] and mixture_quotas([1, 1, 1], 8) == [2, 2, 4]


def test_dynamic_sampling_refills_each_source_from_its_own_share_of_the_block():
    plan = StepPlan(step=1, prompts_per_step=4, max_rounds=3, quotas=[3, 1])  # block [12, 24): 3 blocks of 4
    assert plan.round == range(12, 16)  # round 0: the quotas, contiguous
    assert plan.advance(np.array([3, 0]))  # sums complete, words missing its one group
    assert list(plan.round) == [19]  # words' next slot: position 4 of its stream (block 4, offset 3)
    assert plan.advance(np.array([0, 0]))
    assert list(plan.round) == [23]
    assert not plan.advance(np.array([0, 1])) and plan.rounds == 3 and plan.informative == 4
    assert list(plan.prompts) == [12, 13, 14, 15, 19, 23]
    # Without refills a mixed step is still the contiguous block [s*P, (s+1)*P).
    assert StepPlan(step=5, prompts_per_step=4, quotas=[3, 1]).prompts == range(20, 24)


def test_informative_groups_are_counted_per_source():
    cfg = load_config(
        None,
        ["task.name=dataset", "task.params.train=[{name: a, path: x, weight: 3}, {name: b, path: y}]"]
        + ["algorithm.name=dapo", "algorithm.group_size=2", "algorithm.prompts_per_step=4"],
    )
    rewards = [1, 0, 1, 1, 0, 1, 0, 1]  # prompts 0..3: groups 0, 2 (source a) and 3 (source b) are informative
    batch = TrajectoryBatch.from_records(
        [{"prompt_id": i // 2, "sample_idx": i % 2, "reward": r, "response_ids": [1]} for i, r in enumerate(rewards)]
    )
    assert informative_groups(cfg, batch).tolist() == [2, 1]


@pytest.mark.parametrize("name", ["reinforce_pp", "ppo"])
def test_batch_whitening_is_per_domain(name):
    torch.manual_seed(0)
    rewards = torch.cat([torch.rand(4) * 10 + 5, torch.rand(4)])  # domain 0 pays ten times more
    mask, domains = torch.ones(8, 3), torch.tensor([0] * 4 + [1] * 4)
    extra = {"values": torch.zeros(8, 3)} if name == "ppo" else {}
    adv = algos.compute_advantages(name, rewards, 2, mask, domains=domains, **extra)
    for d in (0, 1):
        rows = adv[domains == d]
        assert abs(float(rows.mean())) < 1e-5 and abs(float(rows.std()) - 1.0) < 1e-3
    pooled = algos.compute_advantages(name, rewards, 2, mask, **extra)
    assert float(pooled[domains == 1].mean()) < -0.5  # pooled, the small domain's rows all look bad


def test_a_log_from_before_the_domain_field_reads_as_domain_0_and_gains_the_column(tmp_path):
    """`domain` took a byte of the record's padding (same record size and layout version): an older log has no
    /traj/domain, reads as domain 0, and gets the column (zeros for its old rows) when a resumed run reopens it."""
    batch = TrajectoryBatch.from_records(
        [{"prompt_id": i, "sample_idx": 0, "reward": 1.0, "domain": 1, "response_ids": [1, 2]} for i in range(3)]
    )
    with TrajectoryLog.open_for_append(tmp_path, {"run_name": "old"}) as log:
        log.append(batch, 0)
        log.append_metrics(0, {})
    with h5py.File(tmp_path / "trajectories.h5", "r+") as f:
        del f["traj/domain"]  # as an older rollout-hpc wrote it
    with TrajectoryReader(tmp_path) as r:
        assert not r.has_column("domain") and r.column("domain").tolist() == [0, 0, 0]
    with TrajectoryLog.open_for_append(tmp_path, resume_step=0) as log:
        assert log.reconciled["upgraded"] == ["/traj/domain"]
        log.append(batch, 1)
    with TrajectoryReader(tmp_path) as r:
        assert r.column("domain").tolist() == [0, 0, 0, 1, 1, 1]


# --- validation ---------------------------------------------------------------------------------------------------


def test_quota_errors_name_the_source_and_the_fix(tmp_path):
    write_data(tmp_path, n_words=2)
    zero = write_config(tmp_path, "zero", steps=2, weights=(1, 20))  # sums: floor(1/21 x 4) = 0 prompts a step
    done = cli("validate", zero, cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "source 'sums' gets 0 of the 4 prompts" in done.stderr
    assert "raise its weight or algorithm.prompts_per_step" in done.stderr
    big = write_config(tmp_path, "big", steps=2, weights=(1, 3))  # words: a quota of 3 from 2 rows
    for command in ("validate", "submit"):
        done = cli(command, big, cwd=tmp_path)
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        assert "source 'words' has 2 training rows but a quota of 3" in done.stderr
    assert not (tmp_path / "runs" / "big").exists()


def test_each_source_is_scored_by_its_own_reward(tmp_path):
    write_data(tmp_path)
    cfg = load_config(write_config(tmp_path, "rewards", steps=1))
    task = load_task(cfg.task)
    stream = task.prompts(cfg.run.seed)
    sums = next(stream[i] for i in range(4) if stream[i].domain == "sums")
    words = next(stream[i] for i in range(4) if stream[i].domain == "words")
    assert task.reward(sums, sums.answer) == 1.0 and task.reward(sums, "no") == 0.0  # task.reward: exact
    assert task.reward(words, "anything") == 0.75  # its own plugin, told the source


def test_a_source_without_a_reward_and_a_shared_val_file_need_task_reward(tmp_path):
    write_data(tmp_path)

    def task_of(sums_reward: str = "", *extra: str):
        sums = f"{{name: sums, path: {tmp_path / 'sums.jsonl'}{sums_reward}}}"
        words = f"{{name: words, path: {tmp_path / 'words.jsonl'}, reward: exact, prompt_key: q, answer_key: a}}"
        overrides = ["task.name=dataset", f"task.params.train=[{sums}, {words}]", "algorithm.prompts_per_step=2"]
        return load_task(load_config(None, [*overrides, *extra]).task)

    with pytest.raises(TaskError, match="source 'sums' has no reward"):
        task_of()
    shared_val = f"task.params.val={tmp_path / 'sums_val.jsonl'}"
    with pytest.raises(TaskError, match="task.params.val is one file"):
        task_of(", reward: exact", shared_val)
    task = task_of(", reward: exact", shared_val, "task.reward=exact")
    held_out = task.eval_prompts(0)
    assert len(held_out) == 1 and held_out[0].domain is None and task.reward(held_out[0], "4") == 1.0


# --- end to end ---------------------------------------------------------------------------------------------------


def test_mixed_run_exact_quotas_resume_exactly_once_and_domains_in_analysis(tmp_path):
    """sums: 10 rows, 3 a step (its epoch ends inside step 3); words: 2 rows, 1 a step (epochs end after steps
    1 and 3). A run stopped after step 3 and resumed to 5 logs the rows of an uninterrupted run and ends with its
    weights."""
    write_data(tmp_path)
    for sub in ("a", "b"):
        (tmp_path / sub).mkdir()
    straight = write_config(tmp_path / "a", "straight", steps=5, extra="eval: {every_steps: 0, at_start: false}")
    done = cli("submit", straight, cwd=tmp_path / "a")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "(sums " in done.stdout and " words " in done.stdout  # the progress line breaks the reward down
    first = write_config(tmp_path / "b", "split", steps=3)
    assert cli("submit", first, cwd=tmp_path / "b").returncode == 0
    split_dir = tmp_path / "b" / "runs" / "split"
    done = cli("resume", split_dir, "--set", "algorithm.steps=5", cwd=tmp_path / "b")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    straight_dir = tmp_path / "a" / "runs" / "straight"

    rows = logged(straight_dir)
    assert sorted(logged(split_dir)) == sorted(rows) and len(rows) == len(set(rows)) == 5 * 4 * 2
    per_step = Counter((s, d) for s, _, d, _ in rows)
    assert per_step == Counter({(s, d): q * 2 for s in range(5) for d, q in enumerate((3, 1))})  # the quotas x G
    assert final_weights(split_dir) == final_weights(straight_dir)

    # Each source's stream advanced by its quota a step, every row once per epoch, across its own boundaries.
    cfg = load_config(straight_dir / "config.resolved.yaml")
    stream = load_task(cfg.task, data_dir=straight_dir / "data").prompts(cfg.run.seed)
    positions = {0: [], 1: []}
    for _, p, d, k in rows:
        source, pos = stream.cursor(p)
        assert source == d
        if k == 0:
            positions[d].append(pos)
    assert sorted(positions[0]) == list(range(15)) and sorted(positions[1]) == list(range(5))
    for epoch in (0, 1):  # words: rows 0 and 1 once in each of its first two epochs (a new order each)
        assert sorted(stream.streams[1].position(p) for p in positions[1] if p // 2 == epoch) == [0, 1]
    assert sorted(stream.streams[0].position(p) for p in positions[0] if p < 10) == list(range(10))
    with TrajectoryReader(straight_dir) as r:
        reward, domain = r.column("reward"), r.column("domain")
        metrics = r.metrics()
    assert set(reward[domain == 1].tolist()) == {0.75} and set(reward[domain == 0].tolist()) <= {0.0, 1.0}
    assert metrics["samples/sums"].tolist() == [6.0] * 5 and metrics["samples/words"].tolist() == [2.0] * 5

    done = cli("analyze", straight_dir, "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    domains = json.loads(done.stdout)["domains"]
    assert list(domains) == ["sums", "words"]
    assert domains["sums"]["samples"] == [6] * 5 and domains["words"]["samples"] == [2] * 5
    assert domains["words"]["reward"] == [0.75] * 5 and domains["sums"]["step"] == list(range(5))
    assert domains["sums"]["eval_step"] == [5] and len(domains["words"]["accuracy"]) == 1


def test_dynamic_sampling_refills_the_source_that_misses_groups(tmp_path):
    """words' reward is constant, so its group never teaches anything: each step refills words (and whatever sums
    misses) up to max_rounds, from words' own share of the step's block; trainers replay the same rounds."""
    write_data(tmp_path, n_words=4)
    cfg_path = write_config(
        tmp_path, "dapo", steps=2, algorithm="dynamic_sampling: true, dynamic_sampling_max_rounds: 2"
    )
    done = cli("submit", cfg_path, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = logged(tmp_path / "runs" / "dapo")
    cfg = load_config(tmp_path / "runs" / "dapo" / "config.resolved.yaml")
    stream = load_task(cfg.task, data_dir=tmp_path / "runs" / "dapo" / "data").prompts(cfg.run.seed)
    for step in range(2):
        words = sorted({stream.cursor(p)[1] for s, p, d, _ in rows if s == step and d == 1})
        assert words == [2 * step, 2 * step + 1]  # round 0 and one refill, from its block [2s, 2s + 2)


def test_extra_prompts_keep_each_sources_quota_and_resume_exactly_once(tmp_path):
    """generator.extra_prompts on a mixture, two generator ranks (rank 0's slice of the step is sums', rank 1's
    words'), one extra prompt each: every step trains each source's quota, every prompt of each source's stream once
    (the one passed over is trained at the next step), and a run stopped at step 3 and resumed logs the same rows
    and ends with the same weights as the run never stopped."""
    write_data(tmp_path, n_words=4)
    for sub in ("a", "b"):
        (tmp_path / sub).mkdir()
    stops = json.dumps(list("0123456789abcdefghijklmnopqrstuvwxyz"))  # answers end at random tokens
    options = dict(
        weights=(1, 1),
        algorithm=f"stop: {stops}",
        max_new_tokens=6,
        extra="generator: {extra_prompts: 2, tasks_per_node: 2}\neval: {every_steps: 0, at_start: false}",
    )
    straight = write_config(tmp_path / "a", "straight", steps=6, **options)
    done = cli("submit", straight, cwd=tmp_path / "a")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    straight_dir = tmp_path / "a" / "runs" / "straight"
    assert "aborted" in (straight_dir / "logs" / "local-0.out").read_text()  # the tails were cut
    assert cli("submit", write_config(tmp_path / "b", "split", steps=3, **options), cwd=tmp_path / "b").returncode == 0
    split_dir = tmp_path / "b" / "runs" / "split"
    done = cli("resume", split_dir, "--set", "algorithm.steps=6", cwd=tmp_path / "b")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]

    rows = logged(straight_dir)
    assert sorted(logged(split_dir)) == sorted(rows) and len(rows) == len(set(rows)) == 6 * 4 * 2
    assert Counter((s, d) for s, _, d, _ in rows) == Counter({(s, d): 2 * 2 for s in range(6) for d in (0, 1)})
    assert final_weights(split_dir) == final_weights(straight_dir)
    cfg = load_config(straight_dir / "config.resolved.yaml")
    stream = load_task(cfg.task, data_dir=straight_dir / "data").prompts(cfg.run.seed)
    by_step: dict[int, dict[int, set]] = {}
    for s, p, d, _ in rows:
        source, pos = stream.cursor(p)
        assert source == d
        by_step.setdefault(s, {0: set(), 1: set()})[d].add(pos)
    passed_over = 0
    for d in (0, 1):
        seen: set = set()
        for s in range(6):
            assert not seen & by_step[s][d]  # each position of the source's stream trained once
            if s:  # what step s-1 passed over (below the highest it trained) is trained at step s
                skipped = set(range(max(by_step[s - 1][d]))) - seen
                assert skipped <= by_step[s][d]
                passed_over += len(skipped)
            seen |= by_step[s][d]
        assert len(set(range(max(seen) + 1)) - seen) <= 1  # nothing skipped but the last step's deferred one
    assert passed_over  # the choice depended on which groups finished first
    with TrajectoryReader(straight_dir) as r:
        m = r.metrics()
    assert m["deferred_prompts"].tolist() == [2.0] * 6 and m["retried_prompts"].tolist() == [0.0] + [2.0] * 5


def test_dynamic_sampling_with_extra_prompts_keeps_each_sources_quota_of_informative_groups(tmp_path):
    """Dynamic sampling, extra prompts and a mixture together (two generator ranks: sums on rank 0, words on rank 1;
    each owes its source 2 groups a step and has 1 extra): sums' reward is the answer's length parity (informative
    for some groups), words' a constant (never). Every step takes, per source, groups in finishing order until 2
    are informative, or all 3 candidates; words always all 3; each prompt once; groups_kept counts the informative."""
    write_data(tmp_path, n_words=4)
    (tmp_path / "parity.py").write_text("def reward(prompt, text):\n    return float(len(text) % 2)\n")
    stops = json.dumps(list("0123456789abcdefghijklmnopqrstuvwxyz"))
    path = write_config(
        tmp_path,
        "mixdyn",
        steps=6,
        weights=(1, 1),
        algorithm=f"dynamic_sampling: true, stop: {stops}",
        max_new_tokens=6,
        extra="generator: {extra_prompts: 2, tasks_per_node: 2}\neval: {every_steps: 0, at_start: false}",
    )
    path.write_text(path.read_text().replace("reward: exact", f'reward: "{tmp_path / "parity.py"}:reward"'))
    done = cli("submit", path, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    run_dir = tmp_path / "runs" / "mixdyn"
    with TrajectoryReader(run_dir) as r:
        step, prompt, domain, reward = (r.column(c) for c in ("step", "prompt_id", "domain", "reward"))
        kept = r.metrics()["groups_kept"]
    assert len(set(prompt.tolist())) == len(set(zip(step.tolist(), prompt.tolist())))  # a prompt in one step only
    replaced = 0
    for s in range(6):
        informative = 0
        for d in (0, 1):
            rows = (step == s) & (domain == d)
            groups = [reward[rows & (prompt == p)] for p in np.unique(prompt[rows])]
            useful = sum(np.ptp(g) > 0 for g in groups)
            assert useful == 2 or len(groups) == 3, (s, d, [g.tolist() for g in groups])
            assert useful <= 2 and len(groups) <= 3
            if d == 1:
                assert useful == 0 and len(groups) == 3  # words never teaches: it takes every candidate
            replaced += d == 0 and useful == 2 and len(groups) == 3
            informative += useful
        assert kept[s] == informative
    assert replaced  # sums dropped an uninformative group and took another within the step
    assert (kept >= 1).all()
