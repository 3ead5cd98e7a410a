"""A dataset task end to end: a tiny Hugging Face model directory (Qwen2, ChatML template, two stop ids) trained with
GRPO on a prompt file with the math reward and validation, under mpirun; an epoch boundary crossed by a resumed run
(exactly once, the same weights as an uninterrupted run); rewards that raise, hang or return NaN inside a real run;
bad dataset files refused before anything is created. Real processes throughout: `rollout-hpc submit --local`."""

from __future__ import annotations

import json
import random
import time
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_resume_local import cli, weights_digest
from tiny_hf import make_tiny_qwen

from rollout_hpc.envs.datafile import EpochShuffled, PromptRows, open_arrow
from rollout_hpc.store.trajlog import TrajectoryReader


def problems(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.randint(0, 4), rng.randint(0, 4)
        rows.append(
            {
                "question": [{"role": "user", "content": f"What is {a}+{b}?"}],
                "answer": f"#### {a + b}",
                "source": f"p{i}",
            }
        )
    return rows


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_qwen(tmp_path_factory.mktemp("model") / "tiny-qwen")


def write_config(
    directory: Path,
    name: str,
    model: Path,
    train: Path,
    *,
    steps: int,
    prompts: int = 4,
    extra: str = "",
    task_extra: str = "",
    reward: str = "math",
    params: str = "val_fraction: 0.2",
) -> Path:
    path = directory / f"{name}.yaml"
    path.write_text(f"""
run: {{name: {name}, seed: 3}}
launcher: local
model: {{path: {model}}}
task:
  name: dataset
  reward: "{reward}"
  {task_extra}
  params: {{train: {train}, prompt_key: question, answer_key: answer, {params}}}
algorithm: {{name: grpo, steps: {steps}, prompts_per_step: {prompts}, group_size: 4, max_new_tokens: 4, lr: 1.0e-3}}
checkpoint: {{every_steps: 2, keep_last: 5}}
{extra}""")
    return path


def analyze(run_dir: Path) -> dict:
    done = cli("analyze", run_dir, "--json", cwd=run_dir.parent)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def logged(run_dir: Path) -> list[tuple[int, int, int]]:
    with TrajectoryReader(run_dir) as r:
        return list(zip(*(r.column(n).tolist() for n in ("step", "prompt_id", "sample_idx"))))


def test_parquet_chat_prompts_math_reward_and_eval(tmp_path, model_dir):
    pq.write_table(pa.Table.from_pylist(problems(30)), tmp_path / "train.parquet")
    cfg = write_config(
        tmp_path,
        "gsm",
        model_dir,
        tmp_path / "train.parquet",
        steps=6,
        extra="eval: {every_steps: 3, at_start: true, samples_per_prompt: 2, greedy: false}",
    )
    done = cli("submit", cfg, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    run_dir = tmp_path / "runs" / "gsm"
    assert "eval step 0" in done.stdout and "eval step 6" in done.stdout

    summary = analyze(run_dir)
    ev = summary["eval"]
    assert ev["step"] == [0, 3, 6]  # at start, every 3 steps, after the last step
    assert ev["prompts"] == [6.0] * 3 and ev["k"] == [2.0] * 3  # val_fraction 0.2 of 30 rows, 2 samples each
    assert all(0.0 <= a <= 1.0 for a in ev["accuracy"]) and all(0.0 <= p <= 1.0 for p in ev["pass_at_k"])
    assert all(p >= a for p, a in zip(ev["pass_at_k"], ev["accuracy"]))  # any of k passes >= share passing

    # The rows were frozen into the run directory; each step trained the next prompts of the seeded epoch order.
    train = open_arrow(run_dir / "data" / "train.arrow")
    assert train.num_rows == 24 and open_arrow(run_dir / "data" / "val.arrow").num_rows == 6
    stream = EpochShuffled(PromptRows(train, "question", "answer"), seed=3)
    rows = logged(run_dir)
    assert sorted({p for _, p, _ in rows}) == list(range(24))  # 6 steps x 4 prompts: exactly one epoch
    assert Counter(stream.position(p) for _, p, _ in rows) == Counter({i: 4 for i in range(24)})  # 4 samples per row

    # The trajectory log holds the exact chat-formatted prompt the model saw, ending with the opened assistant turn.
    done = cli("samples", run_dir, "--best", "1", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "<|im_start|>user\nWhat is" in done.stdout and "<|im_start|>assistant" in done.stdout


def test_epoch_boundary_resumed_run_matches_an_uninterrupted_one(tmp_path, model_dir):
    """10 rows, 4 prompts a step: step 2 takes the last 2 rows of epoch 0 and the first 2 of epoch 1. A run stopped
    after step 3 (its checkpoint falls mid-epoch 1) and resumed to step 7 trains every sample once and ends with the
    weights of a run that was never interrupted."""
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in problems(10, seed=1)))
    (tmp_path / "a").mkdir()
    (tmp_path / "val.jsonl").write_text("".join(json.dumps(r) + "\n" for r in problems(5, seed=2)))
    params, ev = f"val: {tmp_path / 'val.jsonl'}", "eval: {every_steps: 2, at_start: false}"
    straight = write_config(
        tmp_path / "a", "straight", model_dir, tmp_path / "train.jsonl", steps=7, params=params, extra=ev
    )
    assert cli("submit", straight, cwd=tmp_path / "a").returncode == 0
    (tmp_path / "b").mkdir()
    first = write_config(tmp_path / "b", "split", model_dir, tmp_path / "train.jsonl", steps=3, params=params, extra=ev)
    done = cli("submit", first, cwd=tmp_path / "b")
    assert done.returncode == 0, done.stderr[-2000:]
    run_dir = tmp_path / "b" / "runs" / "split"
    done = cli("resume", run_dir, "--set", "algorithm.steps=7", cwd=tmp_path / "b")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "after step 3" in done.stdout + done.stderr

    rows = logged(run_dir)
    assert len(rows) == len(set(rows)) == 7 * 4 * 4
    assert sorted({(s, p) for s, p, _ in rows}) == [(p // 4, p) for p in range(28)]
    stream = EpochShuffled(PromptRows(open_arrow(run_dir / "data" / "train.arrow"), "question", "answer"), seed=3)
    epochs = Counter(stream.cursor(p)[0] for p in range(28))
    assert epochs == Counter({0: 10, 1: 10, 2: 8})  # two boundaries crossed, each row once per epoch
    assert weights_digest(run_dir) == weights_digest(tmp_path / "a" / "runs" / "straight")
    # Eval at point p runs on policy version p, after the checkpoint of step p: a resume from step 3 drops the first
    # allocation's eval of version 3 (the final point of a 3-step run, no point of the 7-step one) and evaluates 4, 6
    # and the final 7. Greedy evals of the same weights agree with the uninterrupted run's.
    split_eval, straight_eval = analyze(run_dir)["eval"], analyze(tmp_path / "a" / "runs" / "straight")["eval"]
    assert split_eval["step"] == straight_eval["step"] == [2, 4, 6, 7]
    for key in ("accuracy", "mean_reward", "response_len_mean"):
        assert split_eval[key] == straight_eval[key]


FAULTY_REWARD = """
import math, time
def reward(prompt, text):
    n = int(prompt.meta["source"][1:])
    if n % 5 == 1:
        raise RuntimeError("cannot score " + prompt.meta["source"])
    if n % 5 == 2:
        time.sleep(3600)
    return 1.0 if text.strip() else 0.5

def nan_reward(prompt, text):
    return math.nan
"""


def test_rewards_that_raise_or_hang_cost_samples_not_the_run(tmp_path, model_dir):
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in problems(20)))
    (tmp_path / "faulty.py").write_text(FAULTY_REWARD)
    cfg = write_config(
        tmp_path,
        "faulty",
        model_dir,
        tmp_path / "train.jsonl",
        steps=3,
        params="shuffle: false",
        reward=f"{tmp_path / 'faulty.py'}:reward",
        task_extra="reward_timeout: 1.0",
    )
    t0 = time.monotonic()
    done = cli("submit", cfg, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert time.monotonic() - t0 < 120
    assert "reward errors" in done.stdout  # the progress line counts them
    run_dir = tmp_path / "runs" / "faulty"
    with TrajectoryReader(run_dir) as r:
        source = [int(p) for p in r.column("prompt_id")]
        status, reward = r.column("reward_status").tolist(), r.column("reward").tolist()
    for p, st, rw in zip(source, status, reward):  # shuffle off: prompt i is row i
        assert st == {1: 1, 2: 2}.get(p % 5, 0), (p, st)
        assert rw == 0.0 if p % 5 in (1, 2) else rw in (0.5, 1.0)
    summary = analyze(run_dir)
    assert summary["reward_errors"] == status.count(1) + status.count(2) > 0
    assert summary["reward_timeouts"] == status.count(2) > 0


def test_a_nan_reward_ends_the_run_with_the_plugins_name(tmp_path, model_dir):
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in problems(20)))
    (tmp_path / "faulty.py").write_text(FAULTY_REWARD)
    cfg = write_config(
        tmp_path, "nan", model_dir, tmp_path / "train.jsonl", steps=50, reward=f"{tmp_path / 'faulty.py'}:nan_reward"
    )
    t0 = time.monotonic()
    done = cli("submit", cfg, cwd=tmp_path, timeout=120)
    assert time.monotonic() - t0 < 60  # ended at once, not at a time limit
    assert done.returncode != 0
    out = done.stdout + done.stderr
    assert "nan_reward" in out and "nan" in out.lower(), out[-3000:]


@pytest.mark.parametrize(
    "rows, message",
    [
        ([{"q": "1+1", "answer": "2"}], "'question'"),
        ([{"question": "a", "answer": "1"}, {"question": 5, "answer": "2"}], "row 1"),
        ([], "has no rows"),
    ],
)
def test_bad_dataset_files_are_refused_before_anything_is_created(tmp_path, model_dir, rows, message):
    data = tmp_path / "bad.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = write_config(tmp_path, "bad", model_dir, data, steps=2)
    for command in ("validate", "submit"):
        done = cli(command, cfg, cwd=tmp_path)
        assert done.returncode == 2, (command, done.stdout, done.stderr)
        assert str(data) in done.stderr and message in done.stderr, done.stderr
        assert "Traceback" not in done.stderr
    assert not (tmp_path / "runs" / "bad").exists()


def test_dataset_task_needs_a_reward_and_eval_needs_held_out_prompts(tmp_path, model_dir):
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in problems(8)))
    cfg = write_config(tmp_path, "noreward", model_dir, tmp_path / "train.jsonl", steps=2, reward="")
    done = cli("validate", cfg, cwd=tmp_path)
    assert done.returncode == 2 and "task.reward" in done.stderr and "math" in done.stderr
    cfg = write_config(
        tmp_path,
        "noval",
        model_dir,
        tmp_path / "train.jsonl",
        steps=2,
        params="shuffle: true",
        extra="eval: {every_steps: 1}",
    )
    done = cli("validate", cfg, cwd=tmp_path)
    assert done.returncode == 2 and "val_fraction" in done.stderr and "eval" in done.stderr


@pytest.mark.slurm
def test_dataset_task_with_eval_as_a_het_job(slurm_cluster, tmp_path, model_dir):
    """The same dataset run as a heterogeneous job on the local Slurm cluster: 2 generator ranks on one node,
    1 trainer; the eval prompts are shared over both generators and the curve lands in the log."""
    pq.write_table(pa.Table.from_pylist(problems(24)), tmp_path / "train.parquet")
    pq.write_table(pa.Table.from_pylist(problems(7, seed=9)), tmp_path / "val.parquet")
    cfg = write_config(
        tmp_path,
        "slurmds",
        model_dir,
        tmp_path / "train.parquet",
        steps=4,
        params=f"val: {tmp_path / 'val.parquet'}",
        extra="eval: {every_steps: 2, at_start: false}\ngenerator: {tasks_per_node: 2}",
    )
    done = cli("submit", cfg, "--set", "launcher=slurm", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    job_id = next(l for l in done.stdout.splitlines() if l.startswith("submitted job")).split()[-1]
    state = slurm_cluster.wait_job(int(job_id), timeout=300)
    run_dir = tmp_path / "runs" / "slurmds"
    logs = "".join(p.read_text() for p in (run_dir / "logs").glob(f"slurm-{job_id}.*"))
    assert state == "COMPLETED", logs[-3000:]
    ev = analyze(run_dir)["eval"]
    assert ev["step"] == [2, 4] and ev["prompts"] == [7.0, 7.0]  # 7 held-out prompts split 4 + 3 over the generators
    rows = logged(run_dir)
    assert len(rows) == len(set(rows)) == 4 * 4 * 4
